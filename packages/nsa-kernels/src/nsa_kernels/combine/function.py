"""The gated combine on Triton: the launches and the autograd Function.

:func:`gated_combine_triton` has the reference op's signature and semantics
(``nsa_core.reference.gated_combine``, docs/spec.md "Output"):
``o = g[..., 0] * o_cmp + g[..., 1] * o_sel + g[..., 2] * o_win``, differentiable in the three
branch outputs and the gates. One kernel reads the three branch outputs and the gates and
writes o; the backward is one kernel too, giving the four gradients from one read of the
upstream gradient. Arithmetic is float32 with one rounding to the output's dtype (the reference
rounds every product and sum in a half-precision dtype, so half-precision results agree to
rounding, float32 to a few ulps).

Requirements beyond the reference: CUDA tensors (or CPU under ``TRITON_INTERPRET=1``, in every
dtype: the combine multiplies without ``tl.dot``), dtype float16, bfloat16 or float32. The
branch outputs and the upstream gradient may have any strides in (B, T, HQ); a tensor whose dv
stride is not 1 is copied first.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from nsa_core.checks import check_gated_combine, check_same_place, shape
from nsa_kernels.combine.kernels import combine_bwd_kernel, combine_fwd_kernel, sum3_kernel
from nsa_kernels.common.row_runs import RowRuns
from nsa_kernels.common.traced_launch import launch
from nsa_kernels.common.triton_inputs import (
    BF16_ROUNDING,
    check_dtype,
    check_interpreter_dtype,
    check_triton_device,
)
from nsa_kernels.common.two_runs import two_runs

# Channels per chunk of a row and elements per program: a program holds BR x BD values of each
# tensor it reads (four in the backward) in registers, and the pass is bound by memory traffic.
MAX_CHUNK = 128
TILE_ELEMENTS = 4096
NUM_WARPS = 4


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def tiles(dv: int) -> tuple[int, int]:
    """(BR rows per program, BD channels per chunk) for head dim dv."""
    chunk = min(_pow2(max(dv, 16)), MAX_CHUNK)
    return max(1, TILE_ELEMENTS // chunk), chunk


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _check(
    o_cmp: torch.Tensor, o_sel: torch.Tensor, o_win: torch.Tensor, gates: torch.Tensor
) -> None:
    check_gated_combine(o_cmp, o_sel, o_win, gates)
    # Multiplies in float32 without tl.dot: the interpreter computes every dtype within the
    # spec's bound (its bfloat16 rounds toward zero), so no dtype is refused there.
    check_dtype(o_cmp.dtype, "gated combine", "o_cmp")
    check_triton_device("o_cmp", o_cmp.device)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _strides3(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def combine_fwd(
    o_cmp: torch.Tensor, o_sel: torch.Tensor, o_win: torch.Tensor, gates: torch.Tensor
) -> torch.Tensor:
    """o [B, T, HQ, dv] (contiguous, the inputs' dtype) from arguments ``_check`` accepted."""
    batch, t, hq, dv = o_cmp.shape
    o_cmp, o_sel, o_win = _unit_last(o_cmp), _unit_last(o_sel), _unit_last(o_win)
    o = torch.empty(batch, t, hq, dv, dtype=o_cmp.dtype, device=o_cmp.device)
    n_rows = batch * t * hq
    if n_rows == 0 or dv == 0:
        return o
    br, bd = tiles(dv)
    launch(
        combine_fwd_kernel, (_cdiv(n_rows, br),),
        o_cmp, o_sel, o_win, gates, o,
        *_strides3(o_cmp), *_strides3(o_sel), *_strides3(o_win),
        *_strides3(gates), gates.stride(3), *_strides3(o),
        n_rows, t, hq,
        DV=dv, BR=br, BD=bd, num_warps=NUM_WARPS, writes=(o,),
    )  # fmt: skip
    return o


def combine_bwd(
    do: torch.Tensor,
    o_cmp: torch.Tensor | RowRuns,
    o_sel: torch.Tensor,
    o_win: torch.Tensor,
    gates: torch.Tensor,
    *,
    want_branches: bool = True,
    want_gates: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """d o_cmp, d o_sel, d o_win [B, T, HQ, dv] and d gates [B, T, HQ, 3] for upstream ``do``.

    ``want_branches`` / ``want_gates`` False: those gradients are None (not computed). o_cmp
    may come as a :class:`RowRuns` (unit stride along dv), read where its
    runs lie; d o_cmp is one tensor all the same.
    """
    batch, t, hq, dv = o_sel.shape
    do = _unit_last(do)
    cmp = two_runs(o_cmp if isinstance(o_cmp, RowRuns) else _unit_last(o_cmp))
    o_sel, o_win = _unit_last(o_sel), _unit_last(o_win)
    n_rows = batch * t * hq
    kind, device = o_sel.dtype, o_sel.device
    d_branches = [
        torch.empty(batch, t, hq, dv, dtype=kind, device=device) if want_branches else None
        for _ in range(3)
    ]
    d_gates = torch.empty(batch, t, hq, 3, dtype=gates.dtype, device=device) if want_gates else None
    if d_gates is not None and dv == 0:
        d_gates.zero_()  # a sum over no channels
    if n_rows and dv and (want_branches or want_gates):
        dummy = do  # stands in for the outputs not wanted: their WRITE_* flag is off
        dcmp, dsel, dwin = (d if d is not None else dummy for d in d_branches)
        br, bd = tiles(dv)
        written = tuple(d for d in (*d_branches, d_gates) if d is not None)
        launch(
            combine_bwd_kernel, (_cdiv(n_rows, br),),
            do, cmp.first, o_sel, o_win, gates,
            dcmp, dsel, dwin, d_gates if d_gates is not None else dummy, cmp.second,
            *_strides3(do), *_strides3(cmp.first), *_strides3(cmp.second), *_strides3(o_sel),
            *_strides3(o_win), *_strides3(gates), gates.stride(3),
            n_rows, t, hq, cmp.start, cmp.first_rows,
            DV=dv, BR=br, BD=bd, WRITE_DO=want_branches, WRITE_DG=want_gates,
            CMP_RUNS=cmp.runs, num_warps=NUM_WARPS, writes=written,
        )  # fmt: skip
    return d_branches[0], d_branches[1], d_branches[2], d_gates


class GatedCombineFunction(torch.autograd.Function):
    """o = gated combine of (o_cmp, o_sel, o_win) by gates; differentiable in all four."""

    @staticmethod
    def forward(
        ctx: Any,
        o_cmp: torch.Tensor,
        o_sel: torch.Tensor,
        o_win: torch.Tensor,
        gates: torch.Tensor,
    ) -> torch.Tensor:
        ctx.save_for_backward(o_cmp, o_sel, o_win, gates)
        return combine_fwd(o_cmp, o_sel, o_win, gates)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, do: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        o_cmp, o_sel, o_win, gates = ctx.saved_tensors
        need = ctx.needs_input_grad
        dcmp, dsel, dwin, dg = combine_bwd(
            do,
            o_cmp,
            o_sel,
            o_win,
            gates,
            want_branches=any(need[:3]),
            want_gates=need[3],
        )
        return (
            dcmp if need[0] else None,
            dsel if need[1] else None,
            dwin if need[2] else None,
            dg if need[3] else None,
        )


def gated_combine_triton(
    o_cmp: torch.Tensor,
    o_sel: torch.Tensor,
    o_win: torch.Tensor,
    gates: torch.Tensor,
    *,
    validated: bool = False,
) -> torch.Tensor:
    """o [B, T, HQ, dv] = g[..., 0] * o_cmp + g[..., 1] * o_sel + g[..., 2] * o_win on Triton.

    Args:
        o_cmp, o_sel, o_win: [B, T, HQ, dv] branch outputs, float16, bfloat16 or float32.
        gates: [B, T, HQ, 3] (cmp, sel, win) of their dtype and device.
        validated: nsa-core validated the call already (the registry's ``fn``); nothing is
            checked again.

    Returns:
        o [B, T, HQ, dv], contiguous, in the inputs' dtype; differentiable in the four inputs
        (one backward kernel). Non-finite values propagate as in the reference.
    """
    if not validated:
        _check(o_cmp, o_sel, o_win, gates)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (o_cmp, o_sel, o_win, gates)):
        out = GatedCombineFunction.apply(o_cmp, o_sel, o_win, gates)  # type: ignore[no-untyped-call]
        assert isinstance(out, torch.Tensor)
        return out
    return combine_fwd(o_cmp, o_sel, o_win, gates)


# Elements per program of the three-way sum (a pass bound by memory traffic).
SUM_BLOCK = 4096


def sum3_triton(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a + b + c for three tensors of one shape and dtype, in one pass: float32 sums, one
    rounding (the fused core, :mod:`nsa_kernels.core.fan_out`, sums the three branches'
    gradients of q with it, where autograd would add them two at a time, each add reading two
    q-sized tensors and writing one).

    CUDA tensors (or CPU under ``TRITON_INTERPRET=1``), float16, bfloat16 or float32 (not
    bfloat16 under the interpreter, whose rounding toward zero breaks the one rounding); any
    strides (a non-contiguous one is copied first). Returns a new contiguous tensor.
    """
    for name, x in (("a", a), ("b", b), ("c", c)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    for name, x in (("b", b), ("c", c)):
        if x.shape != a.shape:
            raise ValueError(
                f"sum3 takes three tensors of one shape and dtype: {name} {shape(x)} differs "
                f"from a {shape(a)}"
            )
        check_same_place(name, x, "a", a)
    check_dtype(a.dtype, "three-way sum", "a")
    # The sum is defined bit for bit (float32, one rounding): the interpreter's bfloat16 rounding
    # breaks it.
    check_interpreter_dtype("a", a.dtype, BF16_ROUNDING)
    check_triton_device("a", a.device)
    a, b, c = (x.contiguous() for x in (a, b, c))
    out = torch.empty_like(a)
    numel = a.numel()
    if numel:
        launch(
            sum3_kernel,
            (_cdiv(numel, SUM_BLOCK),),
            a,
            b,
            c,
            out,
            numel,
            BLOCK=SUM_BLOCK,
            num_warps=4,
            writes=(out,),
        )
    return out


__all__ = [
    "GatedCombineFunction",
    "combine_bwd",
    "combine_fwd",
    "gated_combine_triton",
    "sum3_triton",
    "tiles",
]
