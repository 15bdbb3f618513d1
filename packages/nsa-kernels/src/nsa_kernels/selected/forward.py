# Triton kernels take untyped pointer/scalar parameters (types come from the launch), and
# triton.jit is untyped without triton installed: mypy checks only the plain Python here.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""The selected branch's forward: ``sel_fwd_kernel`` and its launch, :func:`forward`.

One program per (query row, kv head[, head chunk][, dv chunk]) walks the row's selected blocks
(:mod:`nsa_kernels.selected.row_walk`) with an online softmax; it loads each selected K/V tile
once for all G heads of the group (rows padded to BG >= 16 for ``tl.dot``).
"""

# No `from __future__ import annotations`: the triton 3.0/3.1 interpreter reads a string
# annotation as a runtime argument, so `B: tl.constexpr` would stop being a constant.
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from nsa_kernels.common.finite_flag import finite_path_launches
from nsa_kernels.common.forward_outputs import forward_outputs, no_visible_keys
from nsa_kernels.common.local_softmax import LocalSoftmax, check_local_softmax
from nsa_kernels.common.online_softmax import online_softmax_step
from nsa_kernels.common.row_runs import RowRuns, as_tensor
from nsa_kernels.common.tile_config import pow2
from nsa_kernels.common.traced_launch import launch
from nsa_kernels.common.two_runs import two_runs
from nsa_kernels.selected.forced import sel_forced_kernel
from nsa_kernels.selected.launch import (
    Launch,
    dot_precision,
    kv_hint,
    path_launches,
    strided_grid,
    values_fit_tma,
    varlen_args,
)
from nsa_kernels.selected.row_walk import (
    LN2_CONST,
    LOG2E,
    LOG2E_CONST,
    query_row,
    selected_tile,
    walk_between_forced,
    walk_steps,
)


@triton.jit
def _cmp_row(
    cmp_ptr, cmp2_ptr, b, r, heads, offs_v, ok, stride_cb, stride_ct, stride_ch,
    stride_c2b, stride_c2t, stride_c2h, cmp_start, cmp_rows, CMP_RUNS: tl.constexpr,
):  # fmt: skip
    """o_cmp [BG, BV] at query row r: from one tensor, or (CMP_RUNS) from the two runs of a
    ``RowRuns`` (rows before ``cmp_start`` read 0, the first run holds ``cmp_rows`` rows from
    there, the second the rest; see :class:`GatedSum`)."""
    if CMP_RUNS:
        # One load from whichever run holds row r: the run's row pointer and head stride are
        # picked as scalars, and the rows before the first run read 0 through the mask.
        r1 = r - cmp_start
        in_first = r1 < cmp_rows
        row_ptr = tl.where(
            in_first,
            cmp_ptr + b * stride_cb + r1 * stride_ct,
            cmp2_ptr + b * stride_c2b + (r1 - cmp_rows) * stride_c2t,
        )
        head_stride = tl.where(in_first, stride_ch, stride_c2h)
        # The row test broadcast first: the Triton 3.9 interpreter reads a mask made with a
        # scalar comparison as int32 and refuses it.
        after_start = (offs_v * 0 + r1) >= 0
        x = tl.load(
            row_ptr + heads[:, None] * head_stride + offs_v[None, :],
            mask=ok & after_start[None, :], other=0.0, eviction_policy="evict_first",
        )  # fmt: skip
    else:
        x = tl.load(
            cmp_ptr + b * stride_cb + r * stride_ct + heads[:, None] * stride_ch + offs_v[None, :],
            mask=ok, other=0.0, eviction_policy="evict_first",
        )  # fmt: skip
    return x


@triton.jit
def _gated_sum(
    o_sel, cmp_ptr, cmp2_ptr, win_ptr, gate_ptr, b, r, heads, offs_v, g_mask, v_mask,
    stride_cb, stride_ct, stride_ch, stride_c2b, stride_c2t, stride_c2h, cmp_start, cmp_rows,
    stride_wb, stride_wt, stride_wh, stride_gb, stride_gt, stride_gh, stride_gc,
    CMP_RUNS: tl.constexpr,
):  # fmt: skip
    """[BG, BV] float32 ``g_cmp * o_cmp + g_sel * o_sel + g_win * o_win`` at query row r of
    batch row b, heads ``heads`` [BG] and channels ``offs_v`` [BV]; o_sel [BG, BV] float32;
    o_cmp as :func:`_cmp_row` reads it.

    o_cmp and o_win are read once and not again: ``evict_first`` keeps K/V in L2 over them.
    """
    ok = g_mask[:, None] & v_mask[None, :]
    o_cmp = _cmp_row(
        cmp_ptr, cmp2_ptr, b, r, heads, offs_v, ok, stride_cb, stride_ct, stride_ch,
        stride_c2b, stride_c2t, stride_c2h, cmp_start, cmp_rows, CMP_RUNS,
    ).to(tl.float32)  # fmt: skip
    o_win = tl.load(
        win_ptr + b * stride_wb + r * stride_wt + heads[:, None] * stride_wh + offs_v[None, :],
        mask=ok, other=0.0, eviction_policy="evict_first",
    ).to(tl.float32)  # fmt: skip
    gates = gate_ptr + b * stride_gb + r * stride_gt + heads * stride_gh
    g_cmp = tl.load(gates, mask=g_mask, other=0.0).to(tl.float32)[:, None]
    g_sel = tl.load(gates + stride_gc, mask=g_mask, other=0.0).to(tl.float32)[:, None]
    g_win = tl.load(gates + 2 * stride_gc, mask=g_mask, other=0.0).to(tl.float32)[:, None]
    return g_cmp * o_cmp + g_sel * o_sel + g_win * o_win


@triton.jit
def _sel_fwd_rows(
    blk,
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, idx_ptr, seq_ptr, cu_ptr, finite_ptr, k_desc, v_desc,
    cmp_ptr, cmp2_ptr, win_ptr, gate_ptr, sel_ptr, init_o_ptr, init_lse_ptr,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lt,
    stride_ib, stride_it, stride_ih,
    stride_cb, stride_ct, stride_ch,
    stride_c2b, stride_c2t, stride_c2h,
    stride_wb, stride_wt, stride_wh,
    stride_gb, stride_gt, stride_gh, stride_gc,
    n_rows, tq, tk, q_start, nsel, qk_scale, cmp_start, cmp_rows,
    G: tl.constexpr, HPP: tl.constexpr, BG: tl.constexpr,
    DK: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
    SEL: tl.constexpr, BL: tl.constexpr, NSUB: tl.constexpr, NP: tl.constexpr,
    RPP: tl.constexpr, KV_HINT: tl.constexpr, VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
    TMA: tl.constexpr, V_TMA: tl.constexpr, GATED: tl.constexpr, STORE_SEL: tl.constexpr,
    CMP_RUNS: tl.constexpr, HAS_INIT: tl.constexpr, LOCAL: tl.constexpr,
):  # fmt: skip
    """The body of :func:`sel_fwd_kernel` for the rows of row block ``blk``."""
    pid_v = tl.program_id(2)
    # RPP consecutive rows per program: rows of one query block share their forced blocks
    # (0, jt-1, jt), which the second row then finds in L1.
    for rr in range(RPP):
        b, r, t, tok0, h, heads, g_mask, idx_row = query_row(
            blk, rr, n_rows, tq, q_start, seq_ptr, cu_ptr, idx_ptr, stride_ib, stride_it, stride_ih,
            G=G, HPP=HPP, BG=BG, RPP=RPP, VARLEN=VARLEN,
        )  # fmt: skip
        offs_v = pid_v * BV + tl.arange(0, BV)
        v_mask = offs_v < DV
        offs_k = tl.arange(0, BK)

        q_row = q_ptr + b * stride_qb + r * stride_qt + heads[:, None] * stride_qh
        k_head = k_ptr + b * stride_kb + tok0 * stride_kt + h * stride_kh
        v_head = v_ptr + b * stride_vb + tok0 * stride_vt + h * stride_vh

        if NK == 1:
            q = tl.load(
                q_row + offs_k[None, :], mask=g_mask[:, None] & (offs_k < DK)[None, :], other=0.0
            )

        m_i = tl.full([BG], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BG], dtype=tl.float32)
        acc = tl.zeros([BG, BV], dtype=tl.float32)
        if HAS_INIT or LOCAL:
            # The prologue's softmax over the row's forced blocks (nsa_kernels.selected.forced),
            # or the sliding branch's over the same blocks (LOCAL), as a running state:
            # m = its lse (base 2), l = 1, acc = its normalised output.
            lse0 = tl.load(init_lse_ptr + b * stride_lb + r * stride_lt + heads, mask=g_mask,
                           other=float("-inf"))  # fmt: skip
            some = lse0 != float("-inf")
            m_i = tl.where(some, lse0 * LOG2E_CONST, m_i)
            # A NaN lse (a NaN logit among those keys) starts a NaN sum: the row ends as the
            # softmax over all its keys does, o NaN and lse -inf, walk or no walk.
            l_i = tl.where(some, tl.where(lse0 == lse0, 1.0, float("nan")), l_i)
            acc = tl.load(
                init_o_ptr + b * stride_ob + r * stride_ot + heads[:, None] * stride_oh
                + offs_v[None, :],
                mask=(g_mask & some)[:, None] & v_mask[None, :], other=0.0,
            ).to(tl.float32)  # fmt: skip
        if LOCAL:
            start, steps, held = walk_between_forced(idx_row, nsel, t, SEL=SEL, NSUB=NSUB, NP=NP)
        else:
            start = 0
            # Tiles that hold no key the row sees end the walk: left out (walk_steps).
            steps = walk_steps(idx_row, nsel, t, SEL=SEL, BL=BL, NSUB=NSUB, NP=NP)
        for it in range(start, steps):
            pos, live, first = selected_tile(idx_row, it, t, SEL=SEL, BL=BL, NSUB=NSUB)
            k_rows = k_head + pos.to(tl.int64)[:, None] * stride_kt
            kv_row = (b * tk + tok0 + first).to(tl.int32)
            if TMA:
                kt = k_desc.load([kv_row, (h * DK).to(tl.int32)])
                s = tl.dot(q, tl.trans(kt), input_precision=DOT_PREC)
            elif NK == 1:
                kt = tl.load(
                    k_rows + offs_k[None, :],
                    mask=live[:, None] & (offs_k < DK)[None, :],
                    other=0.0,
                    eviction_policy=KV_HINT,
                )
                s = tl.dot(q, tl.trans(kt), input_precision=DOT_PREC)
            else:
                s = tl.zeros([BG, BL], dtype=tl.float32)
                for kc in tl.static_range(NK):
                    dk_offs = kc * BK + offs_k
                    dk_mask = dk_offs < DK
                    qc = tl.load(
                        q_row + dk_offs[None, :], mask=g_mask[:, None] & dk_mask[None, :], other=0.0
                    )
                    kc_t = tl.load(
                        k_rows + dk_offs[None, :],
                        mask=live[:, None] & dk_mask[None, :],
                        other=0.0,
                        eviction_policy=KV_HINT,
                    )
                    s += tl.dot(qc, tl.trans(kc_t), input_precision=DOT_PREC)
            s = tl.where(live[None, :], s * qk_scale, float("-inf"))
            m_new, alpha, p, l_i = online_softmax_step(m_i, l_i, s)
            if V_TMA:
                vt = v_desc.load([kv_row, (h * DV).to(tl.int32)])
            else:
                vt = tl.load(
                    v_head + pos.to(tl.int64)[:, None] * stride_vt + offs_v[None, :],
                    mask=live[:, None] & v_mask[None, :],
                    other=0.0,
                    eviction_policy=KV_HINT,
                )
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PREC)
            m_i = m_new

        # A row that sees no token keeps l == 0: its output is 0 and its lse is -inf.
        seen = l_i > 0.0
        o = acc / tl.where(seen, l_i, 1.0)[:, None]
        if LOCAL:
            # The local softmax stands for blocks the row must hold (its forced ones); a row
            # without them has no right output here: NaN says so rather than a wrong number.
            o = tl.where(held, o, float("nan"))
        o_rows = o_ptr + b * stride_ob + r * stride_ot + heads[:, None] * stride_oh
        if GATED:
            if STORE_SEL:
                sel_rows = sel_ptr + b * stride_ob + r * stride_ot + heads[:, None] * stride_oh
                tl.store(
                    sel_rows + offs_v[None, :],
                    o.to(sel_ptr.dtype.element_ty),
                    mask=g_mask[:, None] & v_mask[None, :],
                )
            o = _gated_sum(
                o, cmp_ptr, cmp2_ptr, win_ptr, gate_ptr, b, r, heads, offs_v, g_mask, v_mask,
                stride_cb, stride_ct, stride_ch, stride_c2b, stride_c2t, stride_c2h, cmp_start,
                cmp_rows, stride_wb, stride_wt, stride_wh, stride_gb, stride_gt, stride_gh,
                stride_gc, CMP_RUNS,
            )  # fmt: skip
        tl.store(
            o_rows + offs_v[None, :],
            o.to(o_ptr.dtype.element_ty),
            mask=g_mask[:, None] & v_mask[None, :],
        )
        if pid_v == 0:
            lse = tl.where(
                seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2_CONST, float("-inf")
            )
            if LOCAL:
                lse = tl.where(held, lse, float("nan"))
            tl.store(lse_ptr + b * stride_lb + r * stride_lt + heads, lse, mask=g_mask)


@triton.jit
def sel_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, idx_ptr, seq_ptr, cu_ptr, finite_ptr, k_desc, v_desc,
    cmp_ptr, cmp2_ptr, win_ptr, gate_ptr, sel_ptr, init_o_ptr, init_lse_ptr,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lt,
    stride_ib, stride_it, stride_ih,
    stride_cb, stride_ct, stride_ch,
    stride_c2b, stride_c2t, stride_c2h,
    stride_wb, stride_wt, stride_wh,
    stride_gb, stride_gt, stride_gh, stride_gc,
    n_rows, tq, tk, q_start, nsel, qk_scale, cmp_start, cmp_rows,
    G: tl.constexpr, HPP: tl.constexpr, BG: tl.constexpr,
    DK: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
    SEL: tl.constexpr, BL: tl.constexpr, NSUB: tl.constexpr, NP: tl.constexpr,
    RPP: tl.constexpr, KV_HINT: tl.constexpr, VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
    TMA: tl.constexpr, V_TMA: tl.constexpr, GATED: tl.constexpr, STORE_SEL: tl.constexpr,
    CMP_RUNS: tl.constexpr, HAS_INIT: tl.constexpr,
    STRIDED: tl.constexpr, LOCAL: tl.constexpr = False,
):  # fmt: skip
    """o [BG, BV] and lse [BG] of one query row for HPP heads of one kv head's group.

    q [B, Tq, HQ, dk], k [B, Tk, H, dk], v [B, Tk, H, dv], o [B, Tq, HQ, dv], lse [B, Tq, HQ],
    idx [B, Tq, H, n] (index rows as sets, :mod:`nsa_kernels.selected.indices`).
    Grid: (ceil(rows / RPP), H * ceil(G / HPP), ceil(DV / BV)). Axis 0 varies fastest, so the
    programs in flight share one kv head and its K/V stays in L2 (KV_HINT="evict_last" asks L2
    to keep K/V over the streamed q and o).

    TMA (NK == 1, BK == DK): K tiles come through a tensor descriptor over k viewed as
    [B * Tk, H * dk]; a tile is loaded whole (the visibility mask applies to s), rows past the end
    read as 0. V_TMA (BV == DV): V tiles come whole through a descriptor over v as well. A whole
    V tile holds rows the query cannot see, whose weight 0 times a NaN there is NaN (docs/spec.md,
    "Non-finite values"), and zeroing them with a select costs the tile a round trip through
    shared memory; so V_TMA serves values that are all finite only: the call launches the kernel
    twice, V_TMA and not, and finite [1] int32 (nonzero: every value of v is finite) picks the
    launch that works; the other one's programs return at once. A call without V_TMA launches it
    once, with masked V loads and a zero flag. STRIDED (the launch without V_TMA beside one with
    it): a grid of a few programs per SM whose programs stride over the row blocks, so that when
    it returns at once it costs a few program starts rather than one per row block.

    GATED (forward only, :func:`forward`'s ``gated``): o is the gated sum of the three branches,
    ``g_cmp * o_cmp + g_sel * o_sel + g_win * o_win`` over float32 values (the combine kernel's
    expression), o_cmp and o_win [B, Tq, HQ, dv] read at the row's heads, gates [B, Tq, HQ, 3]:
    the combine's pass over the three outputs is saved, and o_sel never goes to memory unless
    STORE_SEL: then o_sel is stored too, at o's strides in sel [B, Tq, HQ, dv] (the backward of
    the gated sum reads it). CMP_RUNS: o_cmp comes as two runs of rows (cmp and cmp2, from row
    ``cmp_start``, the first ``cmp_rows`` long; :class:`GatedSum`).

    HAS_INIT (the V_TMA launch after the forced-block prologue, :func:`forced_blocks`): idx holds
    each row's blocks but its forced ones, and the walk starts from the prologue's softmax over
    those: init_o [B, Tq, HQ, dv] (normalised, at o's strides) and init_lse [B, Tq, HQ] (at lse's
    strides; -inf: nothing yet).
    """
    if (tl.load(finite_ptr) != 0) != V_TMA:
        return
    if STRIDED:
        num_blocks = tl.cdiv(n_rows, RPP)
        for blk in range(tl.program_id(0), num_blocks, tl.num_programs(0)):
            _sel_fwd_rows(
                blk, q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, idx_ptr, seq_ptr, cu_ptr, finite_ptr,
                k_desc, v_desc, cmp_ptr, cmp2_ptr, win_ptr, gate_ptr, sel_ptr, init_o_ptr,
                init_lse_ptr, stride_qb,
                stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                stride_vh, stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, stride_ib,
                stride_it, stride_ih, stride_cb, stride_ct, stride_ch, stride_c2b, stride_c2t,
                stride_c2h, stride_wb, stride_wt, stride_wh, stride_gb, stride_gt, stride_gh,
                stride_gc, n_rows, tq, tk, q_start, nsel, qk_scale, cmp_start, cmp_rows, G, HPP,
                BG, DK, BK, NK, DV, BV, SEL, BL, NSUB, NP, RPP, KV_HINT, VARLEN, DOT_PREC, TMA,
                V_TMA, GATED, STORE_SEL, CMP_RUNS, HAS_INIT, LOCAL,
            )  # fmt: skip
    else:
        _sel_fwd_rows(
            tl.program_id(0), q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, idx_ptr, seq_ptr, cu_ptr,
            finite_ptr, k_desc, v_desc, cmp_ptr, cmp2_ptr, win_ptr, gate_ptr, sel_ptr, init_o_ptr,
            init_lse_ptr, stride_qb,
            stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
            stride_vh, stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, stride_ib,
            stride_it, stride_ih, stride_cb, stride_ct, stride_ch, stride_c2b, stride_c2t,
            stride_c2h, stride_wb, stride_wt, stride_wh, stride_gb, stride_gt, stride_gh,
            stride_gc, n_rows, tq, tk, q_start, nsel, qk_scale, cmp_start, cmp_rows, G, HPP, BG,
            DK, BK, NK, DV, BV, SEL, BL, NSUB, NP, RPP, KV_HINT, VARLEN, DOT_PREC, TMA, V_TMA,
            GATED, STORE_SEL, CMP_RUNS, HAS_INIT, LOCAL,
        )  # fmt: skip


def kv_descriptor(x: torch.Tensor, block_l: int) -> Any:
    """The TMA descriptor over x [B, Tk, H, D] (k or v) as [B * Tk, H * D] with [block_l, D]
    boxes; the config resolved D to one power-of-two tile (``tma`` = 1, :func:`values_fit_tma`)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    flat = x.reshape(x.shape[0] * x.shape[1], x.shape[2] * x.shape[3])
    # A box is a compile-time shape: a traced (symbolic) head dim is pinned here.
    box = [block_l, int(x.shape[3])]
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), box)


