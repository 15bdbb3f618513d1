"""GPU kernels for Native Sparse Attention, registered as nsa-core backends.

The names below load Triton, so they are imported on first use: importing nsa_kernels (as
nsa-core's entry-point loader does) needs no Triton. ``sel_attn_fwd_dense`` and
``sel_attn_fwd_varlen`` are quick-sanity entry points of the selection kernel (each row attends,
unmasked, to its own keys); ``selected_attention_triton`` is the selected branch.
"""

from __future__ import annotations

from typing import Any

from nsa_kernels._lazy import lazy_attribute

__version__ = "0.1.0"

_LAZY = {
    "sel_attn_fwd_dense": "nsa_kernels.selected.quick",
    "sel_attn_fwd_varlen": "nsa_kernels.selected.quick",
    "selected_attention_triton": "nsa_kernels.selected.function",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, _LAZY, name)
