"""Selected attention on Triton: the public entry points and the autograd Function.

The pieces: :mod:`~nsa_kernels.selected.launch` (tiles, checks, launch facts),
:mod:`~nsa_kernels.selected.indices` (index rows as sets), :mod:`~nsa_kernels.selected.forward`,
:mod:`~nsa_kernels.selected.backward` (with the reverse index of
:mod:`~nsa_kernels.selected.csr`), and the row walk they share,
:mod:`~nsa_kernels.selected.row_walk`.

:func:`selected_attention_triton` has the reference op's signature and semantics
(``nsa_core.reference.selected_attention``); docs/selection.md gives the design and arithmetic.
Requirements beyond the reference: CUDA tensors (or CPU under ``TRITON_INTERPRET=1``), dtype
float16, bfloat16 or float32 (not bfloat16 under the interpreter, whose bfloat16 ``tl.dot`` is
wrong). Repeated block indices in one row are honoured as a set, as in the
reference (the kernels skip a repeat; nsa_core's ``select_blocks`` never emits one).

float32 inputs run every ``tl.dot`` with ``input_precision="ieee"`` (no TF32): slower, but held to
the float32 bound of docs/spec.md. float16/bfloat16 inputs multiply on tensor cores with float32
accumulation, the softmax statistics and all accumulators in float32.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from nsa_core.checks import check_same_place
from nsa_core.toggles import Toggles
from nsa_kernels.combine.function import combine_bwd
from nsa_kernels.common.entry_checks import check_backward_args
from nsa_kernels.common.local_softmax import LocalSoftmax
from nsa_kernels.common.row_runs import RowRuns, check_gated_combine_runs
from nsa_kernels.common.triton_inputs import check_triton_runs
from nsa_kernels.selected.backward import backward
from nsa_kernels.selected.forward import GatedSum, forward
from nsa_kernels.selected.indices import unique_block_rows
from nsa_kernels.selected.launch import (
    Launch,
    SelConfig,
    check_call,
    parse_config,
    prepare,
    resolve_config,
    tma_available,
)


def _operands(
    q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, info: Launch
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Contiguous q, k, v and the index rows as sets, as the kernels read them."""
    # dq/dk/dv are allocated like q/k/v and the kernels give them the same strides.
    idx = unique_block_rows(block_indices, info.num_blocks)
    return q.contiguous(), k.contiguous(), v.contiguous(), idx


