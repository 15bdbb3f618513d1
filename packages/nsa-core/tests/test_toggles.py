"""NSA_* toggles: typed defaults, parsing, and errors that name the toggle."""

from __future__ import annotations

import dataclasses
import re

import pytest

from nsa_core import toggles as toggles_module
from nsa_core.toggles import Toggles, get_toggles, reload_toggles

# The documented table of toggles (module docstring of nsa_core.toggles): name -> default.
DOCUMENTED_DEFAULTS: dict[str, bool | int | str] = {
    "NSA_SCORE_BACKEND": "auto",
    "NSA_CMP_BACKEND": "auto",
    "NSA_SEL_BACKEND": "auto",
    "NSA_WIN_BACKEND": "auto",
    "NSA_USE_TRITON_SEL": True,
    "NSA_TRITON_SEL_FORCE": False,
    "NSA_SEL_TRITON_ALLOW_GRAD": True,
    "NSA_SEL_TRITON_MIN_L": 0,
    "NSA_SEL_TRITON_GROUP": True,
    "NSA_SEL_TRITON_BLOCK_D": 0,
    "NSA_SEL_TRITON_BLOCK_L": 0,
    "NSA_SEL_TRITON_BLOCK_DV": 0,
    "NSA_SEL_TRITON_CHECK_INDICES": False,
    "NSA_USE_FA2": True,
    "NSA_FA2_MIN_LEN_WIN": 16,
    "NSA_FA2_MIN_LEN_CMP": 16,
    "NSA_FA2_FORCE_VARLEN": False,
    "NSA_FA2_FORCE_DENSE": False,
    "NSA_USE_CUDA_SEL": False,
    "NSA_DEBUG_LOG": False,
    "NSA_LOG_LIMIT": 10,
    "NSA_DEBUG_TIMING": False,
    "NSA_DEBUG_SHAPES": False,
    "NSA_DEBUG_COMPARE": False,
}

BOOL_TOGGLES = [name for name, value in DOCUMENTED_DEFAULTS.items() if isinstance(value, bool)]
INT_TOGGLES = [name for name, value in DOCUMENTED_DEFAULTS.items() if type(value) is int]
NAME_TOGGLES = [name for name, value in DOCUMENTED_DEFAULTS.items() if isinstance(value, str)]
BLOCK_TOGGLES = ["NSA_SEL_TRITON_BLOCK_D", "NSA_SEL_TRITON_BLOCK_L", "NSA_SEL_TRITON_BLOCK_DV"]


def field_of(env_name: str) -> str:
    return env_name.removeprefix("NSA_").lower()


def test_every_documented_toggle_is_a_field() -> None:
    names = {"NSA_" + f.name.upper() for f in dataclasses.fields(Toggles)}
    assert names == set(DOCUMENTED_DEFAULTS)


def test_defaults_from_empty_environment() -> None:
    toggles = Toggles.from_env({})
    assert toggles == Toggles()
    for name, default in DOCUMENTED_DEFAULTS.items():
        value = getattr(toggles, field_of(name))
        assert type(value) is type(default), name
        assert value == default, name


def test_unrelated_variables_are_ignored() -> None:
    assert Toggles.from_env({"PATH": "/bin", "NSA_": "1", "NSAX_USE_FA2": "1"}) == Toggles()


@pytest.mark.parametrize("name", BOOL_TOGGLES)
@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("1", True),
        ("true", True),
        ("TRUE", True),
        ("yes", True),
        ("on", True),
        (" 1 ", True),
        ("0", False),
        ("false", False),
        ("No", False),
        ("off", False),
        ("", False),
    ],
)
def test_bool_toggle_parses(name: str, raw: str, expected: bool) -> None:
    assert getattr(Toggles.from_env({name: raw}), field_of(name)) is expected


@pytest.mark.parametrize("name", BOOL_TOGGLES)
@pytest.mark.parametrize("raw", ["2", "maybe", "enable", "-1", "1.0"])
def test_bad_bool_names_the_toggle(name: str, raw: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"{name}={raw!r} is not a boolean")):
        Toggles.from_env({name: raw})


