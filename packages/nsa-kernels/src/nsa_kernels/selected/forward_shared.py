# Triton kernels take untyped pointer/scalar parameters (types come from the launch), and
# triton.jit is untyped without triton installed: mypy checks only the plain Python here.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""The selected forward over tiles of consecutive query rows: ``sel_fwd_shared_kernel``.

The row-at-a-time forward (:mod:`nsa_kernels.selected.forward`) loads every selected K/V tile
once per query row; at G = 16 a tile then feeds a 16-row dot, and the kernel is bound by L2
traffic (docs/selection.md). Consecutive rows share blocks: the forced blocks {0, jt-1, jt} of
NSA (docs/spec.md, "Choosing blocks") are the same for every row of one selection block, and
rows of a trained model pick overlapping blocks. Here one program serves TR consecutive rows of
one kv head, M = TR * BG rows in all (row ``a * BG + g``: token a, head g of the group):

1. the **shared set**: the blocks that every one of its TR index rows holds (index rows are
   sets, :mod:`nsa_kernels.selected.indices`);
2. each token walks the blocks of its own row outside the shared set, as the row-at-a-time
   kernel does (a BG-row dot per K/V tile), and its running softmax state (m, l, acc) goes into
   the token's rows of the program's [M] / [M, dv] state;
3. the shared blocks are walked once for all M rows: one M-row dot per K/V tile, each row masked
   by its own position (``p <= t``).