def selected_attention_fwd(
    q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, sel_block: int,
    scale: float | None = None, *, q_start: int = 0, cu_seqlens: Tensor | None = None,
    config: SelConfig | None = None, toggles: Toggles | None = None,
    local: LocalSoftmax | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Forward only: o [B, Tq, HQ, dv] in q's dtype and lse [B, Tq, HQ] float32 (natural log).

    Arguments as :func:`selected_attention_triton`. ``lse`` is -inf on rows that see no token.
    ``local``: as :func:`selected_attention_gated_triton` takes it.
    """
    check_local_kind(local)
    info = prepare(
        q, k, v, block_indices, sel_block, scale, q_start, cu_seqlens, config, toggles,
        local=local is not None,
    )  # fmt: skip
    return forward(*_operands(q, k, v, block_indices, info), info, local=local)


def selected_attention_gated_triton(
    q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, sel_block: int,
    scale: float | None = None, *, o_cmp: Tensor | RowRuns, o_win: Tensor, gates: Tensor,
    q_start: int = 0, cu_seqlens: Tensor | None = None,
    config: SelConfig | None = None, toggles: Toggles | None = None,
    local: LocalSoftmax | None = None, validated: bool = False,
) -> Tensor:  # fmt: skip
    """The gated combine with the selected branch computed in the same launch.

    ``g_cmp * o_cmp + g_sel * o_sel + g_win * o_win`` (docs/spec.md, "Gated combine") where o_sel
    is :func:`selected_attention_triton` of the same arguments: each program sums its rows' three
    terms before it stores them, so the combine's own pass over the three outputs is saved. The
    sum is the combine kernel's expression over float32 values; o_sel enters it unrounded (the
    separate ops round it to q's dtype first).

    Without a gradient o_sel never goes to memory. With one (grad mode on and an input that
    requires it) the launch stores o_sel beside o, and :class:`GatedSelectedFunction` gives
    the gradients of q, k, v, o_cmp, o_win and gates: the combine's backward kernel, then the
    selected branch's backward.

    Args:
        q, k, v, block_indices, sel_block, scale, q_start, cu_seqlens, config, toggles: as
            :func:`selected_attention_triton`.
        o_cmp, o_win: [B, Tq, HQ, dv] the compressed and sliding branches' outputs, q's dtype;
            o_cmp may be a :class:`RowRuns`, read where its runs lie with or
            without a gradient (no copy into one tensor; each run gets its own gradient).
        gates: [B, Tq, HQ, 3] ordered (cmp, sel, win), q's dtype.
        local: the softmax of each row over its forced blocks, computed by the sliding branch over
            these same k and v (:class:`~nsa_kernels.common.local_softmax.LocalSoftmax`,
            :func:`nsa_kernels.sliding.triton_function.sliding_attention_triton_with_local`);
            every index row must hold the row's blocks 0 and ``max(jt - 1, 0) .. jt`` (the forced
            blocks of ``select_blocks`` with n >= 3: a row without them gives NaN). The kernel
            starts from it and walks the blocks between; the gradients are those of the plain
            call.
        validated: the caller (the fused core) built these arguments from a validated call;
            nothing is checked again.

    Returns:
        o [B, Tq, HQ, dv] in q's dtype.
    """
    if not validated:
        check_gated_combine_runs(o_cmp, o_win, gates)
        check_local_kind(local)
        check_call(q, k, v, block_indices, sel_block, scale, q_start, cu_seqlens, config, toggles)
        expected = [*q.shape[:3], v.shape[3]]
        if list(o_cmp.shape) != expected:
            raise ValueError(f"o_cmp {list(o_cmp.shape)} must be [B, Tq, HQ, dv] = {expected}")
        # o_cmp and gates share o_win's dtype and device (checked above).
        check_same_place("o_win", o_win, "q", q)
        check_triton_runs("q", q)
    cmp_runs = o_cmp if isinstance(o_cmp, RowRuns) else RowRuns.whole(o_cmp)
    info = prepare(
        q, k, v, block_indices, sel_block, scale, q_start, cu_seqlens, config, toggles,
        local=local is not None, validated=True,
    )  # fmt: skip
    grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (q, k, v, o_win, gates, *cmp_runs.runs)
    )
    if grad:
        out = GatedSelectedFunction.apply(  # type: ignore[no-untyped-call]
            q, k, v, o_win, gates, block_indices, info, local, cmp_runs.start, *cmp_runs.runs
        )
        assert isinstance(out, torch.Tensor)
        return out
    parts = GatedSum(o_cmp=o_cmp, o_win=o_win, gates=gates)
    return forward(*_operands(q, k, v, block_indices, info), info, parts, local=local)[0]


def check_local_kind(local: object) -> None:
    """``local`` is None or a :class:`LocalSoftmax` (its shapes are checked against the call's
    output where the forward takes it)."""
    if local is not None and not isinstance(local, LocalSoftmax):
        raise TypeError(f"local must be a LocalSoftmax or None, got {type(local).__name__}")


class GatedSelectedFunction(torch.autograd.Function):
    """o = gated combine of (o_cmp, selected_attention(q, k, v), o_win) by gates, the selected
    branch and the sum in one launch; o_cmp comes as the runs of a
    :class:`RowRuns` from row ``cmp_start`` (each a differentiable input, read
    in place). Backward: the combine's backward kernel (d o_cmp, d o_sel, d o_win, d gates from
    one read of do; each run's gradient a slice of d o_cmp), then the selected branch's, without
    atomics. Its kernels give no graph of their own (once_differentiable): a second derivative
    through them raises where the upstream gradient carries a graph."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, o_win: Tensor, gates: Tensor,
        block_indices: Tensor, info: Launch, local: LocalSoftmax | None, cmp_start: int,
        *cmp_runs: Tensor,
    ) -> Tensor:  # fmt: skip
        q, k, v, idx = _operands(q, k, v, block_indices, info)
        o_cmp = RowRuns(start=cmp_start, runs=cmp_runs)
        o_sel = torch.empty(info.batch, info.tq, info.hq, info.dv, dtype=q.dtype, device=q.device)
        parts = GatedSum(o_cmp=o_cmp, o_win=o_win, gates=gates)
        o, lse = forward(q, k, v, idx, info, parts, sel_out=o_sel, local=local)
        ctx.save_for_backward(q, k, v, o_sel, lse, idx, o_win, gates, *cmp_runs)
        ctx.info, ctx.cmp_start = info, cmp_start
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, do: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, o_sel, lse, idx, o_win, gates, *cmp_runs = ctx.saved_tensors
        want_gates = ctx.needs_input_grad[4]
        o_cmp = RowRuns(start=ctx.cmp_start, runs=tuple(cmp_runs))
        d_cmp, d_sel, d_win, d_gates = combine_bwd(
            do, o_cmp, o_sel, o_win, gates, want_gates=want_gates
        )
        assert d_cmp is not None
        assert d_sel is not None
        dq, dk, dv = backward(d_sel, q, k, v, o_sel, lse, idx, ctx.info)
        # Each run's gradient is its rows of d o_cmp (a view).
        d_runs, row = [], ctx.cmp_start
        for run in cmp_runs:
            d_runs.append(d_cmp[:, row : row + run.shape[1]])
            row += run.shape[1]
        return dq, dk, dv, d_win, d_gates, None, None, None, None, *d_runs


