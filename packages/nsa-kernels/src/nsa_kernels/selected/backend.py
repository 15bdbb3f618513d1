"""The Triton selection backend: when it serves ``selected_attention``, and what it reports.

Routing (``supports`` returns the reason it declines, ``None`` when it serves):

1. a CUDA device, and triton importable; not bfloat16 under ``TRITON_INTERPRET=1``
   (the interpreter's bfloat16 ``tl.dot`` is wrong:
   :data:`~nsa_kernels.common.triton_inputs.BF16_DOT`);
2. NSA_SEL_TRITON on (or NSA_SEL_TRITON_FORCE);
3. no gradients needed, or NSA_SEL_TRITON_GRAD on;
4. the keys' sequence length >= NSA_SEL_TRITON_MIN_LEN;
5. the device policy table (:data:`DEVICE_POLICY`, first matching row): ``use``, ``fallback``
   (declines unless NSA_SEL_TRITON_FORCE) or ``refuse`` (declines always);
6. the alignment guard: dtype float16/bfloat16/float32, dk and dv multiples of 16 and <= 256.

Observability, through nsa_core's debug log (NSA_DEBUG_LOG, NSA_DEBUG_LOG_LIMIT):
``sel.triton.device`` once per device (name, capability). The per-call hooks (NSA_DEBUG_SHAPES,
NSA_DEBUG_TIMING, NSA_DEBUG_COMPARE) wrap every backend alike: :mod:`nsa_core.debug_hooks`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from nsa_core.debug_log import debug_log_once
from nsa_core.registry import Backend, OpContext
from nsa_core.toggles import Toggles, get_toggles
from nsa_kernels.common.local_softmax import LocalSoftmax
from nsa_kernels.common.op_calls import SelectedBackend, SelectedCall
from nsa_kernels.common.row_runs import RowRuns
from nsa_kernels.common.triton_inputs import BF16_DOT, interpreter_reason

OP = "selected_attention"
NAME = "triton_sel"
PRIORITY = 20
HEAD_DIM_MULTIPLE = 16
MAX_HEAD_DIM = 256
DTYPES = (torch.float16, torch.bfloat16, torch.float32)

Decision = Literal["use", "fallback", "refuse"]


@dataclass(frozen=True)
class PolicyRow:
    """One row of the device policy: devices it covers, the decision, and why."""

    covers: str
    matches: Callable[[tuple[int, int]], bool]
    decision: Decision
    reason: str


DEVICE_POLICY: tuple[PolicyRow, ...] = (
    PolicyRow(
        covers="SM < 8.0",
        matches=lambda cap: cap < (8, 0),
        decision="refuse",
        reason="SM < 8.0 lacks bf16 tensor-core dots and was never validated for these kernels",
    ),
    PolicyRow(
        covers="SM 8.9 (Ada, e.g. RTX 4090)",
        matches=lambda cap: cap == (8, 9),
        decision="fallback",
        reason=(
            "SM 8.9 (Ada, e.g. RTX 4090): measured slower there (docs/selection.md), so it is "
            "off by default there; set NSA_SEL_TRITON_FORCE=1 to use it"
        ),
    ),
    PolicyRow(
        covers="any other CUDA device (SM 8.0, 9.0, ...)",
        matches=lambda cap: True,
        decision="use",
        reason="measured on SM 9.0 (docs/selection.md)",
    ),
)


def device_policy(capability: tuple[int, int]) -> PolicyRow:
    """The first row of :data:`DEVICE_POLICY` that covers ``capability``."""
    for row in DEVICE_POLICY:
        if row.matches(capability):
            return row
    raise AssertionError("the last policy row covers every device")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def alignment_reason(dtype: torch.dtype, dk: int, dv: int) -> str | None:
    """Why the kernels should not take these dtype and head dims, or None."""
    if dtype not in DTYPES:
        return f"dtype {dtype} is not one of float16, bfloat16, float32"
    for name, dim in (("dk", dk), ("dv", dv)):
        if dim % HEAD_DIM_MULTIPLE or dim > MAX_HEAD_DIM:
            return f"{name}={dim} is not a multiple of {HEAD_DIM_MULTIPLE} in [16, {MAX_HEAD_DIM}]"
    return None


def decline_reason(
    toggles: Toggles,
    *,
    device_type: str,
    capability: tuple[int, int] | None,
    dtype: torch.dtype,
    dk: int,
    dv: int,
    seq_len: int,
    requires_grad: bool,
) -> str | None:
    """The routing rules of this module's docstring, in order; None when the kernels serve."""
    if device_type != "cuda":
        return f"needs a CUDA device, got {device_type}"
    if not triton_available():
        return "triton is not importable"
    interpreted = interpreter_reason(dtype, BF16_DOT)
    if interpreted is not None:
        return interpreted
    if not (toggles.sel_triton or toggles.sel_triton_force):
        return "NSA_SEL_TRITON=0"
    if requires_grad and not toggles.sel_triton_grad:
        return "gradients are required and NSA_SEL_TRITON_GRAD=0"
    if seq_len < toggles.sel_triton_min_len:
        return f"seq_len={seq_len} < NSA_SEL_TRITON_MIN_LEN={toggles.sel_triton_min_len}"
    if capability is not None:
        row = device_policy(capability)
        if row.decision == "refuse":
            return row.reason
        if row.decision == "fallback" and not toggles.sel_triton_force:
            return row.reason
    return alignment_reason(dtype, dk, dv)