Every (row, block) pair is visited once, so the result is the reference's up to the order of
the online softmax's tiles (fixed: deterministic). V tiles come whole through TMA, which holds
for finite values only (a masked-out NaN would meet p = 0); the launch pairs this kernel with the
row-at-a-time one, which serves values that are not all finite (``finite_ptr``).
"""

# No `from __future__ import annotations`: the triton 3.0/3.1 interpreter reads a string
# annotation as a runtime argument, so `B: tl.constexpr` would stop being a constant.
import triton
import triton.language as tl

from nsa_kernels.common.online_softmax import online_softmax_step
from nsa_kernels.selected.gated_epilogue import gated_rows
from nsa_kernels.selected.row_walk import LN2_CONST


@triton.jit
def _nth_kept(entries, kept, rank, i):
    """The i-th entry (in order) of ``entries`` [NP] where ``kept``; ``rank`` [NP]: the count of
    kept entries before each one. A scalar int32 (0 if there is none)."""
    return tl.sum(tl.where(kept & (rank == i), entries, 0))


@triton.jit
def _ranks(kept, NP: tl.constexpr):
    """[NP] int32: how many entries before each one are kept (kept [NP] bool)."""
    cols = tl.arange(0, NP)
    before = cols[None, :] < cols[:, None]
    return tl.sum(tl.where(before & kept[None, :], 1, 0), axis=1)


@triton.jit
def sel_fwd_shared_kernel(
    q_ptr, v_ptr, o_ptr, lse_ptr, idx_ptr, finite_ptr, k_desc, v_desc,
    cmp_ptr, win_ptr, gate_ptr,
    stride_qb, stride_qt, stride_qh,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lt,
    stride_ib, stride_it, stride_ih,
    stride_cb, stride_ct, stride_ch,
    stride_wb, stride_wt, stride_wh,
    stride_gb, stride_gt, stride_gh, stride_gc,
    tq, tk, q_start, nsel, qk_scale,
    G: tl.constexpr, BG: tl.constexpr, TR: tl.constexpr, NP: tl.constexpr,
    DK: tl.constexpr, DV: tl.constexpr, SEL: tl.constexpr, BL: tl.constexpr, NSUB: tl.constexpr,
    DOT_PREC: tl.constexpr, GATED: tl.constexpr,
):  # fmt: skip
    """o [M, DV] and lse [M] of TR consecutive query rows (one batch row) of one kv head.

    q [B, Tq, HQ, dk], v [B, Tk, H, dv], o [B, Tq, HQ, dv], lse [B, Tq, HQ], idx [B, Tq, H, n]
    (index rows as sets); k_desc / v_desc: TMA descriptors over k / v as [B * Tk, H * d] with
    [BL, d] boxes (dk and dv powers of two). Grid: (B * ceil(Tq / TR), H). Rows past Tq redo
    the last row (its index row keeps the shared set whole) and store nothing.
    GATED: o is ``g_cmp * o_cmp + g_slc * o_slc + g_win * o_win`` as in ``sel_fwd_kernel``.
    Works only where ``finite_ptr`` is nonzero (every value of v finite); else returns at once.
    """
    if tl.load(finite_ptr) == 0:
        return
    M: tl.constexpr = TR * BG
    n_tiles = tl.cdiv(tq, TR)
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b = (pid // n_tiles).to(tl.int64)
    r0 = (pid - b * n_tiles) * TR

    offs_m = tl.arange(0, M)
    tok = offs_m // BG
    g = offs_m - tok * BG
    row_in = (r0 + tok < tq) & (g < G)
    r_m = tl.minimum(r0 + tok, tq - 1).to(tl.int64)
    t_m = r_m + q_start
    heads_m = h * G + g
    offs_k = tl.arange(0, DK)
    offs_v = tl.arange(0, DV)
    q_rows = q_ptr + b * stride_qb + r_m * stride_qt + heads_m * stride_qh
    kv_base = b * tk

    # The shared set: row r0's entries found in every row of the tile.
    cols = tl.arange(0, NP)
    offs_a = tl.arange(0, TR)
    r_a = tl.minimum(r0 + offs_a, tq - 1).to(tl.int64)
    idx_head = idx_ptr + b * stride_ib + h * stride_ih
    col_in = cols < nsel
    rows_idx = tl.load(
        idx_head + r_a[:, None] * stride_it + cols[None, :], mask=col_in[None, :], other=-1
    )
    first_row = tl.load(idx_head + r0 * stride_it + cols, mask=col_in, other=-1)
    found = tl.max(
        tl.where(rows_idx[:, :, None] == first_row[None, None, :], 1, 0), axis=1
    )  # [TR, NP]: entry s of row r0 is in row a
    shared = (tl.min(found, axis=0) > 0) & (first_row >= 0)
    shared_rank = _ranks(shared, NP)
    n_shared = tl.sum(shared.to(tl.int32))

    m_all = tl.full([M], -1.0e30, dtype=tl.float32)
    l_all = tl.zeros([M], dtype=tl.float32)
    acc_all = tl.zeros([M, DV], dtype=tl.float32)

    # Each token's own blocks, BG rows at a time.
    offs_g = tl.arange(0, BG)
    for a in range(TR):
        r = tl.minimum(r0 + a, tq - 1).to(tl.int64)
        t = r + q_start
        row = tl.load(idx_head + r * stride_it + cols, mask=col_in, other=-1)
        in_shared = tl.max(
            tl.where((row[:, None] == first_row[None, :]) & shared[None, :], 1, 0), axis=1
        )
        own = (row >= 0) & (in_shared == 0)
        own_rank = _ranks(own, NP)
        n_own = tl.sum(own.to(tl.int32))
        q_tok = tl.load(
            q_ptr + b * stride_qb + r * stride_qt + (h * G + offs_g)[:, None] * stride_qh
            + offs_k[None, :],
            mask=(offs_g < G)[:, None], other=0.0,
        )  # fmt: skip
        m_i = tl.full([BG], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BG], dtype=tl.float32)
        acc = tl.zeros([BG, DV], dtype=tl.float32)
        for it in range(n_own * NSUB):
            i = it // NSUB
            sub = it - i * NSUB
            blk = _nth_kept(row, own, own_rank, i)
            in_blk = sub * BL + tl.arange(0, BL)
            pos = blk * SEL + in_blk
            first = (kv_base + blk * SEL + sub * BL).to(tl.int32)
            kt = k_desc.load([first, (h * DK).to(tl.int32)])
            s = tl.dot(q_tok, tl.trans(kt), input_precision=DOT_PREC)
            live = (in_blk < SEL) & (pos <= t)
            s = tl.where(live[None, :], s * qk_scale, float("-inf"))
            m_new, alpha, p, l_i = online_softmax_step(m_i, l_i, s)
            vt = v_desc.load([first, (h * DV).to(tl.int32)])
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PREC)
            m_i = m_new
        # The token's state into its BG rows of the program's state.
        mine = tok == a
        m_all = tl.where(mine, tl.reshape(tl.broadcast_to(m_i[None, :], [TR, BG]), [M]), m_all)
        l_all = tl.where(mine, tl.reshape(tl.broadcast_to(l_i[None, :], [TR, BG]), [M]), l_all)
        acc_rows = tl.reshape(tl.broadcast_to(acc[None, :, :], [TR, BG, DV]), [M, DV])
        acc_all = tl.where(mine[:, None], acc_rows, acc_all)

    # The shared blocks, all M rows at once.
    q_all = tl.load(q_rows[:, None] + offs_k[None, :], mask=(g < G)[:, None], other=0.0)
    for it in range(n_shared * NSUB):
        i = it // NSUB
        sub = it - i * NSUB
        blk = _nth_kept(first_row, shared, shared_rank, i)
        in_blk = sub * BL + tl.arange(0, BL)
        pos = blk * SEL + in_blk
        first = (kv_base + blk * SEL + sub * BL).to(tl.int32)
        kt = k_desc.load([first, (h * DK).to(tl.int32)])
        s = tl.dot(q_all, tl.trans(kt), input_precision=DOT_PREC)
        live = (in_blk < SEL)[None, :] & (pos[None, :] <= t_m[:, None])
        s = tl.where(live, s * qk_scale, float("-inf"))
        m_new, alpha, p, l_all = online_softmax_step(m_all, l_all, s)
        vt = v_desc.load([first, (h * DV).to(tl.int32)])
        acc_all = acc_all * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PREC)
        m_all = m_new

    # A row that sees no token keeps l == 0: its output is 0 and its lse is -inf.
    seen = l_all > 0.0
    o = acc_all * (1.0 / tl.where(seen, l_all, 1.0))[:, None]
    if GATED:
        o = gated_rows(
            o,
            cmp_ptr + b * stride_cb + r_m * stride_ct + heads_m * stride_ch,
            win_ptr + b * stride_wb + r_m * stride_wt + heads_m * stride_wh,
            gate_ptr + b * stride_gb + r_m * stride_gt + heads_m * stride_gh,
            stride_gc, offs_v, row_in, offs_v < DV,
        )  # fmt: skip
    o_rows = o_ptr + b * stride_ob + r_m * stride_ot + heads_m * stride_oh
    tl.store(o_rows[:, None] + offs_v[None, :], o.to(o_ptr.dtype.element_ty), mask=row_in[:, None])
    lse = tl.where(seen, (m_all + tl.log2(tl.where(seen, l_all, 1.0))) * LN2_CONST, float("-inf"))
    tl.store(lse_ptr + b * stride_lb + r_m * stride_lt + heads_m, lse, mask=row_in)

