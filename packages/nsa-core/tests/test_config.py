"""NSAConfig: the paper's defaults, derived quantities, and validation that names the field."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest

from nsa_core import NSAConfig


def test_paper_defaults() -> None:
    """docs/spec.md "Symbols": HQ=64, H=4, dk=192, dv=128, l=32, d=16, l'=64, n=16, w=512."""
    cfg = NSAConfig()
    assert (cfg.num_q_heads, cfg.num_kv_heads) == (64, 4)
    assert (cfg.head_dim_qk, cfg.head_dim_v) == (192, 128)
    assert (cfg.cmp_block, cfg.cmp_stride, cfg.sel_block) == (32, 16, 64)
    assert (cfg.num_selected, cfg.window) == (16, 512)
    assert cfg.phi == "avg"
    assert cfg.scale is None


@pytest.mark.parametrize(("hq", "h", "g"), [(64, 4, 16), (4, 4, 1), (6, 2, 3), (8, 1, 8)])
def test_group_size(hq: int, h: int, g: int) -> None:
    assert NSAConfig(num_q_heads=hq, num_kv_heads=h).group_size == g


def test_softmax_scale_default_is_inverse_sqrt_dk() -> None:
    assert NSAConfig().softmax_scale == 192**-0.5
    assert NSAConfig(head_dim_qk=16).softmax_scale == 0.25


def test_softmax_scale_explicit() -> None:
    assert NSAConfig(scale=0.125).softmax_scale == 0.125


def test_config_is_frozen() -> None:
    cfg = NSAConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.window = 3  # type: ignore[misc]


def test_smallest_valid_config() -> None:
    """l = l' = d = 1, n = 3, w = 1 is a legal (if degenerate) geometry."""
    cfg = NSAConfig(
        num_q_heads=1,
        num_kv_heads=1,
        head_dim_qk=2,
        head_dim_v=1,
        cmp_block=1,
        cmp_stride=1,
        sel_block=1,
        num_selected=3,
        window=1,
    )
    assert cfg.group_size == 1


def kw(field: str, value: Any) -> dict[str, Any]:
    return {field: value}


POSITIVE_INT_FIELDS = (
    "num_q_heads",
    "num_kv_heads",
    "head_dim_qk",
    "head_dim_v",
    "cmp_block",
    "cmp_stride",
    "sel_block",
    "num_selected",
    "window",
)


@pytest.mark.parametrize("field", POSITIVE_INT_FIELDS)
@pytest.mark.parametrize("value", [0, -1])
def test_non_positive_int_field_is_named(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=rf"NSAConfig\.{field} must be >= 1, got {value}"):
        NSAConfig(**kw(field, value))


@pytest.mark.parametrize("field", POSITIVE_INT_FIELDS)
@pytest.mark.parametrize("value", [16.0, True, "16"])
def test_non_int_field_is_named(field: str, value: Any) -> None:
    with pytest.raises(TypeError, match=rf"NSAConfig\.{field} must be an int"):
        NSAConfig(**kw(field, value))


def test_heads_not_divisible() -> None:
    with pytest.raises(
        ValueError, match=r"num_q_heads \(6\) must be a multiple of num_kv_heads \(4\)"
    ):
        NSAConfig(num_q_heads=6, num_kv_heads=4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"cmp_block": 24, "cmp_stride": 16}, "cmp_stride (16) must divide cmp_block (24)"),
        (
            {"cmp_block": 32, "cmp_stride": 16, "sel_block": 40},
            "cmp_stride (16) must divide sel_block (40)",
        ),
        (
            {"cmp_block": 8, "cmp_stride": 3, "sel_block": 9},
            "cmp_stride (3) must divide cmp_block (8)",
        ),
    ],
)
def test_stride_must_divide_block_lengths(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        NSAConfig(**kwargs)


@pytest.mark.parametrize("n", [1, 2])
def test_num_selected_holds_forced_blocks(n: int) -> None:
    """One initial and two local blocks are forced, so n >= 3."""
    with pytest.raises(ValueError, match=rf"NSAConfig\.num_selected must be >= 3.*got {n}"):
        NSAConfig(num_selected=n)


def test_phi_kind() -> None:
    with pytest.raises(ValueError, match=r"NSAConfig\.phi must be 'avg' or 'mlp', got 'max'"):
        NSAConfig(phi="max")  # type: ignore[arg-type]
    assert NSAConfig(phi="mlp").phi == "mlp"


def test_rotary_needs_even_dk() -> None:
    with pytest.raises(ValueError, match=r"NSAConfig\.head_dim_qk must be even.*got 15"):
        NSAConfig(head_dim_qk=15)


@pytest.mark.parametrize("scale", [0.0, -0.5])
def test_scale_must_be_positive(scale: float) -> None:
    with pytest.raises(ValueError, match=r"NSAConfig\.scale must be positive"):
        NSAConfig(scale=scale)


@pytest.mark.parametrize("theta", [0.0, -1.0])
def test_rope_theta_must_be_positive(theta: float) -> None:
    with pytest.raises(ValueError, match=r"NSAConfig\.rope_theta must be positive"):
        NSAConfig(rope_theta=theta)


@pytest.mark.parametrize("field", ["scale", "rope_theta"])
def test_non_number_float_field_is_named(field: str) -> None:
    with pytest.raises((TypeError, ValueError), match=rf"NSAConfig\.{field}"):
        NSAConfig(**kw(field, "1.0"))