def supports(ctx: OpContext, toggles: Toggles) -> str | None:
    """None when the Triton kernels serve ``ctx``, else the reason they decline."""
    return decline_reason(
        toggles,
        device_type=ctx.device.type,
        capability=ctx.device_capability if ctx.device.type == "cuda" else None,
        dtype=ctx.dtype,
        dk=ctx.head_dim_qk,
        dv=ctx.head_dim_v,
        seq_len=ctx.seq_len,
        requires_grad=ctx.requires_grad,
    )


def _log_device(device: torch.device) -> None:
    if device.type != "cuda":
        return
    debug_log_once(
        f"sel.triton.device:{device}",
        "sel.triton.device",
        device=str(device),
        name=repr(torch.cuda.get_device_name(device)),
        capability="{}.{}".format(*torch.cuda.get_device_capability(device)),
    )


def _triton(q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, call: SelectedCall) -> Tensor:
    """:func:`selected_attention_triton` with the routing's toggles.

    q [B, Tq, HQ, dk], k [B, Tk, H, dk], v [B, Tk, H, dv], block_indices [B, Tq, H, n].
    """
    from nsa_kernels.selected.function import selected_attention_triton

    _log_device(q.device)
    return selected_attention_triton(
        q, k, v, block_indices, call.sel_block, call.scale, q_start=call.q_start,
        cu_seqlens=call.cu_seqlens, toggles=call.toggles, validated=call.validated,
    )  # fmt: skip


# The registered ``fn``: nsa_core's selected_attention on the Triton kernels, with its signature
# (``toggles`` defaults to get_toggles() when called by name).
selected_attention_backend = SelectedBackend(_triton)


def selected_attention_gated(
    q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, sel_block: int,
    scale: float | None = None, *, o_cmp: Tensor | RowRuns, o_win: Tensor, gates: Tensor,
    q_start: int = 0, cu_seqlens: Tensor | None = None, toggles: Toggles | None = None,
    local: LocalSoftmax | None = None,
) -> Tensor:  # fmt: skip
    """The gated combine summed inside the selected launch, for the fused core
    (:mod:`nsa_kernels.core`), on the arguments it built from a validated call (nothing is
    checked again): :func:`selected_attention_gated_triton` with the routing's
    toggles; q [B, Tq, HQ, dk], o_cmp (a tensor or a :class:`RowRuns`)
    and o_win [B, Tq, HQ, dv], gates [B, Tq, HQ, 3] -> o [B, Tq, HQ, dv], differentiable in all
    six; ``local``: the sliding branch's softmax over each row's forced blocks, the walk's start."""
    from nsa_kernels.selected.function import selected_attention_gated_triton

    _log_device(q.device)
    return selected_attention_gated_triton(
        q, k, v, block_indices, sel_block, scale, o_cmp=o_cmp, o_win=o_win, gates=gates,
        q_start=q_start, cu_seqlens=cu_seqlens,
        toggles=get_toggles() if toggles is None else toggles, local=local, validated=True,
    )  # fmt: skip


def _requested(toggles: Toggles) -> bool:
    return toggles.sel_triton or toggles.sel_triton_force


def backends() -> list[Backend]:
    """The selection backends this module provides, for nsa_kernels' registration."""
    return [
        Backend(
            op=OP,
            name=NAME,
            fn=selected_attention_backend.unchecked,
            supports=supports,
            priority=PRIORITY,
            requested_by=_requested,
        )
    ]
