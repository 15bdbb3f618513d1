"""The public ops of one NSA layer: validate once, ask the registry, run the chosen backend.

Each op has the shapes of docs/spec.md (``q [B, T, HQ, dk]``, ``k [B, T, H, dk]``,
``v [B, T, H, dv]``, ``block_indices [B, T, H, n]``). It checks every argument with the op's
validator in :mod:`nsa_core.checks`, builds the :class:`~nsa_core.registry.OpContext` of the call,
resolves the backend (:func:`nsa_core.registry.resolve_fn`, the same decision that
``routing_report`` shows, wrapped in the debug hooks when NSA_DEBUG_SHAPES/TIMING/COMPARE is on)
and hands it the validated arguments and the toggles the decision was
made with. On a CPU, in float64, or with ``NSA_<STEP>_BACKEND=reference`` the backend is the
reference in :mod:`nsa_core.reference`, which stays callable by name everywhere.
"""

from __future__ import annotations

import torch

from nsa_core.checks import (
    check_compressed_attention,
    check_gated_combine,
    check_select_blocks,
    check_selected_attention,
    check_sliding_attention,
)
from nsa_core.registry import OpContext, resolve_fn, resolve_fn_with_lse
from nsa_core.toggles import Toggles, get_toggles


def op_context(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_len: int,
    *,
    varlen: bool,
) -> OpContext:
    """The routing context of one call: q [B, Tq, HQ, dk], k [B, *, H, dk], v [B, *, H, dv]."""
    return OpContext(
        device=q.device,
        dtype=q.dtype,
        seq_len=seq_len,
        num_q_heads=q.shape[2],
        num_kv_heads=k.shape[2],
        head_dim_qk=q.shape[3],
        head_dim_v=v.shape[3],
        requires_grad=torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)),
        varlen=varlen,
    )


def _compressed_route(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    cmp_block: int,
    cmp_stride: int,
    scale: float | None,
    q_start: int,
    cu_seqlens: torch.Tensor | None,
) -> tuple[Toggles, OpContext]:
    """Validate a compressed_attention call (q [B, Tq, HQ, dk], k_cmp [B, N, H, dk], v_cmp
    [B, N, H, dv]); the toggles and the routing context its backend is chosen by."""
    check_compressed_attention(
        q, k_cmp, v_cmp, cmp_block, cmp_stride, scale, q_start=q_start, cu_seqlens=cu_seqlens
    )
    toggles = get_toggles()
    return toggles, op_context(q, k_cmp, v_cmp, q_start + q.shape[1], varlen=cu_seqlens is not None)


