"""The launches of the interval kernels: the forward (triton_fwd.py) and the backward's dq, dk/dv
and reduction (triton_bwd.py), for the facts of one call (:class:`IntervalLaunch`) and its tiles
(:class:`CmpConfig`).

Both branches launch through here: the compressed one, and the sliding one with l = d = 1 and a
window (``info.window``). No launch reads a device value on the host: a packed call's tiles come
from tables built on the device (:mod:`nsa_kernels.compressed.tiles`).
"""

from __future__ import annotations

from typing import Any

import torch

from nsa_kernels.common.finite_flag import finite_path_launches
from nsa_kernels.common.forward_outputs import forward_outputs, no_visible_keys
from nsa_kernels.common.interval_launch import IntervalLaunch, row_tiles
from nsa_kernels.common.traced_launch import launch
from nsa_kernels.common.triton_inputs import dot_precision, num_sms
from nsa_kernels.compressed.config import CmpConfig
from nsa_kernels.compressed.tiles import key_tiles, query_tiles, segment_rows, varlen_args
from nsa_kernels.compressed.triton_bwd import (
    cmp_bwd_dkv_kernel,
    cmp_bwd_dq_kernel,
    cmp_dkv_reduce_kernel,
)
from nsa_kernels.compressed.triton_fwd import LOG2E, cmp_fwd_kernel


def _strides(*tensors: torch.Tensor, dims: int = 3) -> list[int]:
    """The first ``dims`` strides of each tensor in turn, as the kernels take them (batch,
    token, head: the last dim is contiguous)."""
    return [stride for t in tensors for stride in t.stride()[:dims]]


def _geometry(info: IntervalLaunch) -> dict[str, Any]:
    """The constexprs every kernel takes from the call: head dims and their tiles, l and d,
    packed or not, windowed or not."""
    return dict(
        DK=info.dk, BK=info.bk, DV=info.dv, BV=info.bv, LBLK=info.cmp_block,
        DSTR=info.cmp_stride, VARLEN=info.cu_seqlens is not None, WINDOWED=info.windowed,
    )  # fmt: skip


def forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, info: IntervalLaunch, cfg: CmpConfig, *,
    into: tuple[torch.Tensor, torch.Tensor] | None = None,
    unless_finite: torch.Tensor | None = None,
    local: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(o [B, Tq, HQ, dv] in q's dtype, lse [B, Tq, HQ] float32) of the forward kernel for
    contiguous q [B, Tq, HQ, dk], k [B, N, H, dk], v [B, N, H, dv], written into ``into`` when
    given.

    ``local`` (with ``info.local_block``, the sliding branch): (o_loc [B, Tq, HQ, dv], lse_loc
    [B, Tq, HQ]) at o's and lse's strides, receive each row's softmax over its forced blocks'
    keys (cmp_fwd_kernel's LOCAL).

    ``unless_finite``: an :func:`nsa_kernels.common.finite_flag.all_finite_flag`; launch the
    containing path alone, gated on it, so that its programs work only where the flagged
    tensors hold a non-finite value and otherwise leave ``into`` as it is (no host sync either
    way).
    """
    o, lse = into or forward_outputs(q, info.batch, info.tq, info.hq, info.dv)
    if (local is None) != (info.local_block == 0):
        raise ValueError("the local softmax's buffers come with info.local_block, and only then")
    if info.tq == 0:
        return o, lse
    if info.num_blocks == 0:
        if local is not None:
            no_visible_keys(*local)
        return no_visible_keys(o, lse)
    loc_o, loc_lse = local or (o, lse)
    if loc_o.stride() != o.stride() or loc_lse.stride() != lse.stride():
        raise ValueError("the local softmax's buffers take o's and lse's strides")
    layout = row_tiles(info.group, cfg.block_m)
    tiles, num_tiles = query_tiles(info, layout.tokens, q.device)
    cu, cmp_cu = varlen_args(info, q.device)
    grid = (num_tiles * info.h * layout.chunks,)
    # Two launches, one of which returns at once: see cmp_fwd_kernel (the finite path does not
    # contain non-finite values).
    finite_paths: tuple[bool, ...]
    if unless_finite is not None:
        finite, finite_paths = unless_finite, (False,)
    else:
        finite, finite_paths = finite_path_launches(True, v)
    for finite_path in finite_paths:
        launch(
            cmp_fwd_kernel, grid,
            q, k, v, o, lse, loc_o, loc_lse, finite, tiles, cu, cmp_cu,
            *_strides(q, k, v, o), *_strides(lse, dims=2),
            info.batch, info.tq, info.q_start, info.h, info.window, info.scale * LOG2E,
            G=info.group, HPP=layout.heads, TPP=layout.tokens, NCH=layout.chunks, BM=cfg.block_m,
            BN=cfg.block_n, CONTAIN=not finite_path, DOT_PREC=dot_precision(q.dtype),
            LOCAL=local is not None, SEL=max(info.local_block, 1), **_geometry(info),
            num_warps=cfg.fwd_warps, num_stages=cfg.fwd_stages, writes=(o, lse, loc_o, loc_lse),
        )  # fmt: skip
    return o, lse


def backward(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
    lse: torch.Tensor, info: IntervalLaunch, cfg: CmpConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """dq, dk, dv (like q, k, v) for the upstream gradient do [B, Tq, HQ, dv], from the
    forward's o and lse (q, k, v and lse contiguous)."""
    if info.tq == 0 or info.num_blocks == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    do = do.contiguous()
    o = o.contiguous()
    delta = torch.empty_like(lse)
    lse2 = torch.empty_like(lse)
    cu, cmp_cu = varlen_args(info, q.device)
    prec = dot_precision(q.dtype)
    geometry = _geometry(info)

    layout = row_tiles(info.group, cfg.dq_block_m)
    tiles, num_tiles = query_tiles(info, layout.tokens, q.device)
    launch(
        cmp_bwd_dq_kernel, (num_tiles * info.h * layout.chunks,),
        q, k, v, o, do, lse, delta, lse2, dq, tiles, cu, cmp_cu,
        *_strides(q, k, v, o), *_strides(lse, dims=2),
        info.batch, info.tq, info.q_start, info.h, info.window, info.scale * LOG2E, info.scale,
        G=info.group, HPP=layout.heads, TPP=layout.tokens, NCH=layout.chunks,
        BM=cfg.dq_block_m, BN=cfg.dq_block_n, DOT_PREC=prec, **geometry,
        num_warps=cfg.dq_warps, num_stages=cfg.dq_stages, writes=(delta, lse2, dq),
    )  # fmt: skip

    bn = cfg.dkv_block_n
    layout = row_tiles(info.group, cfg.dkv_block_m)
    tiles, num_tiles = key_tiles(info, bn, q.device)
    seg = segment_rows(info, cfg, layout.tokens, num_sms(q.device))
    num_segs = max(1, -(-info.tq // seg))
    parts = num_tiles * info.h * num_segs if num_segs > 1 else 1
    dk_part = torch.empty(parts, bn, info.bk, dtype=torch.float32, device=q.device)
    dv_part = torch.empty(parts, bn, info.bv, dtype=torch.float32, device=q.device)
    launch(
        cmp_bwd_dkv_kernel, (num_segs * num_tiles * info.h,),
        q, k, v, do, lse2, delta, dk, dv, dk_part, dv_part, tiles, cu, cmp_cu,
        *_strides(q, k, v, do), *_strides(lse, dims=2),
        info.batch, info.tq, info.q_start, info.num_blocks, info.h, num_tiles, num_segs, seg,
        info.window, info.scale * LOG2E, info.scale,
        G=info.group, HPP=layout.heads, TPQ=layout.tokens, NCH=layout.chunks,
        BMQ=cfg.dkv_block_m, BN=bn, DOT_PREC=prec, **geometry,
        num_warps=cfg.dkv_warps, num_stages=cfg.dkv_stages, writes=(dk, dv, dk_part, dv_part),
    )  # fmt: skip
    if num_segs > 1:
        launch(
            cmp_dkv_reduce_kernel, (num_tiles * info.h,),
            dk, dv, dk_part, dv_part, tiles, cu, cmp_cu, *_strides(k, v),
            info.batch, info.tq, info.q_start, info.num_blocks, info.h, num_segs, seg, info.window,
            BN=bn, **geometry, num_warps=8, writes=(dk, dv),
        )  # fmt: skip
    return dq, dk, dv
