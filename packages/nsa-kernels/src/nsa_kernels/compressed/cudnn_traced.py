"""The folded compressed runs (:mod:`nsa_kernels.compressed.cudnn`) as custom ops, for traced
calls.

Eager code keeps each run's autograd graph and reads the finite flag of the compressed keys on
the host in the backward (:class:`nsa_kernels.compressed.cudnn._FoldedFunction`); neither can
enter a graph. Under torch.compile the runs are two opaque ops instead:

- ``nsa::folded_runs`` (q [B, Tq, HQ, dk], k_cmp [B, N, H, dk], v_cmp [B, N, H, dv]) ->
  [lse [B, Tq, HQ] float32, run_0 [B, n_0, HQ, dv], ...]: the forward eager code runs without a
  gradient (:func:`nsa_kernels.compressed.cudnn.forward_runs`), one run per attention call from
  the first query that sees a block, each contiguous;
- ``nsa::folded_runs_backward``: dq, dk_cmp, dv_cmp from the runs' upstream gradients. Each run
  is differentiated by its attend's own backward on the run's folded layout (the forward's
  layout does not matter: a run is [B, n, HQ, dv] contiguous either way); dk_cmp and dv_cmp sum
  the runs and a row's d slots in float32. Where the keys or values hold a non-finite value the
  forward was contained by the Triton kernels, and so is the backward: the op reads the flag on
  the host (one wait, inside the op, for the work queued before it; none during a CUDA graph
  capture, as :class:`nsa_kernels.common.finite_flag.HostFlag` reads).

An op takes no callable: an attend crosses as its name in :data:`TRACED_ATTENDS`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from nsa_core.toggles import get_toggles
from nsa_kernels.common.finite_flag import HostFlag, all_finite_flag
from nsa_kernels.common.op_calls import CompressedCall
from nsa_kernels.compressed import cudnn
from nsa_kernels.compressed.cmp_fold import RowSplit, row_split

# The attends a traced call can name: name -> (forward, backward).
TRACED_ATTENDS: dict[str, tuple[cudnn.Attend, cudnn.AttendBackward]] = {
    "cudnn": (cudnn.cudnn_attend, cudnn.cudnn_attend_backward),
}


def attend_name(attend: cudnn.Attend) -> str:
    """The name under which ``attend`` is in :data:`TRACED_ATTENDS` (ValueError if it is not)."""
    for name, (forward, _) in TRACED_ATTENDS.items():
        if forward is attend:
            return name
    raise ValueError(
        f"attend {getattr(attend, '__name__', attend)!r} has no backward in TRACED_ATTENDS: "
        "a traced call cannot run it"
    )


def traced_folded_runs(
    q: Tensor, k_cmp: Tensor, v_cmp: Tensor, call: CompressedCall, attend: cudnn.Attend,
    contain: bool,
) -> tuple[list[Tensor], Tensor]:  # fmt: skip
    """``nsa::folded_runs`` for :func:`nsa_kernels.compressed.cudnn.folded_runs`: (the runs of o,
    lse), shapes as :func:`nsa_kernels.compressed.cudnn.forward_runs`."""
    lse, *runs = torch.ops.nsa.folded_runs(
        q, k_cmp, v_cmp, call.cmp_block, call.cmp_stride, call.scale, call.q_start,
        attend_name(attend), contain,
    )  # fmt: skip
    return runs, lse


def _call(cmp_block: int, cmp_stride: int, scale: float, q_start: int) -> CompressedCall:
    return CompressedCall(
        scale=scale, q_start=q_start, cu_seqlens=None, toggles=get_toggles(),
        cmp_block=cmp_block, cmp_stride=cmp_stride,
    )  # fmt: skip


@torch.library.custom_op("nsa::folded_runs", mutates_args=())
def folded_runs(
    q: Tensor, k_cmp: Tensor, v_cmp: Tensor, cmp_block: int, cmp_stride: int, scale: float,
    q_start: int, attend: str, contain: bool,
) -> list[Tensor]:  # fmt: skip
    """[lse, *runs] of the folded compressed attention through the attend named ``attend``."""
    call = _call(cmp_block, cmp_stride, scale, q_start)
    split = cudnn.checked_split(q, k_cmp, call)
    forward = TRACED_ATTENDS[attend][0]
    with torch.no_grad():
        runs, lse = cudnn.forward_runs(q, k_cmp, v_cmp, split, call, forward, contain)
    # The attend writes o in q's layout, which makes every run contiguous; the fake outputs
    # promise that layout, so any other is copied into it.
    return [lse, *(run.contiguous() for run in runs)]


@folded_runs.register_fake
def _(
    q: Tensor, k_cmp: Tensor, v_cmp: Tensor, cmp_block: int, cmp_stride: int, scale: float,
    q_start: int, attend: str, contain: bool,
) -> list[Tensor]:  # fmt: skip
    batch, tq, hq, _ = q.shape
    split = row_split(tq, q_start, cmp_block, cmp_stride)
    lse = q.new_empty(batch, tq, hq, dtype=torch.float32)
    dv = v_cmp.shape[-1]
    return [lse, *(q.new_empty(batch, n, hq, dv) for _, n in cudnn.run_spans(split, cmp_stride))]


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: list[Tensor]) -> None:
    q, k_cmp, v_cmp, *scalars = inputs
    lse, *runs = output
    ctx.save_for_backward(q, k_cmp, v_cmp, lse, *runs)
    ctx.scalars = scalars


def _backward(ctx: Any, grads: list[Tensor | None]) -> tuple[Tensor | None, ...]:
    q, k_cmp, v_cmp, lse, *runs = ctx.saved_tensors
    # An unused run has no gradient: it adds nothing.
    run_grads = [
        torch.zeros_like(run) if grad is None else grad
        for grad, run in zip(grads[1:], runs, strict=True)
    ]
    dq, dk, dv = torch.ops.nsa.folded_runs_backward(
        run_grads, q, k_cmp, v_cmp, lse, runs, *ctx.scalars
    )
    return dq, dk, dv, *([None] * len(ctx.scalars))


folded_runs.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("nsa::folded_runs_backward", mutates_args=())
def folded_runs_backward(
    grads: list[Tensor], q: Tensor, k_cmp: Tensor, v_cmp: Tensor, lse: Tensor, runs: list[Tensor],
    cmp_block: int, cmp_stride: int, scale: float, q_start: int, attend: str, contain: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """dq [B, Tq, HQ, dk], dk_cmp [B, N, H, dk], dv_cmp [B, N, H, dv] of ``nsa::folded_runs``
    for the runs' upstream gradients ``grads`` (one per run)."""
    call = _call(cmp_block, cmp_stride, scale, q_start)
    split = cudnn.checked_split(q, k_cmp, call)
    if contain and runs and not HostFlag.send(all_finite_flag(k_cmp, v_cmp)).read():
        grads_in = cudnn.contained_backward(q, k_cmp, v_cmp, lse, runs, grads, split.blind, call)
        dq, dk, dv = (_laid_out_as(g, x) for g, x in zip(grads_in, (q, k_cmp, v_cmp), strict=True))
        return dq, dk, dv
    backward = TRACED_ATTENDS[attend][1]
    dq = torch.empty_like(q)
    dq[:, : split.blind] = 0
    dk = torch.zeros(k_cmp.shape, dtype=torch.float32, device=k_cmp.device)
    dv = torch.zeros(v_cmp.shape, dtype=torch.float32, device=v_cmp.device)
    spans = cudnn.run_spans(split, cmp_stride)
    for (first, n), grad, run in zip(spans, grads, runs, strict=True):
        part = q[:, first : first + n]
        lse_run = lse[:, first : first + n]
        if first == split.blind + split.head and split.rows:
            dq_run, keys, dk_run, dv_run = _rows_backward(
                grad, part, k_cmp, v_cmp, run, lse_run, split, cmp_stride, scale, backward
            )
        else:
            keys = split.head_keys if first < split.blind + split.head else split.tail_keys
            dq_run, dk_run, dv_run = _prefix_backward(
                grad, part, k_cmp, v_cmp, run, lse_run, keys, scale, backward
            )
        dq[:, first : first + n] = dq_run
        dk[:, :keys] += dk_run
        dv[:, :keys] += dv_run
    return dq, _laid_out_as(dk, k_cmp), _laid_out_as(dv, v_cmp)


