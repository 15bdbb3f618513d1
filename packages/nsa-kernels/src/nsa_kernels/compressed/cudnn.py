"""Compressed branch on cuDNN's fused attention (torch's SDPA kernel), over folded queries.

Query t sees the first ``N_cmp(t + 1)`` compressed blocks, and the d queries of one row (d | t + 1
at its first query) see the same blocks (:class:`nsa_kernels.compressed.cmp_fold.RowSplit`). The
full rows are folded d to a row into the head dimension without a copy, q [B, R*d, HQ, dk] as
[B, R, d*HQ, dk]: heads ordered (slot, query head), and k_cmp / v_cmp repeated d times along their
heads (slot, kv head), so that GQA still pairs query head ``s*HQ + h`` with kv head
``(s*HQ + h) // G = s*H + h // G``. Row m then sees ``row_keys + m`` blocks: from q_start = 0 that
is cuDNN's causal mask on R rows and R blocks (``row_keys`` = 1); later starts (chunked prefill)
pass the offset diagonal as an additive bias. The few queries cut off before the first row and
after the last see one fixed prefix each (no mask), and queries with t < l - 1 see nothing:
output 0, lse -inf, no gradient.

A forward without a gradient on one sequence puts the slots into the batch dimension instead,
every slot reading one stride-0 view of the keys (faster there); each run of queries is written
once into the output, or left where cuDNN wrote it (:func:`folded_runs`, which the fused core,
:mod:`nsa_kernels.core`, hands to the selected launch: a :class:`RowRuns`). With a gradient,
:class:`_FoldedFunction` keeps each run's graph, gives each run as a differentiable output (left
where cuDNN wrote it as well) and writes dq once into place, where autograd on slices of q would
zero-fill and add a q-sized gradient per run.

A call whose compressed keys or values hold a non-finite value is served by the Triton kernels,
which keep such a value to the rows that see it (docs/spec.md, "Non-finite values"): cuDNN runs,
then the Triton forward overwrites its output where the keys are not all finite, decided on the
device (:func:`nsa_kernels.compressed.function.contain_non_finite_into`: no host sync).
With a gradient the flag also travels to the host behind the forward, and the backward reads it
there (by then long arrived: no wait on the device): the Triton backward serves a contained
forward, cuDNN's the rest.

A call traced by torch.compile runs the same forward and a backward of its own through two
custom ops (:mod:`nsa_kernels.compressed.cudnn_traced`): neither a run's autograd graph nor the
host's read of the flag can enter a graph.

The kernel is cuDNN's flash attention, reached through ``torch.ops.aten.
_scaled_dot_product_cudnn_attention``: the public SDPA does not return the log-sum-exp, which block
scoring reuses (docs/spec.md, "Block scoring on a GPU"). Its backward is torch's, whose dq is not
bitwise reproducible, so the backend declines a gradient under
``torch.use_deterministic_algorithms``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from nsa_core.registry import OpContext
from nsa_core.toggles import Toggles
from nsa_core.tracing import traced
from nsa_kernels.common.finite_flag import HostFlag, all_finite_flag
from nsa_kernels.common.op_calls import CompressedBackend, CompressedCall
from nsa_kernels.common.row_runs import RowRuns
from nsa_kernels.compressed.cmp_fold import RowSplit, row_split

# attend(q [B, Hq, Tq, dk], k [B, Hk, Tk, dk], v [B, Hk, Tk, dv], bias [1, 1, Tq, Tk] or None,
# causal, scale) -> (o [B, Hq, Tq, dv] in q's dtype, lse [B, Hq, Tq] float32): softmax attention
# of each query head over its kv head ``h // (Hq / Hk)``, the top-left causal mask if ``causal``,
# ``bias`` added to the scaled scores.
Attend = Callable[[Tensor, Tensor, Tensor, Tensor | None, bool, float], tuple[Tensor, Tensor]]
# attend_backward(do, q, k, v, o, lse, bias, causal, scale) -> (dq, dk, dv): the gradients of
# one :data:`Attend` call (layouts as there; o and lse the forward's, do laid out as o).
AttendBackward = Callable[
    [Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None, bool, float],
    tuple[Tensor, Tensor, Tensor],
]

CUDNN_OP = "_scaled_dot_product_cudnn_attention"

# Where the folded cuDNN call beats the Triton kernels, forward and forward+backward: from 16k
# tokens on; below it, repeated measurements disagree on the winner (docs/performance.md).
CUDNN_MIN_LEN = 16384
CUDNN_MAX_HEAD_DIM = 256


@functools.cache
def cudnn_missing_reason() -> str | None:
    """Why this torch cannot run :func:`cudnn_attend` (no cuDNN, or no cuDNN attention op that
    returns its log-sum-exp), or None; asked once per process (routing asks it every call)."""
    if not torch.backends.cudnn.is_available():  # type: ignore[no-untyped-call]
        return "torch was built without cuDNN"
    op = getattr(torch.ops.aten, CUDNN_OP, None)
    if op is None:
        return f"torch {torch.__version__} has no aten.{CUDNN_OP}"
    names = [arg.name for arg in op.default._schema.arguments]
    if names[:5] != ["query", "key", "value", "attn_bias", "compute_log_sumexp"]:
        return (
            f"torch {torch.__version__}'s aten.{CUDNN_OP} takes {names}, not (q, k, v, bias, lse)"
        )
    return None


def cudnn_compressed_supports(ctx: OpContext, toggles: Toggles) -> str | None:
    """Why the cuDNN row declines ``ctx`` (the table of :mod:`nsa_kernels.compressed.backends`),
    or None."""
    if not toggles.cmp_cudnn:
        return "NSA_CMP_CUDNN is off"
    if ctx.device.type != "cuda":
        return f"cuDNN attention runs on CUDA (device is {ctx.device.type})"
    if ctx.dtype not in (torch.float16, torch.bfloat16):
        return f"cuDNN attention takes float16 or bfloat16, got {ctx.dtype}"
    dims = (ctx.head_dim_qk, ctx.head_dim_v)
    if any(dim % 8 or dim > CUDNN_MAX_HEAD_DIM for dim in dims):
        return f"cuDNN attention needs head dims that are multiples of 8 up to 256, got {dims}"
    if ctx.varlen:
        return "packed sequences (cu_seqlens) are not folded for cuDNN"
    # A later start (chunked prefill) passes its offset diagonal as an additive bias, which
    # measured slower than the Triton kernels (docs/performance.md); called directly, the backend
    # serves it exactly.
    if ctx.q_start:
        return f"q_start = {ctx.q_start} > 0: the offset diagonal measured slower than Triton"
    if ctx.seq_len < CUDNN_MIN_LEN:
        return f"seq_len {ctx.seq_len} < {CUDNN_MIN_LEN}: the Triton kernels are as fast or faster"
    if ctx.requires_grad and torch.are_deterministic_algorithms_enabled():
        return "torch.use_deterministic_algorithms is on and cuDNN's dq is not bitwise reproducible"
    capability = ctx.device_capability
    if capability is None or capability < (9, 0):
        return f"measured faster than the Triton kernels on sm_90 only (device is sm {capability})"
    return cudnn_missing_reason()


def cudnn_attend(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """:data:`Attend` on cuDNN's fused attention (differentiable in q, k, v; lse detached)."""
    # cuDNN reads rows of contiguous channels; a caller's q, k or v may be strided along them.
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    out = getattr(torch.ops.aten, CUDNN_OP)(q, k, v, bias, True, 0.0, causal, False, scale=scale)
    batch, heads, tq = q.shape[:3]
    return out[0], out[1].detach().reshape(batch, heads, tq)