def selected_attention_bwd(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
    block_indices: Tensor, sel_block: int, scale: float | None = None, *, q_start: int = 0,
    cu_seqlens: Tensor | None = None, config: SelConfig | None = None,
    toggles: Toggles | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """dq, dk, dv for the upstream gradient ``do [B, Tq, HQ, dv]`` (o [B, Tq, HQ, dv] and
    lse [B, Tq, HQ] float32 from :func:`selected_attention_fwd` of the same arguments)."""
    check_call(q, k, v, block_indices, sel_block, scale, q_start, cu_seqlens, config, toggles)
    check_backward_args(do, o, lse, q, v)
    check_triton_runs("q", q)
    info = prepare(
        q, k, v, block_indices, sel_block, scale, q_start, cu_seqlens, config, toggles,
        validated=True,
    )  # fmt: skip
    q, k, v, idx = _operands(q, k, v, block_indices, info)
    return backward(do, q, k, v, o, lse, idx, info)


class SelectedAttentionFunction(torch.autograd.Function):
    """o = selected_attention(q, k, v) for a prepared call; backward gives dq, dk, dv without
    atomics."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, info: Launch
    ) -> Tensor:
        q, k, v, idx = _operands(q, k, v, block_indices, info)
        o, lse = forward(q, k, v, idx, info)
        ctx.save_for_backward(q, k, v, o, lse, idx)
        ctx.info = info
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, do: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, o, lse, idx = ctx.saved_tensors
        dq, dk, dv = backward(do, q, k, v, o, lse, idx, ctx.info)
        return dq, dk, dv, None, None


def selected_attention_triton(
    q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, sel_block: int,
    scale: float | None = None, *, q_start: int = 0, cu_seqlens: Tensor | None = None,
    config: SelConfig | None = None, toggles: Toggles | None = None, validated: bool = False,
) -> Tensor:  # fmt: skip
    """Selected attention (docs/spec.md), the Triton kernels; same contract as the reference.

    Query row r sits at position ``t = q_start + r``; its head h (group ``h // G``) attends in one
    softmax to every token p with ``p // sel_block`` in ``block_indices[b, r, h // G]`` and
    ``p <= t``. -1 is padding, a repeated index counts once, a row that sees nothing gives 0.

    Args:
        q: [B, Tq, HQ, dk]; k: [B, Tk, H, dk]; v: [B, Tk, H, dv]; float16, bfloat16 or float32.
        block_indices: [B, Tq, H, n] int32/int64 in [-1, ceil(Tk / sel_block)).
        sel_block: l'.
        scale: softmax scale, default dk ** -0.5.
        q_start: position of q[:, 0].
        cu_seqlens: int32 [S+1] for packed sequences (B == 1, q_start == 0, Tk == Tq).
        config: tiles and launch parameters (default: :func:`resolve_config`).
        toggles: the toggles the routing decision was made with (NSA_SEL_TRITON_GROUP,
            NSA_SEL_CHECK_INDICES); default :func:`nsa_core.toggles.get_toggles`.
        validated: nsa-core validated the call already; nothing is checked again.

    Returns:
        o [B, Tq, HQ, dv] in q's dtype; differentiable in q, k and v.
    """
    info = prepare(
        q, k, v, block_indices, sel_block, scale, q_start, cu_seqlens, config, toggles,
        validated=validated,
    )  # fmt: skip
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out = SelectedAttentionFunction.apply(q, k, v, block_indices, info)  # type: ignore[no-untyped-call]
        assert isinstance(out, torch.Tensor)
        return out
    return forward(*_operands(q, k, v, block_indices, info), info)[0]


def kv_bytes_read(
    batch: int, tq: int, h: int, n: int, sel_block: int, dk: int, dv: int, itemsize: int
) -> int:
    """Bytes of K/V the forward loads when every slot holds a full block: B*Tq*H*n*l'*(dk+dv)."""
    return batch * tq * h * n * sel_block * (dk + dv) * itemsize


def attention_flops(batch: int, tq: int, hq: int, n: int, sel_block: int, dk: int, dv: int) -> int:
    """Matmul FLOPs of the forward with full blocks: 2 * B*Tq*HQ*n*l' * (dk + dv)."""
    return 2 * batch * tq * hq * n * sel_block * (dk + dv)


__all__ = [
    "GatedSelectedFunction",
    "SelConfig",
    "SelectedAttentionFunction",
    "attention_flops",
    "kv_bytes_read",
    "parse_config",
    "resolve_config",
    "selected_attention_bwd",
    "selected_attention_fwd",
    "selected_attention_gated_triton",
    "selected_attention_triton",
    "tma_available",
    "unique_block_rows",
]
