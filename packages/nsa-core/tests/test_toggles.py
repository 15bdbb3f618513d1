"""NSA_* toggles: typed defaults, parsing, and errors that name the toggle."""

from __future__ import annotations

import dataclasses
import re
import warnings

import pytest

from nsa_core import toggles as toggles_module
from nsa_core.toggles import (
    Toggles,
    get_toggles,
    reload_toggles,
    toggles_overridden,
)

# The documented table of toggles (module docstring of nsa_core.toggles): name -> default.
DOCUMENTED_DEFAULTS: dict[str, bool | int | str] = {
    "NSA_CORE_BACKEND": "auto",
    "NSA_ROPE_BACKEND": "auto",
    "NSA_SCORE_BACKEND": "auto",
    "NSA_CMP_BACKEND": "auto",
    "NSA_CMP_FA2": True,
    "NSA_CMP_FA2_MIN_LEN": 16,
    "NSA_CMP_CUDNN": True,
    "NSA_SEL_BACKEND": "auto",
    "NSA_SEL_TRITON": True,
    "NSA_SEL_TRITON_FORCE": False,
    "NSA_SEL_TRITON_GRAD": True,
    "NSA_SEL_TRITON_MIN_LEN": 0,
    "NSA_SEL_TRITON_GROUP": True,
    "NSA_SEL_CHECK_INDICES": False,
    "NSA_SEL_CUDA": False,
    "NSA_WIN_BACKEND": "auto",
    "NSA_WIN_FA2": True,
    "NSA_WIN_FA2_MIN_LEN": 16,
    "NSA_COMBINE_BACKEND": "auto",
    "NSA_COMBINE_GRAD_SUM": True,
    "NSA_DEBUG_LOG": False,
    "NSA_DEBUG_LOG_LIMIT": 10,
    "NSA_DEBUG_TIMING": False,
    "NSA_DEBUG_SHAPES": False,
    "NSA_DEBUG_COMPARE": False,
    "NSA_DEBUG_FA2_VARLEN": False,
    "NSA_DEBUG_FA2_DENSE": False,
}

# Names that were once toggles: nothing reads them now.
RETIRED_NAMES = (
    "NSA_USE_TRITON_SEL",
    "NSA_TRITON_SEL_FORCE",
    "NSA_SEL_TRITON_ALLOW_GRAD",
    "NSA_SEL_TRITON_MIN_L",
    "NSA_SEL_TRITON_CHECK_INDICES",
    "NSA_USE_CUDA_SEL",
    "NSA_USE_FA2",
    "NSA_FA2_MIN_LEN_CMP",
    "NSA_FA2_MIN_LEN_WIN",
    "NSA_LOG_LIMIT",
    "NSA_FA2_FORCE_VARLEN",
    "NSA_FA2_FORCE_DENSE",
    "NSA_SEL_TRITON_BLOCK_L",
    "NSA_SEL_TRITON_BLOCK_D",
    "NSA_SEL_TRITON_BLOCK_DV",
)

BOOL_TOGGLES = [name for name, value in DOCUMENTED_DEFAULTS.items() if isinstance(value, bool)]
INT_TOGGLES = [name for name, value in DOCUMENTED_DEFAULTS.items() if type(value) is int]
NAME_TOGGLES = [name for name, value in DOCUMENTED_DEFAULTS.items() if isinstance(value, str)]
STEPS = ("CORE", "ROPE", "SCORE", "CMP", "SEL", "WIN", "COMBINE", "DEBUG")


def field_of(env_name: str) -> str:
    return env_name.removeprefix("NSA_").lower()


def test_every_documented_toggle_is_a_field() -> None:
    names = {"NSA_" + f.name.upper() for f in dataclasses.fields(Toggles)}
    assert names == set(DOCUMENTED_DEFAULTS)


def test_every_toggle_is_named_step_then_knob_and_in_the_docstring_table() -> None:
    doc = toggles_module.__doc__ or ""
    for name in DOCUMENTED_DEFAULTS:
        assert name.split("_")[1] in STEPS, name
        assert f"| {name} |" in doc, name


def test_defaults_from_empty_environment() -> None:
    toggles = Toggles.from_env({})
    assert toggles == Toggles()
    for name, default in DOCUMENTED_DEFAULTS.items():
        value = getattr(toggles, field_of(name))
        assert type(value) is type(default), name
        assert value == default, name


def test_unrelated_variables_are_ignored() -> None:
    assert Toggles.from_env({"PATH": "/bin", "NSA_": "1", "NSAX_SEL_TRITON": "0"}) == Toggles()


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


