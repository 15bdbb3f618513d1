"""Triton selected attention (NSA's selected branch), forward and backward, any GQA group size.

Modules, by role: ``launch`` (SelConfig tiles, argument checks, the facts of one call),
``indices`` (index rows as sets) and ``csr`` (the reverse index for dk/dv), ``row_walk`` (the
walk of one query row over its selected blocks, shared by the kernels), ``forward`` and
``backward`` (the kernels and their launches), ``function`` (autograd Function,
:func:`selected_attention_triton`), ``quick`` (the quick-sanity ``sel_attn_fwd_dense`` /
``sel_attn_fwd_varlen``), ``backend`` (registry backend, device policy, observability),
``backends`` (this branch's table of backends and priorities), ``cuda`` (the experimental CUDA
kernel). Names are imported lazily so that ``backend`` loads without triton.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "SelConfig": "nsa_kernels.selected.launch",
    "selected_attention_triton": "nsa_kernels.selected.function",
    "selected_attention_fwd": "nsa_kernels.selected.function",
    "selected_attention_bwd": "nsa_kernels.selected.function",
    "build_block_csr": "nsa_kernels.selected.csr",
    "sel_attn_fwd_dense": "nsa_kernels.selected.quick",
    "sel_attn_fwd_varlen": "nsa_kernels.selected.quick",
    "backends": "nsa_kernels.selected.backend",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
