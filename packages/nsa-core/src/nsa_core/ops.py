"""The public ops of one NSA layer: validate once, ask the registry, run the chosen backend.

Each op has the signature, shapes and docstring of its reference body in :mod:`nsa_core.reference`
(``q [B, T, HQ, dk]``, ``k [B, T, H, dk]``, ``v [B, T, H, dv]``, ``block_indices [B, T, H, n]``;
docs/spec.md). A call checks every argument with the op's validator in :mod:`nsa_core.checks`,
which returns the call's :class:`~nsa_core.op_context.OpContext`; the registry resolves the
backend for it (:func:`nsa_core.registry.resolve_fn`, the same decision that ``routing_report``
shows, wrapped in the debug hooks when NSA_DEBUG_SHAPES/TIMING/COMPARE is on), which receives the
call's arguments as given and the toggles the decision was made with. On a CPU, in float64, or
with ``NSA_<STEP>_BACKEND=reference`` the backend is the reference body, which stays callable by
name (with its own checks) everywhere.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import torch

from nsa_core import reference
from nsa_core.checks import (
    check_apply_rope,
    check_compressed_attention,
    check_gated_combine,
    check_select_blocks,
    check_selected_attention,
    check_sliding_attention,
)
from nsa_core.local_softmax import LocalSoftmax, check_holds_local_keys, check_local_softmax
from nsa_core.op_context import OpContext, op_context
from nsa_core.registry import (
    resolve,
    resolve_fn,
    resolve_fn_sum3,
    resolve_fn_with_lse,
    resolve_gated,
)
from nsa_core.row_runs import RowRuns, check_gated_combine_runs
from nsa_core.toggles import get_toggles

P = ParamSpec("P")
R = TypeVar("R")

__all__ = [
    "apply_rope",
    "compressed_attention",
    "compressed_attention_runs_with_lse",
    "compressed_attention_with_lse",
    "fan_out",
    "gated_combine",
    "op_context",
    "select_blocks",
    "selected_attention",
    "selected_attention_gated",
    "sliding_attention",
    "sliding_attention_with_local",
]

_ROUTED = """

    Public op (:mod:`nsa_core.ops`): validated once, then run by the backend the registry picks
    for the call (``routing_report``); the reference body is :func:`nsa_core.reference.{name}`.