def cudnn_attend_backward(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, bias: Tensor | None,
    causal: bool, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """:data:`AttendBackward` of :func:`cudnn_attend`: cuDNN's fused backward, called as torch's
    autograd formula of the forward op calls it (no dropout: its seed and offset are unread)."""
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    unused = torch.zeros((), dtype=torch.long, device=q.device)
    # The forward gives lse as [B, Hq, Tq, 1].
    stats = lse.contiguous().unsqueeze(-1)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        do, q, k, v, o, stats, unused, unused, bias, None, None, q.shape[2], k.shape[2], 0.0,
        causal, scale=scale,
    )  # fmt: skip
    return dq, dk, dv


def _prefix(
    q: Tensor, k: Tensor, v: Tensor, keys: int, scale: float, attend: Attend
) -> tuple[Tensor, Tensor]:
    """Queries q [B, n, HQ, dk] that all see the first ``keys`` blocks: (o [B, n, HQ, dv], lse)."""
    o, lse = attend(
        q.transpose(1, 2),
        k[:, :keys].transpose(1, 2),
        v[:, :keys].transpose(1, 2),
        None,
        False,
        scale,
    )
    return o.transpose(1, 2), lse.transpose(1, 2)


def offset_bias(split: RowSplit, keys: int, q: Tensor) -> Tensor | None:
    """None where the rows see a causal prefix (``row_keys`` = 1), else the additive bias
    [1, 1, R, keys] of row m seeing blocks j <= m + row_keys - 1 (the diagonal moved right)."""
    if split.row_keys == 1:
        return None
    m = torch.arange(split.rows, device=q.device)[:, None]
    j = torch.arange(keys, device=q.device)[None, :]
    bias = torch.zeros(split.rows, keys, dtype=q.dtype, device=q.device)
    return bias.masked_fill(j > m + (split.row_keys - 1), float("-inf"))[None, None]