@dataclass(frozen=True)
class GatedSum:
    """What the selected forward sums its output with (docs/spec.md, "Output"): the other
    two branches o_cmp and o_win [B, Tq, HQ, dv] in q's dtype, and gates [B, Tq, HQ, 3] ordered
    (cmp, sel, win), on q's device. The kernel reads them; their gradients, where wanted, come
    from :class:`nsa_kernels.selected.function.GatedSelectedFunction`. o_cmp may be a
    :class:`RowRuns` of at most two runs (the folded cuDNN branch's full rows
    and its tail), read where they lie; more runs are assembled first."""

    o_cmp: Tensor | RowRuns
    o_win: Tensor
    gates: Tensor


def forward(
    q: Tensor, k: Tensor, v: Tensor, idx: Tensor, info: Launch, gated: GatedSum | None = None,
    sel_out: Tensor | None = None, local: LocalSoftmax | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """o [B, Tq, HQ, dv] in q's dtype and lse [B, Tq, HQ] float32 (natural log, -inf on rows that
    see nothing) of contiguous q, k, v and index rows as sets ``idx [B, Tq, H, n]`` int32.

    ``gated``: o is the gated sum of the three branches instead (see sel_fwd_kernel's GATED);
    lse stays the selected branch's own. ``sel_out`` (with ``gated``): a contiguous
    [B, Tq, HQ, dv] tensor of q's dtype that receives the selected branch's own output as well.
    ``local``: each row's softmax over its forced blocks 0 and ``max(jt - 1, 0) .. jt`` (the
    sliding branch's, over the same keys and values, l' = info.sel_block); every row's index set
    holds those blocks, and the walk starts from that softmax and covers the blocks between
    them (sel_fwd_kernel's LOCAL); the call's config comes from ``prepare(..., local=True)``
    (the forced-block prologue off).
    """
    if sel_out is not None and (gated is None or not sel_out.is_contiguous()):
        raise ValueError("sel_out takes a contiguous tensor, and only beside a gated sum")
    sel_block, cfg = info.sel_block, info.cfg
    o, lse = forward_outputs(q, info.batch, info.tq, info.hq, info.dv)
    if local is not None:
        check_local(local, o, lse, sel_block)
        if cfg.forced_tokens > 1:
            raise ValueError("a call with a local softmax is prepared with local=True")
    if info.rows == 0:
        return o, lse
    if info.n == 0:
        o, lse = no_visible_keys(o, lse)
        if sel_out is not None:
            sel_out.copy_(o)
        if gated is not None:
            # o_sel = 0, its product still taken (a non-finite gate makes its row non-finite,
            # docs/spec.md "Output"), in the combine kernel's float32.
            g, o_sel = gated.gates.float(), o.float()
            total = g[..., 0:1] * as_tensor(gated.o_cmp).float() + g[..., 1:2] * o_sel
            o = (total + g[..., 2:3] * gated.o_win.float()).to(q.dtype)
        return o, lse
    seq_ids, cu = varlen_args(info, q.device)
    hpp = cfg.heads_per_prog
    nch = -(-info.group // hpp)
    nv = -(-info.dv // cfg.block_dv)
    nsub = -(-sel_block // cfg.fwd_block_l)
    grid = (-(-info.rows // cfg.rows_per_prog), info.h * nch, nv)
    tma = cfg.tma == 1
    k_desc: Any = kv_descriptor(k, cfg.fwd_block_l) if tma else k
    # V through TMA too where its tile is whole: two launches, one per kind of values (see
    # sel_fwd_kernel), else one with masked V loads.
    v_tma = tma and values_fit_tma(cfg.block_dv, info)
    v_desc: Any = kv_descriptor(v, cfg.fwd_block_l) if v_tma else v
    # The forced blocks first, TB rows a program (nsa_kernels.selected.forced), where the
    # V_TMA launch walks the rest: there keys and values must both be finite.
    # resolve_config left forced_tokens > 1 only where the prologue applies (V through TMA,
    # no local softmax).
    prologue = cfg.forced_tokens > 1
    finite, _ = finite_path_launches(v_tma, *((k, v) if prologue else (v,)))
    init_o, init_lse, rest = o, lse, idx
    if prologue:
        init_o, init_lse, rest = forced_blocks(q, k, v, idx, info, seq_ids, cu, finite)
    if local is not None:
        init_o, init_lse = local.o, local.lse
    # Without a gated sum the kernel never reads these: o stands in for the pointers.
    cmp = two_runs(o if gated is None else gated.o_cmp)
    parts = (
        (cmp.first, cmp.second, o, o)
        if gated is None
        else (cmp.first, cmp.second, gated.o_win, gated.gates)
    )
    sel = o if sel_out is None else sel_out
    part_strides = [x.stride(i) for x in parts for i in range(3)] + [parts[3].stride(-1)]
    for v_path, strided in path_launches(v_tma):
        launch(
            sel_fwd_kernel, strided_grid(grid, q.device) if strided else grid,
            q, k, v, o, lse, rest if v_path else idx, seq_ids, cu, finite, k_desc, v_desc,
            *parts, sel, init_o, init_lse,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            o.stride(0), o.stride(1), o.stride(2),
            lse.stride(0), lse.stride(1),
            idx.stride(0), idx.stride(1), idx.stride(2),
            *part_strides,
            info.rows, info.tq, k.shape[1], info.q_start, info.n, info.scale * LOG2E,
            cmp.start, cmp.first_rows,
            G=info.group, HPP=hpp, BG=max(16, pow2(hpp)),
            DK=info.dk, BK=cfg.block_d, NK=-(-info.dk // cfg.block_d),
            DV=info.dv, BV=cfg.block_dv,
            SEL=sel_block, BL=cfg.fwd_block_l, NSUB=nsub, NP=pow2(info.n),
            RPP=cfg.rows_per_prog, KV_HINT=kv_hint(cfg),
            VARLEN=info.seq_ids is not None, DOT_PREC=dot_precision(q.dtype), TMA=tma,
            V_TMA=v_path, GATED=gated is not None, STORE_SEL=sel_out is not None,
            CMP_RUNS=cmp.runs, HAS_INIT=prologue and v_path, STRIDED=strided,
            LOCAL=local is not None,
            num_warps=cfg.fwd_warps, num_stages=cfg.fwd_stages, writes=(o, lse, sel),
        )  # fmt: skip
    return o, lse


def check_local(local: LocalSoftmax, o: Tensor, lse: Tensor, sel_block: int) -> None:
    """The local softmax must be o's and lse's shape, dtype, device and strides, for l'."""
    check_local_softmax(local, tuple(o.shape), sel_block)
    for name, got, want in (("o", local.o, o), ("lse", local.lse, lse)):
        if (got.shape, got.dtype, got.device, got.stride()) != (
            want.shape, want.dtype, want.device, want.stride()
        ):  # fmt: skip
            raise ValueError(
                f"local softmax {name} {list(got.shape)} {got.dtype} on {got.device}, strides "
                f"{got.stride()}: want {list(want.shape)} {want.dtype} on {want.device}, "
                f"strides {want.stride()}"
            )


def forced_blocks(
    q: Tensor, k: Tensor, v: Tensor, idx: Tensor, info: Launch, seq_ids: Tensor, cu: Tensor,
    finite: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(o_part [B, Tq, HQ, dv] in q's dtype, lse_part [B, Tq, HQ] float32, rest [B, Tq, H, n]
    int32) of :func:`nsa_kernels.selected.forced.sel_forced_kernel`, at the strides of o, lse
    and idx; written where ``finite`` is nonzero (the kernel returns at once otherwise)."""
    tb = info.cfg.forced_tokens
    o_part, lse_part = forward_outputs(q, info.batch, info.tq, info.hq, info.dv)
    rest = torch.empty_strided(idx.shape, idx.stride(), dtype=idx.dtype, device=idx.device)
    sel_block = info.sel_block
    block_l = min(64, pow2(sel_block))
    launch(
        sel_forced_kernel, (-(-info.rows // tb), info.h),
        q, k, v, idx, seq_ids, cu, finite, o_part, lse_part, rest,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        idx.stride(0), idx.stride(1), idx.stride(2),
        info.rows, info.tq, info.q_start, info.n, info.scale * LOG2E,
        G=info.group, BG=max(pow2(info.group), 16 // tb), TB=tb, DK=info.dk, DV=info.dv,
        SEL=sel_block, BL=block_l, NSUB=-(-sel_block // block_l), NP=pow2(info.n),
        VARLEN=info.seq_ids is not None, DOT_PREC=dot_precision(q.dtype),
        num_warps=info.cfg.forced_warps, writes=(o_part, lse_part, rest),
    )  # fmt: skip
    return o_part, lse_part, rest
