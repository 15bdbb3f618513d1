"""Experimental CUDA C++ kernel for the selected branch (forward only), behind NSA_SEL_CUDA.

:func:`selected_attention_cuda` has the signature of nsa-core's ``selected_attention``; the kernel
is compiled on first use (:mod:`nsa_kernels.selected.cuda.build`). :func:`backends` lists it for the
registry as backend ``cuda_sel`` of op ``selected_attention``.
"""

from __future__ import annotations

from nsa_core.registry import Backend, OpContext
from nsa_core.toggles import Toggles
from nsa_kernels.selected.cuda.build import build_unavailable_reason, load_extension
from nsa_kernels.selected.cuda.selected import (
    CUDA_SEL_DTYPES,
    CUDA_SEL_MAX_HEAD_DIM,
    selected_attention_cuda,
)

# Above every other selected_attention backend: it only serves when NSA_SEL_CUDA asks for it.
CUDA_SEL_PRIORITY = 40


def cuda_sel_supports(ctx: OpContext, toggles: Toggles) -> str | None:
    """None when the CUDA kernel can serve ``ctx``, else the reason."""
    if not toggles.sel_cuda:
        return "NSA_SEL_CUDA is off"
    if ctx.device.type != "cuda":
        return f"needs a CUDA device, got {ctx.device.type}"
    if ctx.requires_grad:
        return "forward only: this call requires gradients"
    if ctx.dtype not in CUDA_SEL_DTYPES:
        return f"needs float16 or bfloat16, got {ctx.dtype}"
    dk, dv = ctx.head_dim_qk, ctx.head_dim_v
    if dk % 2 or dv % 2 or max(dk, dv) > CUDA_SEL_MAX_HEAD_DIM:
        return f"needs even head dims <= {CUDA_SEL_MAX_HEAD_DIM}, got dk={dk}, dv={dv}"
    return build_unavailable_reason()


def cuda_sel_requested(toggles: Toggles) -> bool:
    return toggles.sel_cuda


def backends() -> list[Backend]:
    """The experimental CUDA selected-attention backend."""
    return [
        Backend(
            op="selected_attention",
            name="cuda_sel",
            fn=selected_attention_cuda,
            supports=cuda_sel_supports,
            priority=CUDA_SEL_PRIORITY,
            requested_by=cuda_sel_requested,
        )
    ]


__all__ = [
    "backends",
    "build_unavailable_reason",
    "cuda_sel_supports",
    "load_extension",
    "selected_attention_cuda",
]