def _rows(
    q: Tensor, k: Tensor, v: Tensor, split: RowSplit, d: int, scale: float, attend: Attend
) -> tuple[Tensor, Tensor]:
    """The full rows, q [B, R*d, HQ, dk], in one folded call, slots into the heads:
    (o [B, R, d, HQ, dv], lse [B, R, d, HQ])."""
    batch, _, hq, _ = q.shape
    rows, keys = split.rows, row_span_keys(split)
    bias = offset_bias(split, keys, q)
    o, lse = attend(
        fold_rows(q, rows, d), slot_keys(k, keys, d), slot_keys(v, keys, d), bias, bias is None,
        scale,
    )  # fmt: skip
    o = o.transpose(1, 2).reshape(batch, rows, d, hq, o.shape[-1])
    return o, lse.reshape(batch, d, hq, rows).permute(0, 3, 1, 2)


def row_span_keys(split: RowSplit) -> int:
    """The blocks the full rows of ``split`` see together: the last row's."""
    return split.row_keys + split.rows - 1


def fold_rows(x: Tensor, rows: int, d: int) -> Tensor:
    """x [B, R*d, HQ, D] (query order) -> [B, d*HQ, R, D]: a row's d slots into the heads,
    (slot, query head) ordered, as the folded attention call takes q, o and do."""
    batch, _, hq, dim = x.shape
    return x.reshape(batch, rows, d * hq, dim).transpose(1, 2)


def slot_keys(x: Tensor, keys: int, d: int) -> Tensor:
    """The first ``keys`` blocks of x [B, N, H, D], repeated once per slot: [B, d*H, keys, D],
    heads (slot, kv head) ordered, so that GQA pairs query head ``s*HQ + h`` with kv head
    ``s*H + h // G``."""
    return x[:, :keys].repeat(1, 1, d, 1).transpose(1, 2)


def _rows_in_batch(
    q: Tensor, k: Tensor, v: Tensor, split: RowSplit, d: int, scale: float, attend: Attend
) -> tuple[Tensor, Tensor]:
    """:func:`_rows` for one sequence (B = 1) with the slots in the batch dimension, every slot
    reading one stride-0 view of the keys. Forward only: it measured faster than the slots in
    the heads; with a gradient the batch layout's backward was the slower
    (docs/performance.md)."""
    _, _, hq, dk = q.shape
    rows, keys = split.rows, row_span_keys(split)
    qf = q[0].reshape(rows, d, hq, dk).permute(1, 2, 0, 3)
    kf = k[0, :keys].transpose(0, 1).expand(d, -1, -1, -1)
    vf = v[0, :keys].transpose(0, 1).expand(d, -1, -1, -1)
    bias = offset_bias(split, keys, q)
    o, lse = attend(qf, kf, vf, bias, bias is None, scale)
    return o.permute(2, 0, 1, 3).unsqueeze(0), lse.permute(2, 0, 1).unsqueeze(0)


# One run of queries that see the same blocks or rows of them: (first query, its queries
# q [B, n, HQ, dk], o [B, n, HQ, dv] or [B, R, d, HQ, dv], lse [B, n, HQ] or [B, R, d, HQ]).
_Run = tuple[int, Tensor, Tensor, Tensor]


def run_spans(split: RowSplit, d: int) -> list[tuple[int, int]]:
    """(first query, count) of each attention run of ``split``: the cut row before the first
    full one, the full rows, the cut row after them (the blind queries need no call)."""
    head = split.blind + split.head
    spans = [(split.blind, split.head), (head, split.rows * d), (head + split.rows * d, split.tail)]
    return [(first, n) for first, n in spans if n]


