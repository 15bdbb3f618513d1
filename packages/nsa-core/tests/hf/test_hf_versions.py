"""The transformers version check: the tested range only, refused by name otherwise."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

from nsa_core.hf import versions


@pytest.mark.parametrize("found", ["5.23.2", "5.25.0", "4.57.6", "6.0.0", "5.25.0.dev0"])
def test_import_refuses_a_transformers_outside_the_range(
    monkeypatch: pytest.MonkeyPatch, found: str
) -> None:
    monkeypatch.setattr(versions, "installed_transformers", lambda: found)
    # Import the package afresh: its first statement is the check.
    monkeypatch.delitem(sys.modules, "nsa_core.hf")
    with pytest.raises(ImportError, match=re.escape(f"transformers {found} is installed")) as err:
        importlib.import_module("nsa_core.hf")
    assert "transformers>=5.24,<5.25" in str(err.value)


@pytest.mark.parametrize("found", ["5.24.0", "5.24.3", "5.24.0rc1", "5.24.0+local"])
def test_check_accepts_the_tested_range(monkeypatch: pytest.MonkeyPatch, found: str) -> None:
    monkeypatch.setattr(versions, "installed_transformers", lambda: found)
    assert versions.check_transformers() == found


def test_check_names_a_missing_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(versions, "installed_transformers", lambda: None)
    with pytest.raises(ModuleNotFoundError, match="transformers is not installed") as err:
        versions.check_transformers()
    assert err.value.name == "transformers"


def test_the_hf_extra_states_the_table_range() -> None:
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    extra = re.search(r"^hf = \[(.*)\]$", pyproject.read_text(), re.MULTILINE)
    assert extra is not None, "nsa-core's pyproject.toml has no hf extra"
    assert f'"transformers{versions.supported_text()}"' in extra[1]