def _laid_out_as(grad: Tensor, x: Tensor) -> Tensor:
    """``grad`` in x's dtype and in ``torch.empty_like(x)``'s layout, which the fake outputs
    promise (a compiled graph reads the op's outputs with those strides)."""
    out = torch.empty_like(x)
    if grad.dtype == x.dtype and grad.stride() == out.stride():
        return grad
    return out.copy_(grad)


@folded_runs_backward.register_fake
def _(
    grads: list[Tensor], q: Tensor, k_cmp: Tensor, v_cmp: Tensor, lse: Tensor, runs: list[Tensor],
    cmp_block: int, cmp_stride: int, scale: float, q_start: int, attend: str, contain: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    return torch.empty_like(q), torch.empty_like(k_cmp), torch.empty_like(v_cmp)


def _prefix_backward(
    grad: Tensor, part: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, keys: int,
    scale: float, backward: cudnn.AttendBackward,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Queries part [B, n, HQ, dk] that all see the first ``keys`` blocks (their o and lse as
    the forward gave them): (dq [B, n, HQ, dk], dk, dv [B, keys, H, D] float32)."""
    dq, dk, dv = backward(
        grad.contiguous().transpose(1, 2), part.transpose(1, 2), k[:, :keys].transpose(1, 2),
        v[:, :keys].transpose(1, 2), o.transpose(1, 2), lse.transpose(1, 2), None, False, scale,
    )  # fmt: skip
    return dq.transpose(1, 2), dk.transpose(1, 2).float(), dv.transpose(1, 2).float()


def _rows_backward(
    grad: Tensor, part: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, split: RowSplit,
    d: int, scale: float, backward: cudnn.AttendBackward,
) -> tuple[Tensor, int, Tensor, Tensor]:  # fmt: skip
    """The full rows, part [B, R*d, HQ, dk], folded as in the forward with the slots in the
    heads: (dq [B, R*d, HQ, dk], keys, dk, dv [B, keys, H, D] float32, the slots summed)."""
    batch, _, hq, dk_dim = part.shape
    rows, keys = split.rows, cudnn.row_span_keys(split)
    # lse [B, R*d, HQ] as the folded call left it: [B, d*HQ, R].
    lse_f = lse.reshape(batch, rows, d * hq).transpose(1, 2)
    bias = cudnn.offset_bias(split, keys, part)
    dqf, dkf, dvf = backward(
        cudnn.fold_rows(grad.contiguous(), rows, d), cudnn.fold_rows(part, rows, d),
        cudnn.slot_keys(k, keys, d), cudnn.slot_keys(v, keys, d), cudnn.fold_rows(o, rows, d),
        lse_f, bias, bias is None, scale,
    )  # fmt: skip
    dq = dqf.transpose(1, 2).reshape(batch, rows * d, hq, dk_dim)
    h = k.shape[2]

    def unfold_keys(x: Tensor) -> Tensor:  # [B, d*H, keys, D] -> [B, keys, H, D], slots summed
        slots = x.transpose(1, 2).reshape(batch, keys, d, h, x.shape[-1])
        return slots.sum(2, dtype=torch.float32)

    return dq, keys, unfold_keys(dkf), unfold_keys(dvf)