def _runs(
    q: Tensor, k: Tensor, v: Tensor, split: RowSplit, call: CompressedCall, attend: Attend, *,
    in_batch: bool = False, leaves: bool = False,
) -> list[_Run]:  # fmt: skip
    """The attention calls of ``split`` in query order. ``in_batch``: the full rows with their
    slots in the batch dimension (:func:`_rows_in_batch`); ``leaves``: each run's queries are a
    leaf of their own graph (q detached), for :class:`_FoldedFunction`."""
    d, scale = call.cmp_stride, call.scale
    head = split.blind + split.head
    runs: list[_Run] = []
    for first, n in run_spans(split, d):
        part = q[:, first : first + n]
        if leaves:
            part.requires_grad_()
        if first == head and split.rows:
            fold = _rows_in_batch if in_batch else _rows
            o_run, lse_run = fold(part, k, v, split, d, scale, attend)
        else:
            keys = split.head_keys if first < head else split.tail_keys
            o_run, lse_run = _prefix(part, k, v, keys, scale, attend)
        runs.append((first, part, o_run, lse_run))
    return runs


def assemble_lse(q: Tensor, blind: int, runs: list[_Run]) -> Tensor:
    """lse [B, Tq, HQ] float32: each run's written once into its place, -inf on the blind
    queries."""
    batch, tq, hq, _ = q.shape
    lse = torch.empty(batch, tq, hq, dtype=torch.float32, device=q.device)
    lse[:, :blind] = float("-inf")
    for first, part, _, lse_run in runs:
        n = part.shape[1]
        lse[:, first : first + n].view(lse_run.shape).copy_(lse_run)
    return lse