@pytest.mark.parametrize("name", INT_TOGGLES)
@pytest.mark.parametrize(("raw", "expected"), [("0", 0), ("64", 64), (" 128 ", 128)])
def test_int_toggle_parses(name: str, raw: str, expected: int) -> None:
    value = getattr(Toggles.from_env({name: raw}), field_of(name))
    assert type(value) is int
    assert value == expected


@pytest.mark.parametrize("name", INT_TOGGLES)
@pytest.mark.parametrize("raw", ["abc", "1.5", "", "0x10", "true"])
def test_bad_int_names_the_toggle(name: str, raw: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"{name}={raw!r} is not an integer")):
        Toggles.from_env({name: raw})


@pytest.mark.parametrize("name", INT_TOGGLES)
def test_negative_int_names_the_toggle(name: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"{name}='-4' must be >= 0")):
        Toggles.from_env({name: "-4"})


def test_force_varlen_and_force_dense_conflict() -> None:
    env = {"NSA_FA2_FORCE_VARLEN": "1", "NSA_FA2_FORCE_DENSE": "1"}
    with pytest.raises(ValueError, match="NSA_FA2_FORCE_VARLEN and NSA_FA2_FORCE_DENSE"):
        Toggles.from_env(env)
    assert Toggles.from_env({"NSA_FA2_FORCE_VARLEN": "1"}).fa2_force_varlen
    assert Toggles.from_env({"NSA_FA2_FORCE_DENSE": "1"}).fa2_force_dense


@pytest.mark.parametrize("name", BLOCK_TOGGLES)
@pytest.mark.parametrize("raw", ["0", "1", "16", "32", "128"])
def test_block_size_power_of_two_accepted(name: str, raw: str) -> None:
    assert getattr(Toggles.from_env({name: raw}), field_of(name)) == int(raw)


@pytest.mark.parametrize("name", BLOCK_TOGGLES)
@pytest.mark.parametrize("raw", ["3", "24", "100"])
def test_block_size_not_power_of_two_names_the_toggle(name: str, raw: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"{name}={raw} must be 0 or a power of two")):
        Toggles.from_env({name: raw})


def test_env_names_round_trip() -> None:
    toggles = Toggles.from_env({"NSA_USE_FA2": "1", "NSA_LOG_LIMIT": "3"})
    names = toggles.env_names()
    assert set(names) == set(DOCUMENTED_DEFAULTS)
    assert names["NSA_USE_FA2"] == "True"
    assert names["NSA_LOG_LIMIT"] == "3"
    assert Toggles.from_env(names) == toggles


def test_get_toggles_reads_os_environ_once_and_reload_rereads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    saved = toggles_module._cached
    try:
        monkeypatch.setenv("NSA_LOG_LIMIT", "7")
        assert reload_toggles().log_limit == 7
        monkeypatch.setenv("NSA_LOG_LIMIT", "8")
        assert get_toggles().log_limit == 7  # cached until reloaded
        assert reload_toggles().log_limit == 8
        assert get_toggles().log_limit == 8
        monkeypatch.setenv("NSA_LOG_LIMIT", "eight")
        with pytest.raises(ValueError, match="NSA_LOG_LIMIT"):
            reload_toggles()
    finally:
        monkeypatch.undo()
        toggles_module._cached = saved


@pytest.mark.parametrize("name", NAME_TOGGLES)
def test_backend_toggle_parses_a_name(name: str) -> None:
    assert getattr(Toggles.from_env({name: " Reference "}), field_of(name)) == "reference"


@pytest.mark.parametrize("name", NAME_TOGGLES)
@pytest.mark.parametrize("raw", ["", "fa2;rm", "a b"])
def test_bad_backend_name_names_the_toggle(name: str, raw: str) -> None:
    with pytest.raises(ValueError, match=re.escape(name)):
        Toggles.from_env({name: raw})
