"""The Hugging Face tests need nsa-core's ``hf`` extra: transformers in the range
``nsa_core.hf.versions`` supports. The CPU tiers install it (noxfile.py, the README's commands)
and run every test here. Elsewhere (a GPU host's Python, with no transformers or another release
of it) ``nsa_core.hf`` refuses to import, so these files are not collected, and the run's header
says why; ``test_hf_imports.py``, which needs no transformers, runs everywhere."""

from __future__ import annotations

try:
    import nsa_core.hf  # noqa: F401  (its import checks the transformers release)

    _WHY_NOT: str | None = None
except ImportError as err:
    _WHY_NOT = str(err)

if _WHY_NOT is not None:
    collect_ignore_glob = ["test_hf_[!i]*.py"]


def pytest_report_header() -> str | None:
    return None if _WHY_NOT is None else f"nsa_core.hf tests not collected: {_WHY_NOT}"