class _FoldedFunction(torch.autograd.Function):
    """:func:`folded_runs` with a gradient: (lse, *o_runs), each run differentiable. Each run
    keeps its own graph over detached inputs, and the backward writes dq once into place:
    autograd on slices of q would fill a zero tensor the size of q for every run and add them
    (one fill and add of q's size per run).
    Without a run (every query blind) o_runs is one run of 0 rows.

    ``contain``: the runs and lse are contained on the device (:func:`contain_runs`), and the
    finite flag goes to the host (:class:`HostFlag`); where the backward reads it as not finite,
    the Triton backward of the contained forward gives the gradients, not cuDNN's graphs."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, split: RowSplit, call: CompressedCall,
        attend: Attend, contain: bool,
    ) -> tuple[Tensor, ...]:  # fmt: skip
        k_in, v_in = k.detach().requires_grad_(), v.detach().requires_grad_()
        with torch.enable_grad():
            runs = _runs(q.detach(), k_in, v_in, split, call, attend, leaves=True)
        lse = assemble_lse(q, split.blind, runs)
        ctx.runs, ctx.k_in, ctx.v_in, ctx.q_shape = runs, k_in, v_in, q.shape
        ctx.mark_non_differentiable(lse)
        ctx.finite, ctx.call, ctx.start = None, call, split.blind
        if not runs:
            return lse, q.new_zeros(q.shape[0], 0, q.shape[2], v.shape[-1])
        # A run's rows are (query, head) ordered as in q: the full rows [B, R, d, HQ, dv]
        # flatten to [B, R*d, HQ, dv] without a copy where cuDNN wrote them in q's layout.
        o_runs = tuple(o_run.detach().flatten(1, -3) for _, _, o_run, _ in runs)
        if contain:
            finite = all_finite_flag(k, v)
            contain_runs(RowRuns(start=split.blind, runs=o_runs), lse, q, k, v, call, finite)
            ctx.finite = HostFlag.send(finite)
            ctx.save_for_backward(q, k, v, lse, *o_runs)
        return lse, *o_runs

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, _grad_lse: Tensor | None, *grad_runs: Tensor
    ) -> tuple[Tensor | None, ...]:
        runs: list[_Run] = ctx.runs
        if ctx.finite is not None and not ctx.finite.read():
            dq, dk, dv = _contained_backward(ctx, grad_runs)
            return dq, dk, dv, None, None, None, None
        dq = grad_runs[0].new_empty(ctx.q_shape)
        if not runs:
            dq.zero_()
            return (
                dq, torch.zeros_like(ctx.k_in), torch.zeros_like(ctx.v_in), None, None, None, None
            )  # fmt: skip
        outs = [o_run for _, _, o_run, _ in runs]
        grads = [grad.reshape(o_run.shape) for grad, o_run in zip(grad_runs, outs, strict=True)]
        leaves = [part for _, part, _, _ in runs] + [ctx.k_in, ctx.v_in]
        # The runs' graphs live as long as this node: a second backward through a retained
        # outer graph finds them again; the engine drops both together otherwise.
        got = torch.autograd.grad(outs, leaves, grads, retain_graph=True, allow_unused=True)
        dq[:, : runs[0][0]] = 0
        for (first, part, _, _), dq_run in zip(runs, got, strict=False):
            dq[:, first : first + part.shape[1]] = dq_run
        return dq, got[-2], got[-1], None, None, None, None


def contain_runs(
    runs: RowRuns, lse: Tensor, q: Tensor, k_cmp: Tensor, v_cmp: Tensor, call: CompressedCall,
    finite: Tensor,
) -> None:  # fmt: skip
    """docs/spec.md, "Non-finite values": a non-finite compressed key or value reaches only the
    rows that see its block. Whether cuDNN's tiles keep such a value from rows beside them that
    do not see it (a masked entry still meets the block's value, 0 x NaN) is not established;
    the Triton kernels' containment is tested (tests/test_nonfinite_kernels.py). So the Triton
    forward overwrites each run of o and its rows of lse where ``finite`` (an
    :func:`all_finite_flag` of k_cmp and v_cmp) is 0, decided on the device: a host check
    would cost a sync, and the GPU idles while the host catches up after one."""
    from nsa_kernels.compressed.function import contain_non_finite_into

    row = runs.start
    for run in runs.runs:
        n = run.shape[1]
        # Each run's queries start at their own position.
        contain_non_finite_into(
            run, lse[:, row : row + n], q[:, row : row + n], k_cmp, v_cmp, call.cmp_block,
            call.cmp_stride, call.scale, q_start=call.q_start + row, finite=finite,
            validated=True,
        )  # fmt: skip
        row += n


def _contained_backward(ctx: Any, grad_runs: tuple[Tensor, ...]) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`contained_backward` from :class:`_FoldedFunction`'s saved tensors."""
    q, k, v, lse, *o_runs = ctx.saved_tensors
    return contained_backward(q, k, v, lse, o_runs, grad_runs, ctx.start, ctx.call)


def contained_backward(
    q: Tensor, k: Tensor, v: Tensor, lse: Tensor, o_runs: Sequence[Tensor],
    grad_runs: Sequence[Tensor], start: int, call: CompressedCall,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """dq, dk_cmp, dv_cmp of a contained forward (keys not all finite) on the Triton kernels,
    from the o runs and lse they wrote (:func:`contain_runs`, runs from row ``start``) and the
    runs' upstream gradients."""
    from nsa_kernels.compressed.function import compressed_attention_bwd

    do = RowRuns(start=start, runs=tuple(g.contiguous() for g in grad_runs)).assemble()
    o = RowRuns(start=start, runs=tuple(o_runs)).assemble()
    return compressed_attention_bwd(
        do,
        q,
        k,
        v,
        o,
        lse,
        call.cmp_block,
        call.cmp_stride,
        call.scale,
        q_start=call.q_start,
        validated=True,
    )


def checked_split(q: Tensor, k_cmp: Tensor, call: CompressedCall) -> RowSplit:
    """The :class:`RowSplit` of q's queries, k_cmp holding every block they see."""
    split = row_split(q.shape[1], call.q_start, call.cmp_block, call.cmp_stride)
    last_keys = max(split.head_keys, row_span_keys(split), split.tail_keys)
    if last_keys > k_cmp.shape[1]:
        raise ValueError(f"queries see {last_keys} blocks, k_cmp holds {k_cmp.shape[1]}")
    return split


def folded_attention(
    q: Tensor,
    k_cmp: Tensor,
    v_cmp: Tensor,
    call: CompressedCall,
    attend: Attend,
    *,
    contain: bool = False,
) -> tuple[Tensor, Tensor]:
    """Dense compressed attention through ``attend`` on folded queries: q [B, Tq, HQ, dk],
    k_cmp [B, N, H, dk], v_cmp [B, N, H, dv] -> (o [B, Tq, HQ, dv] in q's dtype, lse [B, Tq, HQ]
    float32, -inf where a query sees no block). ``contain``: as :func:`folded_runs`."""
    runs, lse = folded_runs(q, k_cmp, v_cmp, call, attend, contain=contain)
    return runs.assemble(), lse


def folded_runs(
    q: Tensor,
    k_cmp: Tensor,
    v_cmp: Tensor,
    call: CompressedCall,
    attend: Attend,
    *,
    contain: bool = False,
) -> tuple[RowRuns, Tensor]:
    """:func:`folded_attention` with o as the attention calls left it: a
    :class:`RowRuns` from the first query that sees a block, one run per call
    (each [B, n, HQ, dv], a view of that call's output where its layout allows), and lse
    [B, Tq, HQ] in one tensor. Putting o's runs in one tensor is a copy of its whole size, which
    a consumer that reads the runs in place (the selected branch's gated launch, forward and
    backward) does without.
    With a gradient (:class:`_FoldedFunction`) each run is differentiable in q, k_cmp and v_cmp;
    the full rows then carry their slots in the heads (the batch layout's backward was slower).

    ``contain``: where k_cmp or v_cmp holds a non-finite value, the Triton kernels give o and
    lse (and the gradients), decided without a host sync (:func:`contain_runs`)."""
    split = checked_split(q, k_cmp, call)
    if traced(q, k_cmp, v_cmp):
        from nsa_kernels.compressed.cudnn_traced import traced_folded_runs

        o_runs, lse = traced_folded_runs(q, k_cmp, v_cmp, call, attend, contain)
    elif torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_cmp, v_cmp)):
        lse, *o_runs = _FoldedFunction.apply(q, k_cmp, v_cmp, split, call, attend, contain)  # type: ignore[no-untyped-call]
        return RowRuns(start=split.blind, runs=tuple(o_runs)), lse
    else:
        o_runs, lse = forward_runs(q, k_cmp, v_cmp, split, call, attend, contain)
    if not o_runs:
        o = q.new_zeros(q.shape[0], q.shape[1], q.shape[2], v_cmp.shape[-1])
        return RowRuns.whole(o), lse
    return RowRuns(start=split.blind, runs=tuple(o_runs)), lse