"""


def public_op(op: str, body: Callable[P, R], check: Callable[..., OpContext]) -> Callable[P, R]:
    """The public ``op``: ``check`` the arguments, resolve the backend, call it.

    ``body`` (the reference op) lends its name, signature and docstring; ``check`` takes the
    same arguments and returns the routing context.
    """

    @functools.wraps(body)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        ctx = check(*args, **kwargs)
        toggles = get_toggles()
        out: R = resolve_fn(op, ctx, toggles)(*args, **kwargs, toggles=toggles)
        return out

    call.__doc__ = (body.__doc__ or "").rstrip() + _ROUTED.format(name=body.__name__)
    return call


def public_op_with_lse(
    op: str, body: Callable[P, torch.Tensor], check: Callable[..., OpContext]
) -> Callable[P, tuple[torch.Tensor, torch.Tensor | None]]:
    """The public ``op`` that also returns its backend's log-sum-exp, where it has one.

    The call returns ``(o, lse)``: ``o`` exactly as the plain public op gives it, and the chosen
    backend's ``fn_with_lse`` normaliser, detached, or None when that backend has none (or a
    debug hook is on: the hooks observe ``fn``).
    """

    @functools.wraps(body)
    def call(*args: P.args, **kwargs: P.kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        ctx = check(*args, **kwargs)
        toggles = get_toggles()
        fn_with_lse = resolve_fn_with_lse(op, ctx, toggles)
        if fn_with_lse is None:
            o: torch.Tensor = resolve_fn(op, ctx, toggles)(*args, **kwargs, toggles=toggles)
            return o, None
        o, lse = fn_with_lse(*args, **kwargs, toggles=toggles)
        return o, None if lse is None else lse.detach()

    call.__name__ = call.__qualname__ = f"{body.__name__}_with_lse"
    return call


apply_rope = public_op("apply_rope", reference.apply_rope.body, check_apply_rope)
compressed_attention = public_op(
    "compressed_attention", reference.compressed_attention.body, check_compressed_attention
)
selected_attention = public_op(
    "selected_attention", reference.selected_attention.body, check_selected_attention
)
sliding_attention = public_op(
    "sliding_attention", reference.sliding_attention.body, check_sliding_attention
)
selected_attention.__doc__ = (selected_attention.__doc__ or "") + (
    "    On CUDA the public op does not read the index range back (a device sync) unless\n"
    "    NSA_SEL_CHECK_INDICES is set: kernels treat out-of-range entries as -1.\n"
)
select_blocks = public_op("select_blocks", reference.select_blocks.body, check_select_blocks)
gated_combine = public_op("gated_combine", reference.gated_combine.body, check_gated_combine)

compressed_attention_with_lse = public_op_with_lse(
    "compressed_attention", reference.compressed_attention.body, check_compressed_attention
)
compressed_attention_with_lse.__doc__ = """:func:`compressed_attention` and, where its backend
    produces one, its log-sum-exp.

    Same arguments as :func:`compressed_attention`.

    Returns:
        o_cmp [B, Tq, HQ, dv], exactly what :func:`compressed_attention` returns, and lse
        [B, Tq, HQ] float32 (natural log of the softmax normaliser over the visible blocks,
        ``log sum_i exp(scale * q . k_cmp[i])``, -inf on rows that see none), detached; or
        None when the chosen backend has no ``fn_with_lse`` (or a debug hook is on). Meant for
        :func:`select_blocks`'s ``lse``, with the same q, k_cmp, scale, q_start and cu_seqlens.
    """


def compressed_attention_runs_with_lse(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    cmp_block: int,
    cmp_stride: int,
    scale: float | None = None,
    *,
    q_start: int = 0,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[RowRuns, torch.Tensor | None]:
    """:func:`compressed_attention_with_lse` with o_cmp as a :class:`~nsa_core.row_runs.RowRuns`.

    Where the chosen backend has a ``fn_runs_with_lse``, its rows stay where it computed them
    (no copy into one tensor; for :func:`selected_attention_gated`, whose backend may read them
    in place); else the one tensor as a single run. The lse is the same either way.
    """
    ctx = check_compressed_attention(
        q, k_cmp, v_cmp, cmp_block, cmp_stride, scale, q_start=q_start, cu_seqlens=cu_seqlens
    )
    toggles = get_toggles()
    args = (q, k_cmp, v_cmp, cmp_block, cmp_stride, scale)
    kwargs = {"q_start": q_start, "cu_seqlens": cu_seqlens, "toggles": toggles}
    if toggles.debug_hooks:
        # The hooks observe ``fn``: no runs, no lse (as compressed_attention_with_lse).
        return RowRuns.whole(
            resolve_fn("compressed_attention", ctx, toggles)(*args, **kwargs)
        ), None
    # One resolution: the backend's runs where it has them, else its (o, lse), else its o.
    backend = resolve("compressed_attention", ctx, toggles).backend
    if backend.fn_runs_with_lse is not None:
        runs, lse = backend.fn_runs_with_lse(*args, **kwargs)
    elif backend.fn_with_lse is not None:
        o, lse = backend.fn_with_lse(*args, **kwargs)
        runs = RowRuns.whole(o)
    else:
        runs, lse = RowRuns.whole(backend.fn(*args, **kwargs)), None
    return runs, None if lse is None else lse.detach()


def selected_attention_gated(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_indices: torch.Tensor,
    sel_block: int,
    scale: float | None = None,
    *,
    o_cmp: torch.Tensor | RowRuns,
    o_win: torch.Tensor,
    gates: torch.Tensor,
    q_start: int = 0,
    cu_seqlens: torch.Tensor | None = None,
    local: LocalSoftmax | None = None,
) -> torch.Tensor | None:
    """``gated_combine(o_cmp, selected_attention(...), o_win, gates)`` in one step, or None.

    Arguments as :func:`selected_attention` and :func:`gated_combine` take them. The step runs
    where the backend the registry picks for ``selected_attention`` has a ``fn_gated``
    (:class:`nsa_core.registry.Backend`) that serves the call (with a gradient only where it
    gives one), no debug hook is on, and ``gated_combine`` itself would not run on the
    reference (a pinned reference combine is honoured): :func:`nsa_core.registry.
    resolve_gated`. Otherwise it returns None and the caller runs the two ops.

    o_cmp may come as a :class:`~nsa_core.row_runs.RowRuns`
    (:func:`compressed_attention_runs_with_lse`): read in place where the backend takes runs
    (``gated_runs``; with a gradient, each run gets its own), else assembled first.

    ``local``: each row's softmax over its forced blocks, from
    :func:`sliding_attention_with_local` over these same k and v (l' = ``sel_block``); every
    index row must hold its blocks 0 and ``max(jt - 1, 0) .. jt`` (``select_blocks``'s forced
    blocks, n >= 3). A backend with ``gated_local`` starts from it (:func:`selected_takes_local`
    asks first); the result is the same up to rounding.
    """
    combine_ctx = check_gated_combine_runs(o_cmp, o_win, gates)
    ctx = check_selected_attention(
        q, k, v, block_indices, sel_block, scale, q_start=q_start, cu_seqlens=cu_seqlens
    )
    toggles = get_toggles()
    gated = resolve_gated(ctx, combine_ctx, toggles)
    if gated is None or gated.fn_gated is None:
        return None
    if isinstance(o_cmp, RowRuns) and not gated.gated_runs:
        o_cmp = o_cmp.assemble()
    extra: dict[str, Any] = {}
    if gated.gated_local is not None and local is not None:
        check_local_softmax(local, tuple(o_win.shape), sel_block)
        extra["local"] = local
    o: torch.Tensor = gated.fn_gated(
        q, k, v, block_indices, sel_block, scale, o_cmp=o_cmp, o_win=o_win, gates=gates,
        q_start=q_start, cu_seqlens=cu_seqlens, toggles=toggles, **extra,
    )  # fmt: skip
    return o


def selected_takes_local(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_indices: torch.Tensor,
    sel_block: int,
    scale: float | None = None,
    *,
    o_cmp: torch.Tensor | RowRuns,
    gates: torch.Tensor,
    win_grad: bool,
    q_start: int = 0,
    cu_seqlens: torch.Tensor | None = None,
) -> bool:
    """Whether :func:`selected_attention_gated` of these arguments would start from a
    :class:`~nsa_core.local_softmax.LocalSoftmax`: its backend runs the one-step gated sum and
    has a ``gated_local`` that wants one for this call. Asked before the sliding branch runs, so
    that it computes the local softmax only for a consumer; ``win_grad``: o_win will need a
    gradient.
    """
    dv = v.shape[-1]
    # o_win does not exist yet: a stand-in of its shape, dtype and device (no storage).
    stand_in = gates.new_zeros(()).expand(*gates.shape[:3], dv)
    combine_ctx = check_gated_combine_runs(o_cmp, stand_in, gates)
    combine_ctx = dataclasses.replace(
        combine_ctx, requires_grad=combine_ctx.requires_grad or win_grad
    )
    ctx = check_selected_attention(
        q, k, v, block_indices, sel_block, scale, q_start=q_start, cu_seqlens=cu_seqlens
    )
    gated = resolve_gated(ctx, combine_ctx, get_toggles())
    return gated is not None and gated.gated_local is not None and gated.gated_local(ctx)


def sliding_attention_with_local(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    sel_block: int,
    scale: float | None = None,
    *,
    q_start: int = 0,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LocalSoftmax | None]:
    """:func:`sliding_attention` and, where its backend has a ``fn_with_local``, each row's
    softmax over its forced blocks' keys, ``[0, l')`` and ``[max(t // l' - 1, 0) * l', t]``
    (l' = ``sel_block``).

    Arguments as :func:`sliding_attention`, and sel_block: l'. The window must hold the second
    range, the local keys (w >= 2 l', or no shorter than the keys).

    Returns:
        o_win [B, Tq, HQ, dv], what :func:`sliding_attention` returns (up to rounding: the
        backend sums the local keys first), and the local softmax, or None where the chosen
        backend has no ``fn_with_local`` (or a debug hook is on: the hooks observe ``fn``).
    """
    ctx = check_sliding_attention(q, k, v, window, scale, q_start=q_start, cu_seqlens=cu_seqlens)
    check_holds_local_keys(window, sel_block, k.shape[1])
    toggles = get_toggles()
    args = (q, k, v, window, scale)
    kwargs = {"q_start": q_start, "cu_seqlens": cu_seqlens, "toggles": toggles}
    backend = resolve("sliding_attention", ctx, toggles).backend
    if toggles.debug_hooks or backend.fn_with_local is None:
        o: torch.Tensor = resolve_fn("sliding_attention", ctx, toggles)(*args, **kwargs)
        return o, None
    o, local = backend.fn_with_local(*args, sel_block=sel_block, **kwargs)
    return o, local


class _FanOut(torch.autograd.Function):
    """Three views of x for the three branches; backward: their gradients summed in one pass by
    ``sum3`` (a backend's ``fn_sum3``) where all three arrive, else added by torch."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, sum3: Callable[..., torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ctx.sum3 = sum3
        return x.view_as(x), x.view_as(x), x.view_as(x)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, None]:
        present = [g for g in grads if g is not None]
        if not present:
            return None, None
        if len(present) == 3 and not torch.is_grad_enabled():
            return ctx.sum3(*present), None
        total = present[0]
        for g in present[1:]:
            total = total + g
        return total, None


def fan_out(
    q: torch.Tensor, gates: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, T, HQ, dk] for the compressed, selected and sliding branches: (q_cmp, q_slc, q_win).

    Where q takes a gradient, NSA_COMBINE_GRAD_SUM is on (the default) and the backend the
    registry picks for ``gated_combine`` (for gates [B, T, HQ, 3]) has an ``fn_sum3``, three
    views of q whose gradients that backend sums in one pass (three reads and one write of q's
    size, against two reads and a write per autograd add: about 1.2 ms of a 111 ms
    forward+backward at T = 64k on an H100). The price is memory: the three gradients are alive
    together until the last arrives, one q-sized tensor more at the backward's peak than
    autograd's running sum (15,559 -> 16,551 MiB at 64k; docs/results/2026-11-26-h100-layer-8.md);
    NSA_COMBINE_GRAD_SUM=0 gives it back. A higher-order backward (a graph through the
    gradients) adds them with torch. Otherwise (q, q, q), at no cost.
    """
    if not (torch.is_grad_enabled() and q.requires_grad):
        return q, q, q
    toggles = get_toggles()
    if not toggles.combine_grad_sum:
        return q, q, q
    sum3 = resolve_fn_sum3(check_gated_combine(q, q, q, gates), toggles)
    if sum3 is None:
        return q, q, q
    views: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = _FanOut.apply(  # type: ignore[no-untyped-call]
        q, functools.partial(sum3, toggles=toggles)
    )
    return views
