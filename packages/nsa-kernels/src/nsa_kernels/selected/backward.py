# Triton kernels take untyped pointer/scalar parameters (types come from the launch), and
# triton.jit is untyped without triton installed: mypy checks only the plain Python here.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""The selected branch's backward: its kernels and their launch, :func:`backward`.

- ``sel_bwd_dq_kernel``: the forward's walk (:mod:`nsa_kernels.selected.row_walk`), recomputing
  p from lse; writes dq and delta = rowsum(o * do).
- ``sel_bwd_dkv_kernel``: one program per work segment of one (key block, kv head): a slice of the
  queries that selected the block (the CSR of :mod:`nsa_kernels.selected.csr`), gathered TPI
  tokens x G heads at a time.
- ``sel_dkv_reduce_kernel``: sums the fp32 partials of blocks split over several segments, in a
  fixed order, so gradients are bitwise reproducible (no atomics anywhere).
"""

# No `from __future__ import annotations`: the triton 3.0/3.1 interpreter reads a string
# annotation as a runtime argument, so `B: tl.constexpr` would stop being a constant.
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from nsa_core.tracing import traced
from nsa_kernels.common.finite_flag import finite_path_launches
from nsa_kernels.common.key_rows import store_key_grads
from nsa_kernels.common.tile_config import pow2
from nsa_kernels.common.traced_launch import launch
from nsa_kernels.selected import csr as block_csr
from nsa_kernels.selected.forward import kv_descriptor
from nsa_kernels.selected.launch import (
    Launch,
    SelConfig,
    dot_precision,
    kv_hint,
    num_sms,
    path_launches,
    strided_grid,
    values_fit_tma,
    varlen_args,
)
from nsa_kernels.selected.row_walk import (
    LOG2E,
    LOG2E_CONST,
    query_row,
    selected_tile,
    walk_steps,
)


@triton.jit
def _sel_bwd_dq_rows(
    blk,
    q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, idx_ptr, seq_ptr, cu_ptr,
    finite_ptr, k_desc, v_desc,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh,
    stride_db, stride_dt, stride_dh,
    stride_lb, stride_lt,
    stride_ib, stride_it, stride_ih,
    n_rows, tq, tk, q_start, nsel, qk_scale, scale,
    G: tl.constexpr, HPP: tl.constexpr, BG: tl.constexpr,
    DK: tl.constexpr, BK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
    SEL: tl.constexpr, BL: tl.constexpr, NSUB: tl.constexpr, NP: tl.constexpr,
    RPP: tl.constexpr,
    KV_HINT: tl.constexpr, VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, KV_TMA: tl.constexpr,
):  # fmt: skip
    """The body of :func:`sel_bwd_dq_kernel` for the rows of row block ``blk``."""
    # RPP consecutive rows per program: rows of one query block share their forced blocks
    # (0, jt-1, jt), which the second row then finds in L1.
    for rr in range(RPP):
        b, r, t, tok0, h, heads, g_mask, idx_row = query_row(
            blk, rr, n_rows, tq, q_start, seq_ptr, cu_ptr, idx_ptr, stride_ib, stride_it, stride_ih,
            G=G, HPP=HPP, BG=BG, RPP=RPP, VARLEN=VARLEN,
        )  # fmt: skip
        offs_k = tl.arange(0, BK)
        k_mask = offs_k < DK
        offs_v = tl.arange(0, BV)
        v_mask = offs_v < DV

        q_rows = (
            q_ptr + b * stride_qb + r * stride_qt + heads[:, None] * stride_qh + offs_k[None, :]
        )
        q = tl.load(q_rows, mask=g_mask[:, None] & k_mask[None, :], other=0.0)
        o_rows = b * stride_ob + r * stride_ot + heads[:, None] * stride_oh + offs_v[None, :]
        ov_mask = g_mask[:, None] & v_mask[None, :]
        do = tl.load(do_ptr + o_rows, mask=ov_mask, other=0.0)
        o = tl.load(o_ptr + o_rows, mask=ov_mask, other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
        stat = b * stride_lb + r * stride_lt + heads
        tl.store(delta_ptr + stat, delta, mask=g_mask)
        lse = tl.load(lse_ptr + stat, mask=g_mask, other=0.0)
        # Rows that saw nothing (lse = -inf) have no visible key below; keep the arithmetic finite.
        lse2 = tl.where(lse > float("-inf"), lse * LOG2E_CONST, 0.0)

        k_head = k_ptr + b * stride_kb + tok0 * stride_kt + h * stride_kh
        v_head = v_ptr + b * stride_vb + tok0 * stride_vt + h * stride_vh

        dq = tl.zeros([BG, BK], dtype=tl.float32)
        # Tiles that hold no key the row sees end the walk: left out (walk_steps).
        for it in range(walk_steps(idx_row, nsel, t, SEL=SEL, BL=BL, NSUB=NSUB, NP=NP)):
            pos, live, first = selected_tile(idx_row, it, t, SEL=SEL, BL=BL, NSUB=NSUB)
            if KV_TMA:
                kv_row = (b * tk + tok0 + first).to(tl.int32)
                kt = k_desc.load([kv_row, (h * DK).to(tl.int32)])
                vt = v_desc.load([kv_row, (h * DV).to(tl.int32)])
            else:
                pos64 = pos.to(tl.int64)
                kt = tl.load(
                    k_head + pos64[:, None] * stride_kt + offs_k[None, :],
                    mask=live[:, None] & k_mask[None, :],
                    other=0.0,
                    eviction_policy=KV_HINT,
                )
                vt = tl.load(
                    v_head + pos64[:, None] * stride_vt + offs_v[None, :],
                    mask=live[:, None] & v_mask[None, :],
                    other=0.0,
                    eviction_policy=KV_HINT,
                )
            s = tl.dot(q, tl.trans(kt), input_precision=DOT_PREC) * qk_scale
            p = tl.where(live[None, :], tl.exp2(s - lse2[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(vt), input_precision=DOT_PREC)
            ds = p * (dp - delta[:, None])
            dq = tl.dot(ds.to(kt.dtype), kt, dq, input_precision=DOT_PREC)

        tl.store(
            dq_ptr + b * stride_qb + r * stride_qt + heads[:, None] * stride_qh + offs_k[None, :],
            (dq * scale).to(dq_ptr.dtype.element_ty),
            mask=g_mask[:, None] & k_mask[None, :],
        )


@triton.jit
def sel_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, idx_ptr, seq_ptr, cu_ptr,
    finite_ptr, k_desc, v_desc,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh,
    stride_db, stride_dt, stride_dh,
    stride_lb, stride_lt,
    stride_ib, stride_it, stride_ih,
    n_rows, tq, tk, q_start, nsel, qk_scale, scale,
    G: tl.constexpr, HPP: tl.constexpr, BG: tl.constexpr,
    DK: tl.constexpr, BK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
    SEL: tl.constexpr, BL: tl.constexpr, NSUB: tl.constexpr, NP: tl.constexpr,
    RPP: tl.constexpr,
    KV_HINT: tl.constexpr, VARLEN: tl.constexpr, DOT_PREC: tl.constexpr, KV_TMA: tl.constexpr,
    STRIDED: tl.constexpr,
):  # fmt: skip
    """dq [BG, BK] and delta [BG] of one query row for HPP heads of one kv head's group.

    q, dq [B, Tq, HQ, dk], k [B, Tk, H, dk], v [B, Tk, H, dv], o, do [B, Tq, HQ, dv],
    lse, delta [B, Tq, HQ], idx [B, Tq, H, n]. ``q``/``dq`` share strides, as do ``o``/``do``,
    and ``lse``/``delta``. Grid: (ceil(rows / RPP), H * NCH).

    KV_TMA (BK == DK, BV == DV): K and V tiles come whole through tensor descriptors over k and v
    viewed as [B * Tk, H * d], keys the row cannot see included: they meet p = 0 in ds and dq,
    exact only where every key and value is finite. So the call launches the kernel twice, KV_TMA
    and not, and finite [1] int32 (nonzero: every element of k and v is finite) picks the launch
    that works; the other one's programs return at once. A call without TMA launches it once,
    with masked pointer loads and a zero flag. STRIDED: as in sel_fwd_kernel, the launch
    without KV_TMA beside one with it strides a few programs per SM over the row blocks.
    """
    if (tl.load(finite_ptr) != 0) != KV_TMA:
        return
    if STRIDED:
        num_blocks = tl.cdiv(n_rows, RPP)
        for blk in range(tl.program_id(0), num_blocks, tl.num_programs(0)):
            _sel_bwd_dq_rows(
                blk, q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, idx_ptr,
                seq_ptr, cu_ptr, finite_ptr, k_desc, v_desc, stride_qb, stride_qt, stride_qh,
                stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_ob,
                stride_ot, stride_oh, stride_db, stride_dt, stride_dh, stride_lb, stride_lt,
                stride_ib, stride_it, stride_ih, n_rows, tq, tk, q_start, nsel, qk_scale, scale,
                G, HPP, BG, DK, BK, DV, BV, SEL, BL, NSUB, NP, RPP, KV_HINT, VARLEN, DOT_PREC,
                KV_TMA,
            )  # fmt: skip
    else:
        _sel_bwd_dq_rows(
            tl.program_id(0), q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
            idx_ptr, seq_ptr, cu_ptr, finite_ptr, k_desc, v_desc, stride_qb, stride_qt,
            stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            stride_ob, stride_ot, stride_oh, stride_db, stride_dt, stride_dh, stride_lb,
            stride_lt, stride_ib, stride_it, stride_ih, n_rows, tq, tk, q_start, nsel, qk_scale,
            scale, G, HPP, BG, DK, BK, DV, BV, SEL, BL, NSUB, NP, RPP, KV_HINT, VARLEN, DOT_PREC,
            KV_TMA,
        )  # fmt: skip


@triton.jit
def block_entry(table_ptr, FIELDS: tl.constexpr, SEL: tl.constexpr, BL: tl.constexpr):
    """(entry, b, h, in_blk [BL], krow [BL], kvalid [BL]) of the program's key sub-tile.

    Entry ``program_id(0)`` of an int64 table of FIELDS columns whose first four are b, h, the
    k row of the block's first key and the end of its sequence's rows (the segments and the
    reductions of csr.py both start so); sub-tile ``program_id(1)`` of the block: its offsets
    in the block, its rows of k's T axis and which of them hold keys.
    """
    entry = table_ptr + tl.program_id(0).to(tl.int64) * FIELDS
    b = tl.load(entry + 0)
    h = tl.load(entry + 1)
    krow0 = tl.load(entry + 2)
    kend = tl.load(entry + 3)
    in_blk = tl.program_id(1) * BL + tl.arange(0, BL)
    krow = krow0 + in_blk
    kvalid = (in_blk < SEL) & (krow < kend)
    return entry, b, h, in_blk, krow, kvalid


@triton.jit
def sel_bwd_dkv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, dk_part_ptr, dv_part_ptr,
    seg_ptr, csr_ptr,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lt,
    qk_scale, scale,
    G: tl.constexpr, R: tl.constexpr, TPI: tl.constexpr,
    DK: tl.constexpr, BK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
    SEL: tl.constexpr, BL: tl.constexpr, SELP: tl.constexpr, SEG_FIELDS: tl.constexpr,
    DOT_PREC: tl.constexpr,
):  # fmt: skip
    """dk, dv [BL, *] of key sub-tile ``program_id(1)`` of one segment's block.

    q [B, Tq, HQ, dk], k, dk [B, Tk, H, dk], v, dv [B, Tk, H, dv], do [B, Tq, HQ, dv],
    lse, delta [B, Tq, HQ]; ``k``/``dk`` share strides, as do ``v``/``dv``.
    A segment is a slice ``[start, end)`` of the CSR rows of one (batch, kv head, key block); its
    query rows are processed TPI at a time as R = TPI * G (padded) rows of one ``tl.dot``. ``dk``
    go to k's and v's layout, or, when the block is split over several segments, to the fp32
    partials ``dk_part [P, SELP, BK]`` / ``dv_part [P, SELP, BV]`` at row ``part``.
    """
    seg, b, h, in_blk, krow, kvalid = block_entry(seg_ptr, FIELDS=SEG_FIELDS, SEL=SEL, BL=BL)
    pos0 = tl.load(seg + 4)
    start = tl.load(seg + 5)
    end = tl.load(seg + 6)
    part = tl.load(seg + 7)
    tshift = tl.load(seg + 8)
    kpos = pos0 + in_blk
    offs_k = tl.arange(0, BK)
    k_mask = offs_k < DK
    offs_v = tl.arange(0, BV)
    v_mask = offs_v < DV
    kt = tl.load(
        k_ptr + b * stride_kb + krow[:, None] * stride_kt + h * stride_kh + offs_k[None, :],
        mask=kvalid[:, None] & k_mask[None, :],
        other=0.0,
    )
    vt = tl.load(
        v_ptr + b * stride_vb + krow[:, None] * stride_vt + h * stride_vh + offs_v[None, :],
        mask=kvalid[:, None] & v_mask[None, :],
        other=0.0,
    )

    rr = tl.arange(0, R)
    tok = rr // G
    heads = h * G + (rr - tok * G)
    dk = tl.zeros([BL, BK], dtype=tl.float32)
    dv = tl.zeros([BL, BV], dtype=tl.float32)
    for base in range(start, end, TPI):
        slot = base + tok
        rvalid = (tok < TPI) & (slot < end)
        qrow = tl.load(csr_ptr + slot, mask=rvalid, other=0).to(tl.int64)
        t = qrow + tshift
        q_off = b * stride_qb + qrow * stride_qt + heads * stride_qh
        qt = tl.load(
            q_ptr + q_off[:, None] + offs_k[None, :],
            mask=rvalid[:, None] & k_mask[None, :],
            other=0.0,
        )
        o_off = b * stride_ob + qrow * stride_ot + heads * stride_oh
        dot_ = tl.load(
            do_ptr + o_off[:, None] + offs_v[None, :],
            mask=rvalid[:, None] & v_mask[None, :],
            other=0.0,
        )
        stat = b * stride_lb + qrow * stride_lt + heads
        lse2 = tl.load(lse_ptr + stat, mask=rvalid, other=0.0) * LOG2E_CONST
        delta = tl.load(delta_ptr + stat, mask=rvalid, other=0.0)

        st = tl.dot(kt, tl.trans(qt), input_precision=DOT_PREC) * qk_scale
        vis = kvalid[:, None] & rvalid[None, :] & (kpos[:, None] <= t[None, :])
        pt = tl.where(vis, tl.exp2(st - lse2[None, :]), 0.0)
        dv = tl.dot(pt.to(dot_.dtype), dot_, dv, input_precision=DOT_PREC)
        dpt = tl.dot(vt, tl.trans(dot_), input_precision=DOT_PREC)
        dst = pt * (dpt - delta[None, :])
        dk = tl.dot(dst.to(qt.dtype), qt, dk, input_precision=DOT_PREC)
    dk = dk * scale

    if part < 0:
        store_key_grads(
            dk_ptr, dv_ptr, dk, dv, b, h, krow, kvalid,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            DK=DK, BK=BK, DV=DV, BV=BV,
        )  # fmt: skip
    else:
        tl.store(
            dk_part_ptr + (part * SELP + in_blk)[:, None] * BK + offs_k[None, :],
            dk,
            mask=(in_blk < SEL)[:, None],
        )
        tl.store(
            dv_part_ptr + (part * SELP + in_blk)[:, None] * BV + offs_v[None, :],
            dv,
            mask=(in_blk < SEL)[:, None],
        )


@triton.jit
def sel_dkv_reduce_kernel(
    dk_ptr, dv_ptr, dk_part_ptr, dv_part_ptr, red_ptr,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    DK: tl.constexpr, BK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
    SEL: tl.constexpr, BL: tl.constexpr, SELP: tl.constexpr, RED_FIELDS: tl.constexpr,
):  # fmt: skip
    """Sum, in part order, the fp32 partials ``dk_part [P, SELP, BK]``, ``dv_part [P, SELP, BV]``
    of one block split over several segments into dk [B, Tk, H, dk] and dv [B, Tk, H, dv]."""
    red, b, h, in_blk, krow, kvalid = block_entry(red_ptr, FIELDS=RED_FIELDS, SEL=SEL, BL=BL)
    first = tl.load(red + 4)
    count = tl.load(red + 5)
    offs_k = tl.arange(0, BK)
    offs_v = tl.arange(0, BV)
    dk = tl.zeros([BL, BK], dtype=tl.float32)
    dv = tl.zeros([BL, BV], dtype=tl.float32)
    for part in range(first, first + count):
        rows = part * SELP + in_blk
        dk += tl.load(
            dk_part_ptr + rows[:, None] * BK + offs_k[None, :], mask=kvalid[:, None], other=0.0
        )
        dv += tl.load(
            dv_part_ptr + rows[:, None] * BV + offs_v[None, :], mask=kvalid[:, None], other=0.0
        )
    store_key_grads(
        dk_ptr, dv_ptr, dk, dv, b, h, krow, kvalid,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        DK=DK, BK=BK, DV=DV, BV=BV,
    )  # fmt: skip


def backward(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, idx: Tensor, info: Launch
) -> tuple[Tensor, Tensor, Tensor]:
    """dq [B, Tq, HQ, dk], dk [B, Tk, H, dk], dv [B, Tk, H, dv] for the upstream gradient
    ``do [B, Tq, HQ, dv]``, from the forward's o and lse and its index rows as sets ``idx``.

    A traced call records the whole backward as one custom op, ``nsa::selected_backward``: its
    reverse index waits for its sizes on the host, which a graph cannot hold, and inside one op
    that wait still overlaps the dq launch as it does in eager code."""
    if traced(do, q, idx):
        grads: tuple[Tensor, Tensor, Tensor] = torch.ops.nsa.selected_backward(
            do, q, k, v, o, lse, idx, info.seq_ids, info.cu_seqlens, _launch_ints(info),
            info.scale, info.cfg.describe(),
        )  # fmt: skip
        return grads
    sel_block, cfg = info.sel_block, info.cfg
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    if info.rows == 0 or info.n == 0:
        return torch.zeros_like(q), dk, dv
    # The dq kernel writes every row and head: no fill, which would cost a pass of q's size.
    dq = torch.empty_like(q)
    do = do.contiguous()
    o = o.contiguous()
    seq_ids, cu = varlen_args(info, q.device)
    prec = dot_precision(q.dtype)
    bk = pow2(max(info.dk, 16))
    bv = pow2(max(info.dv, 16))
    nsub = -(-sel_block // cfg.block_l)
    hpp = cfg.heads_per_prog
    nch = -(-info.group // hpp)
    delta = torch.empty_like(lse)
    # K and V through TMA where the forward takes TMA K loads and dv fits one tile too: two
    # launches, one per kind of keys and values (see sel_bwd_dq_kernel).
    kv_tma = cfg.tma == 1 and info.dk == bk and values_fit_tma(bv, info)
    k_desc: Any = kv_descriptor(k, cfg.block_l) if kv_tma else k
    v_desc: Any = kv_descriptor(v, cfg.block_l) if kv_tma else v
    finite, _ = finite_path_launches(kv_tma, k, v)
    # The reverse index first, the dq launch next, then the one wait for the index's sizes: the
    # host plans the dk/dv work while dq runs, and the GPU does not idle on that wait.
    reverse = block_csr.start_block_csr(
        idx, sel_block, k.shape[1], q_start=info.q_start, cu_seqlens=info.cu_seqlens,
        rows_are_sets=True,
    )  # fmt: skip
    grid = (-(-info.rows // cfg.rows_per_prog), info.h * nch)
    for kv_path, strided in path_launches(kv_tma):
        launch(
            sel_bwd_dq_kernel, strided_grid(grid, q.device) if strided else grid,
            q, k, v, o, do, lse, delta, dq, idx, seq_ids, cu, finite, k_desc, v_desc,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            o.stride(0), o.stride(1), o.stride(2),
            dq.stride(0), dq.stride(1), dq.stride(2),
            lse.stride(0), lse.stride(1),
            idx.stride(0), idx.stride(1), idx.stride(2),
            info.rows, info.tq, k.shape[1], info.q_start, info.n, info.scale * LOG2E, info.scale,
            G=info.group, HPP=hpp, BG=max(16, pow2(hpp)),
            DK=info.dk, BK=bk, DV=info.dv, BV=bv,
            SEL=sel_block, BL=cfg.block_l, NSUB=nsub, NP=pow2(info.n),
            RPP=cfg.rows_per_prog, KV_HINT=kv_hint(cfg),
            VARLEN=info.seq_ids is not None, DOT_PREC=prec, KV_TMA=kv_path, STRIDED=strided,
            num_warps=cfg.dq_warps, num_stages=cfg.dq_stages, writes=(delta, dq),
        )  # fmt: skip
    dkv_backward(
        q, k, v, do, lse, delta, dk, dv, reverse.finish(), sel_block, info.scale, cfg, prec
    )
    return dq, dk, dv


# The int facts of a Launch, in the order nsa::selected_backward passes them.
_LAUNCH_INTS = ("sel_block", "batch", "tq", "hq", "h", "dk", "dv", "group", "n", "num_blocks",
                "q_start")  # fmt: skip


def _launch_ints(info: Launch) -> list[int]:
    return [getattr(info, name) for name in _LAUNCH_INTS]


@torch.library.custom_op("nsa::selected_backward", mutates_args=())
def selected_backward(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, idx: Tensor,
    seq_ids: Tensor | None, cu_seqlens: Tensor | None, ints: list[int], scale: float, cfg: str,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """:func:`backward` for traced calls: the call's :class:`Launch` crosses as its ints (in
    ``_LAUNCH_INTS`` order), its scale, its resolved :class:`SelConfig` as text and its varlen
    tensors."""
    facts = dict(zip(_LAUNCH_INTS, ints, strict=True))
    info = Launch(
        cfg=SelConfig.parse(cfg), scale=scale, seq_ids=seq_ids, cu_seqlens=cu_seqlens, **facts
    )
    return backward(do, q, k, v, o, lse, idx, info)


@selected_backward.register_fake
def _(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, idx: Tensor,
    seq_ids: Tensor | None, cu_seqlens: Tensor | None, ints: list[int], scale: float, cfg: str,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def dkv_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    csr: block_csr.BlockCSR,
    sel_block: int,
    scale: float,
    cfg: SelConfig,
    prec: str,
) -> None:
    """Write dk [B, Tk, H, dk] and dv [B, Tk, H, dv] (zero-filled by the caller) from the CSR."""
    group = q.shape[2] // k.shape[2]
    num_pairs = int(csr.rows.numel())
    if num_pairs == 0:
        return
    seg_tokens = cfg.segment_tokens or block_csr.default_segment_tokens(
        num_pairs, num_sms(q.device)
    )
    work = block_csr.build_dkv_work(csr, seg_tokens)
    bk = pow2(max(k.shape[3], 16))
    bv = pow2(max(v.shape[3], 16))
    nsub = -(-sel_block // cfg.block_l)
    selp = nsub * cfg.block_l
    parts = max(work.num_parts, 1)
    dk_part = torch.empty(parts, selp, bk, dtype=torch.float32, device=q.device)
    dv_part = torch.empty(parts, selp, bv, dtype=torch.float32, device=q.device)
    rows = cfg.dkv_rows
    sel_bwd_dkv_kernel[(work.segments.shape[0], nsub)](
        q, k, v, do, lse, delta, dk, dv, dk_part, dv_part, work.segments, csr.rows,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        do.stride(0), do.stride(1), do.stride(2),
        lse.stride(0), lse.stride(1),
        scale * LOG2E, scale,
        G=group, R=rows, TPI=rows // group,
        DK=k.shape[3], BK=bk, DV=v.shape[3], BV=bv,
        SEL=sel_block, BL=cfg.block_l, SELP=selp, SEG_FIELDS=block_csr.SEG_FIELDS,
        DOT_PREC=prec, num_warps=cfg.dkv_warps, num_stages=cfg.dkv_stages,
    )  # fmt: skip
    if work.reductions.shape[0]:
        sel_dkv_reduce_kernel[(work.reductions.shape[0], nsub)](
            dk, dv, dk_part, dv_part, work.reductions,
            dk.stride(0), dk.stride(1), dk.stride(2),
            dv.stride(0), dv.stride(1), dv.stride(2),
            DK=k.shape[3], BK=bk, DV=v.shape[3], BV=bv,
            SEL=sel_block, BL=cfg.block_l, SELP=selp, RED_FIELDS=block_csr.RED_FIELDS,
            num_warps=8,
        )  # fmt: skip