def forward_runs(
    q: Tensor, k_cmp: Tensor, v_cmp: Tensor, split: RowSplit, call: CompressedCall,
    attend: Attend, contain: bool,
) -> tuple[list[Tensor], Tensor]:  # fmt: skip
    """The runs of o ([B, n, HQ, dv] each, in query order from ``split.blind``; none where every
    query is blind) and lse [B, Tq, HQ] of :func:`folded_runs` without a gradient."""
    runs = _runs(q, k_cmp, v_cmp, split, call, attend, in_batch=q.shape[0] == 1)
    lse = assemble_lse(q, split.blind, runs)
    o_runs = [o_run.flatten(1, -3) for _, _, o_run, _ in runs]
    if contain and o_runs:
        contained = RowRuns(start=split.blind, runs=tuple(o_runs))
        contain_runs(contained, lse, q, k_cmp, v_cmp, call, all_finite_flag(k_cmp, v_cmp))
    return o_runs, lse


def _with_lse(
    q: Tensor, k_cmp: Tensor, v_cmp: Tensor, call: CompressedCall
) -> tuple[Tensor, Tensor]:
    if call.cu_seqlens is not None:
        raise ValueError("the cuDNN compressed backend takes dense inputs (no cu_seqlens)")
    return folded_attention(q, k_cmp, v_cmp, call, cudnn_attend, contain=True)


def _runs_with_lse(
    q: Tensor, k_cmp: Tensor, v_cmp: Tensor, call: CompressedCall
) -> tuple[RowRuns, Tensor]:
    """:func:`_with_lse` with o as a :class:`RowRuns` (:func:`folded_runs`),
    with or without a gradient."""
    if call.cu_seqlens is not None:
        raise ValueError("the cuDNN compressed backend takes dense inputs (no cu_seqlens)")
    return folded_runs(q, k_cmp, v_cmp, call, cudnn_attend, contain=True)


def _output(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, call: CompressedCall) -> Tensor:
    return _with_lse(q, k_cmp, v_cmp, call)[0]


# nsa_core's compressed_attention on cuDNN, with its signature; dense inputs only. The second
# returns (o, lse), the registry's fn_with_lse; the third (RowRuns, lse), the fused core's.
compressed_attention_cudnn = CompressedBackend(_output)
compressed_attention_cudnn_with_lse = CompressedBackend(_with_lse)
compressed_attention_cudnn_runs_with_lse = CompressedBackend(_runs_with_lse)
