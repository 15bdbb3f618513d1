"""The softmax scale is checked in the dtype logits are scaled in (docs/spec.md, "Argument
rules"): float32 for float16, bfloat16 and float32 inputs, float64 for float64 inputs.

1e39 is finite in float64 but infinite in float32, and 1e-39 rounds to a float32 subnormal
(zero where a GPU flushes it): every entry point that takes a scale refuses both for lower
precisions, naming the argument and the rule, and computes with them in float64.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from bad_input_lib import (
    D_CMP,
    DK,
    DV,
    HIDDEN,
    HQ,
    L_CMP,
    L_SEL,
    N_CMP,
    N_SEL,
    B,
    H,
    T,
    W,
    config,
    rand,
    valid_indices,
)

from nsa_core import (
    NSAAttention,
    attention_core,
    block_scores,
    compressed_attention,
    compressed_attention_with_lse,
    nsa_attention,
    nsa_func,
    nsa_varlen_func,
    select_blocks,
    selected_attention,
    sliding_attention,
)

LOWER = [torch.float16, torch.bfloat16, torch.float32]
OUT_OF_FLOAT32 = [1e39, 1e-39]  # both finite, > 0 and normal in float64


def _q(dtype: torch.dtype) -> torch.Tensor:
    return rand(B, T, HQ, DK, dtype=dtype)


def _kv(dtype: torch.dtype, tokens: int = T) -> tuple[torch.Tensor, torch.Tensor]:
    return rand(B, tokens, H, DK, dtype=dtype), rand(B, tokens, H, DV, dtype=dtype)


def _gates(dtype: torch.dtype) -> torch.Tensor:
    return torch.rand(B, T, HQ, 3).to(dtype)


def compressed(dtype: torch.dtype, scale: float) -> Any:
    return compressed_attention(_q(dtype), *_kv(dtype, N_CMP), L_CMP, D_CMP, scale)


def compressed_lse(dtype: torch.dtype, scale: float) -> Any:
    return compressed_attention_with_lse(_q(dtype), *_kv(dtype, N_CMP), L_CMP, D_CMP, scale)[0]


def selected(dtype: torch.dtype, scale: float) -> Any:
    return selected_attention(_q(dtype), *_kv(dtype), valid_indices(), L_SEL, scale)


def sliding(dtype: torch.dtype, scale: float) -> Any:
    return sliding_attention(_q(dtype), *_kv(dtype), W, scale)


def selection(dtype: torch.dtype, scale: float) -> Any:
    k_cmp = _kv(dtype, N_CMP)[0]
    return select_blocks(_q(dtype), k_cmp, L_CMP, D_CMP, L_SEL, N_SEL, scale)[0]


def scores(dtype: torch.dtype, scale: float) -> Any:
    return block_scores(_q(dtype), _kv(dtype, N_CMP)[0], L_CMP, D_CMP, L_SEL, scale)


def core(dtype: torch.dtype, scale: float) -> Any:
    cfg = config(scale=scale)
    k, v = _kv(dtype)
    k_cmp, v_cmp = _kv(dtype, N_CMP)
    return attention_core(_q(dtype), k_cmp, v_cmp, k, v, k, v, _gates(dtype), cfg)


def core_with_compression(dtype: torch.dtype, scale: float) -> Any:
    return nsa_attention(_q(dtype), *_kv(dtype), _gates(dtype), config(scale=scale))


def flash_dense(dtype: torch.dtype, scale: float) -> Any:
    return nsa_func(_q(dtype), *_kv(dtype), config=config(), softmax_scale=scale)


def flash_varlen(dtype: torch.dtype, scale: float) -> Any:
    cu = torch.tensor([0, 3, T], dtype=torch.int32)
    k, v = _kv(dtype)
    return nsa_varlen_func(_q(dtype)[0], k[0], v[0], cu, cu, config=config(), softmax_scale=scale)


# entry point -> (the name its error gives the scale, a call on inputs of a dtype with a scale)
ENTRIES: dict[str, tuple[str, Callable[[torch.dtype, float], Any]]] = {
    "compressed_attention": ("scale", compressed),
    "compressed_attention_with_lse": ("scale", compressed_lse),
    "selected_attention": ("scale", selected),
    "sliding_attention": ("scale", sliding),
    "select_blocks": ("scale", selection),
    "block_scores": ("scale", scores),
    "attention_core": ("config.scale", core),
    "nsa_attention": ("config.scale", core_with_compression),
    "nsa_func": ("softmax_scale", flash_dense),
    "nsa_varlen_func": ("softmax_scale", flash_varlen),
}


@pytest.mark.parametrize("scale", OUT_OF_FLOAT32)
@pytest.mark.parametrize("dtype", LOWER)
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_a_scale_outside_float32_is_refused_for_lower_precisions(
    entry: str, dtype: torch.dtype, scale: float
) -> None:
    name, call = ENTRIES[entry]
    message = (
        f"{name} must be finite and > 0 in torch.float32, the dtype logits are scaled in for "
        f"{dtype} inputs"
    )
    with pytest.raises(ValueError, match=message):
        call(dtype, scale)


@pytest.mark.parametrize("scale", OUT_OF_FLOAT32)
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_the_same_scale_computes_in_float64(entry: str, scale: float) -> None:
    """Normal in float64: accepted, and the output is finite."""
    out = ENTRIES[entry][1](torch.float64, scale)
    assert bool(torch.isfinite(out.double()).all())


@pytest.mark.parametrize("dtype", LOWER)
def test_the_largest_float32_scale_is_accepted(dtype: torch.dtype) -> None:
    """The bound is float32's largest finite value, not below it."""
    out = sliding(dtype, torch.finfo(torch.float32).max)
    assert out.shape == (B, T, HQ, DV)


def test_the_layer_checks_its_config_scale_in_its_compute_dtype() -> None:
    """The module's compute dtype decides: its dtype, or the autocast dtype while autocast is on
    (docs/spec.md, "Decode")."""
    x = rand(B, T, HIDDEN)
    layer = NSAAttention(config(scale=1e39), HIDDEN)
    message = r"config.scale must be finite and > 0 in torch.float32, .* for torch.float32 inputs"
    with pytest.raises(ValueError, match=message):
        layer(x)
    with torch.autocast("cpu", torch.bfloat16), pytest.raises(ValueError, match="bfloat16 inputs"):
        layer(x)
    y = layer.double()(x.double())
    assert bool(torch.isfinite(y).all())


def test_the_layer_checks_its_rope_theta_in_its_compute_dtype() -> None:
    x = rand(B, T, HIDDEN)
    layer = NSAAttention(config(rope_theta=1e39), HIDDEN)
    message = r"config.rope_theta must be finite and > 0 in torch.float32, the dtype rotary"
    with pytest.raises(ValueError, match=message):
        layer(x)
    with pytest.raises(ValueError, match=message):
        layer.prefill(x)
    assert bool(torch.isfinite(layer.double()(x.double())).all())