def compressed_attention(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    cmp_block: int,
    cmp_stride: int,
    scale: float | None = None,
    *,
    q_start: int = 0,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """o_cmp [B, Tq, HQ, dv]: each query over the compressed blocks that end at or before it.

    q [B, Tq, HQ, dk] (row r at position ``q_start + r``), k_cmp [B, N, H, dk], v_cmp
    [B, N, H, dv]; block i covers tokens [i*d, i*d + l). Rows that see no block give 0. See
    :func:`nsa_core.reference.compressed_attention` for every argument.
    """
    toggles, ctx = _compressed_route(
        q, k_cmp, v_cmp, cmp_block, cmp_stride, scale, q_start, cu_seqlens
    )
    fn = resolve_fn("compressed_attention", ctx, toggles)
    args = (q, k_cmp, v_cmp, cmp_block, cmp_stride, scale)
    out: torch.Tensor = fn(*args, q_start=q_start, cu_seqlens=cu_seqlens, toggles=toggles)
    return out


def compressed_attention_with_lse(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    cmp_block: int,
    cmp_stride: int,
    scale: float | None = None,
    *,
    q_start: int = 0,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`compressed_attention` and, where its backend produces one, its log-sum-exp.

    Returns:
        o_cmp [B, Tq, HQ, dv], exactly what :func:`compressed_attention` returns, and lse
        [B, Tq, HQ] float32 (natural log of the softmax normaliser over the visible blocks,
        ``log sum_i exp(scale * q . k_cmp[i])``, -inf on rows that see none), detached; or
        None when the chosen backend has no ``fn_with_lse`` (or a debug hook is on). Meant for
        :func:`select_blocks`'s ``lse``, with the same q, k_cmp, scale, q_start and cu_seqlens.
    """
    toggles, ctx = _compressed_route(
        q, k_cmp, v_cmp, cmp_block, cmp_stride, scale, q_start, cu_seqlens
    )
    fn_with_lse = resolve_fn_with_lse("compressed_attention", ctx, toggles)
    args = (q, k_cmp, v_cmp, cmp_block, cmp_stride, scale)
    if fn_with_lse is None:
        fn = resolve_fn("compressed_attention", ctx, toggles)
        out: torch.Tensor = fn(*args, q_start=q_start, cu_seqlens=cu_seqlens, toggles=toggles)
        return out, None
    o, lse = fn_with_lse(*args, q_start=q_start, cu_seqlens=cu_seqlens, toggles=toggles)
    return o, None if lse is None else lse.detach()


def selected_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_indices: torch.Tensor,
    sel_block: int,
    scale: float | None = None,
    *,
    q_start: int = 0,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """o_slc [B, Tq, HQ, dv]: each query over the union of its selected blocks, causally.

    q [B, Tq, HQ, dk], k [B, Tk, H, dk], v [B, Tk, H, dv], block_indices [B, Tq, H, n] in
    [-1, ceil(Tk / l')). On CUDA the index range is not read back (a device sync) unless
    NSA_SEL_CHECK_INDICES is set: kernels treat out-of-range entries as -1. See
    :func:`nsa_core.reference.selected_attention` for every argument.
    """
    toggles = get_toggles()
    check_selected_attention(
        q,
        k,
        v,
        block_indices,
        sel_block,
        scale,
        q_start=q_start,
        cu_seqlens=cu_seqlens,
        check_range=not isinstance(q, torch.Tensor)
        or q.device.type == "cpu"
        or toggles.sel_check_indices,
    )
    ctx = op_context(q, k, v, k.shape[1], varlen=cu_seqlens is not None)
    fn = resolve_fn("selected_attention", ctx, toggles)
    args = (q, k, v, block_indices, sel_block, scale)
    out: torch.Tensor = fn(*args, q_start=q_start, cu_seqlens=cu_seqlens, toggles=toggles)
    return out


def sliding_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    scale: float | None = None,
    *,
    q_start: int = 0,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """o_win [B, Tq, HQ, dv]: the query at t over tokens [max(0, t - w + 1), t].

    q [B, Tq, HQ, dk], k [B, Tk, H, dk], v [B, Tk, H, dv]. See
    :func:`nsa_core.reference.sliding_attention` for every argument.
    """
    check_sliding_attention(q, k, v, window, scale, q_start=q_start, cu_seqlens=cu_seqlens)
    toggles = get_toggles()
    ctx = op_context(q, k, v, k.shape[1], varlen=cu_seqlens is not None)
    fn = resolve_fn("sliding_attention", ctx, toggles)
    out: torch.Tensor = fn(
        q, k, v, window, scale, q_start=q_start, cu_seqlens=cu_seqlens, toggles=toggles
    )
    return out


def select_blocks(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    cmp_block: int,
    cmp_stride: int,
    sel_block: int,
    num_selected: int,
    scale: float | None = None,
    *,
    q_start: int = 0,
    cu_seqlens: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block scoring and top-n: indices [B, Tq, H, n] int32 ascending, -1 padded; counts [B, Tq, H].

    q [B, Tq, HQ, dk], k_cmp [B, N, H, dk]. Selection takes no gradient: q, k_cmp and lse are
    read detached. See :func:`nsa_core.reference.select_blocks` for every argument and
    docs/spec.md for the index contract GPU backends keep.

    ``lse`` (optional) is the compressed branch's normaliser for the same q, k_cmp, scale,
    q_start and cu_seqlens: float32 [B, Tq, HQ], natural log, -inf on rows that see no block
    (what :func:`compressed_attention_with_lse` returns). A backend that can use it skips its
    own normaliser pass; the others, the reference included, ignore it and compute their own.
    """
    check_select_blocks(
        q,
        k_cmp,
        cmp_block,
        cmp_stride,
        sel_block,
        num_selected,
        scale,
        q_start=q_start,
        cu_seqlens=cu_seqlens,
        lse=lse,
    )
    toggles = get_toggles()
    q, k_cmp = q.detach(), k_cmp.detach()
    ctx = op_context(q, k_cmp, k_cmp, q_start + q.shape[1], varlen=cu_seqlens is not None)
    fn = resolve_fn("select_blocks", ctx, toggles)
    # Only a given lse is passed on: a backend registered before the keyword existed still serves.
    extra = {} if lse is None else {"lse": lse.detach()}
    indices, counts = fn(
        q,
        k_cmp,
        cmp_block,
        cmp_stride,
        sel_block,
        num_selected,
        scale,
        q_start=q_start,
        cu_seqlens=cu_seqlens,
        toggles=toggles,
        **extra,
    )
    return indices, counts


def gated_combine(
    o_cmp: torch.Tensor, o_slc: torch.Tensor, o_win: torch.Tensor, gates: torch.Tensor
) -> torch.Tensor:
    """o [B, T, HQ, dv] = g[..., 0] * o_cmp + g[..., 1] * o_slc + g[..., 2] * o_win.

    o_cmp, o_slc, o_win [B, T, HQ, dv] alike, gates [B, T, HQ, 3] (cmp, slc, win) of their dtype
    and device; differentiable in all four. See :func:`nsa_core.reference.gated_combine`.
    """
    check_gated_combine(o_cmp, o_slc, o_win, gates)
    toggles = get_toggles()
    # The combine has no kv heads and one head dim: its context says H = HQ and dk = dv.
    ctx = OpContext(
        device=o_cmp.device,
        dtype=o_cmp.dtype,
        seq_len=o_cmp.shape[1],
        num_q_heads=o_cmp.shape[2],
        num_kv_heads=o_cmp.shape[2],
        head_dim_qk=o_cmp.shape[3],
        head_dim_v=o_cmp.shape[3],
        requires_grad=torch.is_grad_enabled()
        and any(t.requires_grad for t in (o_cmp, o_slc, o_win, gates)),
        varlen=False,
    )
    fn = resolve_fn("gated_combine", ctx, toggles)
    out: torch.Tensor = fn(o_cmp, o_slc, o_win, gates, toggles=toggles)
    return out