@pytest.mark.parametrize("name", INT_TOGGLES)
@pytest.mark.parametrize(("raw", "expected"), [("0", 0), ("64", 64), (" 128 ", 128)])
def test_int_toggle_parses(name: str, raw: str, expected: int) -> None:
    value = getattr(Toggles.from_env({name: raw}), field_of(name))
    assert type(value) is int
    assert value == expected


# (toggle, bad raw value, the rule its error states after "NAME='raw'")
BAD_VALUES = [
    *((name, raw, "is not a boolean") for name in BOOL_TOGGLES
      for raw in ["2", "maybe", "enable", "-1", "1.0"]),
    *((name, raw, "is not an integer") for name in INT_TOGGLES
      for raw in ["abc", "1.5", "", "0x10", "true"]),
    *((name, "-4", "must be >= 0") for name in INT_TOGGLES),
]  # fmt: skip


@pytest.mark.parametrize(("name", "raw", "rule"), BAD_VALUES)
def test_bad_value_names_the_toggle_and_the_rule(name: str, raw: str, rule: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"{name}={raw!r} {rule}")):
        Toggles.from_env({name: raw})


def test_fa2_varlen_and_fa2_dense_conflict() -> None:
    env = {"NSA_DEBUG_FA2_VARLEN": "1", "NSA_DEBUG_FA2_DENSE": "1"}
    with pytest.raises(ValueError, match="NSA_DEBUG_FA2_VARLEN and NSA_DEBUG_FA2_DENSE"):
        Toggles.from_env(env)
    assert Toggles.from_env({"NSA_DEBUG_FA2_VARLEN": "1"}).debug_fa2_varlen
    assert Toggles.from_env({"NSA_DEBUG_FA2_DENSE": "1"}).debug_fa2_dense


@pytest.mark.parametrize("old", RETIRED_NAMES)
def test_retired_names_are_read_by_nothing(old: str) -> None:
    """The old spellings left with no release behind them: setting one changes no toggle."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Toggles.from_env({old: "1"}) == Toggles()


def test_tiles_are_not_toggles() -> None:
    names = {f.name for f in dataclasses.fields(Toggles)}
    assert not any("block" in name for name in names)
    assert Toggles.from_env({"NSA_SEL_TRITON_BLOCK_L": "32"}) == Toggles()


def test_env_names_round_trip() -> None:
    toggles = Toggles.from_env({"NSA_WIN_FA2": "0", "NSA_DEBUG_LOG_LIMIT": "3"})
    names = toggles.env_names()
    assert set(names) == set(DOCUMENTED_DEFAULTS)
    assert names["NSA_WIN_FA2"] == "False"
    assert names["NSA_DEBUG_LOG_LIMIT"] == "3"
    assert Toggles.from_env(names) == toggles


def test_get_toggles_reads_os_environ_once_and_reload_rereads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    saved = toggles_module._cached
    try:
        monkeypatch.setenv("NSA_DEBUG_LOG_LIMIT", "7")
        assert reload_toggles().debug_log_limit == 7
        monkeypatch.setenv("NSA_DEBUG_LOG_LIMIT", "8")
        assert get_toggles().debug_log_limit == 7  # cached until reloaded
        assert reload_toggles().debug_log_limit == 8
        assert get_toggles().debug_log_limit == 8
        monkeypatch.setenv("NSA_DEBUG_LOG_LIMIT", "eight")
        with pytest.raises(ValueError, match="NSA_DEBUG_LOG_LIMIT"):
            reload_toggles()
    finally:
        monkeypatch.undo()
        toggles_module._cached = saved


def test_toggles_overridden_applies_inside_the_block_and_restores() -> None:
    before = get_toggles()
    with toggles_overridden(win_backend="reference", debug_log_limit=3) as inside:
        assert get_toggles() is inside
        assert (inside.win_backend, inside.debug_log_limit) == ("reference", 3)
        assert inside.cmp_backend == before.cmp_backend
    assert get_toggles() is before
    with pytest.raises(RuntimeError, match="boom"), toggles_overridden(win_backend="reference"):
        raise RuntimeError("boom")
    assert get_toggles() is before
    with pytest.raises(TypeError), toggles_overridden(no_such_toggle=1):
        pass
    assert get_toggles() is before


@pytest.mark.parametrize("name", NAME_TOGGLES)
def test_backend_toggle_parses_a_name(name: str) -> None:
    assert getattr(Toggles.from_env({name: " Reference "}), field_of(name)) == "reference"


@pytest.mark.parametrize("name", NAME_TOGGLES)
@pytest.mark.parametrize("raw", ["", "fa2;rm", "a b"])
def test_bad_backend_name_names_the_toggle(name: str, raw: str) -> None:
    with pytest.raises(ValueError, match=re.escape(name)):
        Toggles.from_env({name: raw})
