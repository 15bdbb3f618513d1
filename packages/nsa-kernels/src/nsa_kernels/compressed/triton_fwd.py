# Triton kernels take untyped pointer/scalar parameters (types come from the launch), and
# triton.jit is untyped without triton installed: mypy checks only the plain Python here.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Forward kernel of the compressed branch: online softmax over the visible compressed keys.

One program per (query tile, kv head[, head chunk]): BM rows = TPP query tokens x HPP query heads
of one group, so each K/V tile is loaded once for the whole group. The rows of a tile see block
prefixes that differ by at most ceil(TPP / d) blocks, so all key tiles but the last one or two
are visible to every row and run without a mask; key tiles no row sees are never loaded.

Softmax in base 2: ``qk_scale = scale * log2(e)``; lse is stored in natural log, -inf for rows
that see no block (their output is 0).

The backward (triton_bwd.py) walks the same query tiles: :func:`query_tile_rows`,
:func:`group_rows` and :func:`load_group_rows` serve both.
"""

from __future__ import annotations

import triton
import triton.language as tl

from nsa_kernels.common.key_rows import load_key_rows
from nsa_kernels.common.online_softmax import online_softmax_step
from nsa_kernels.compressed.triton_tiles import (
    key_stretch,
    local_start,
    query_tile,
    stretch_bounds,
    visible_blocks,
    window_start,
)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# Plain module floats are not visible inside @jit; constexpr globals are.
_LN2 = tl.constexpr(LN2)


@triton.jit
def group_rows(
    r0,
    r_end,
    chunk,
    kvh,
    G: tl.constexpr,
    HPP: tl.constexpr,
    TPP: tl.constexpr,
    BM: tl.constexpr,
):
    """(tok, rows, row_ok, heads) [BM] of a tile of TPP query tokens from row r0 x HPP heads.

    Row ``tok * HPP + i`` is token ``rows = r0 + tok`` (a row of q's T axis) and query head
    ``heads``, head ``chunk * HPP + i`` of kv head kvh's group of G; row_ok: a token before
    r_end and a head of the group.
    """
    rr = tl.arange(0, BM)
    tok = rr // HPP
    g = chunk * HPP + (rr - tok * HPP)
    rows = r0 + tok
    row_ok = (tok < TPP) & (g < G) & (rows < r_end)
    heads = kvh * G + g
    return tok, rows, row_ok, heads


@triton.jit
def load_group_rows(
    ptr, b, rows, heads, row_ok, stride_b, stride_t, stride_h, D: tl.constexpr, BD: tl.constexpr
):
    """[BM, BD] of a [B, Tq, HQ, D] tensor (q, do) at the rows of :func:`group_rows`; rows
    that are not ``row_ok`` and columns past D read 0."""
    offs = tl.arange(0, BD)
    return tl.load(
        ptr + b * stride_b + rows[:, None] * stride_t + heads[:, None] * stride_h + offs[None, :],
        mask=row_ok[:, None] & (offs < D)[None, :],
        other=0.0,
    )


@triton.jit
def query_tile_rows(
    tiles_ptr, cu_ptr, cmp_cu_ptr, batch, tq, q_start, num_kv_heads, window,
    G: tl.constexpr, HPP: tl.constexpr, TPP: tl.constexpr, NCH: tl.constexpr, BM: tl.constexpr,
    LBLK: tl.constexpr, DSTR: tl.constexpr, BN: tl.constexpr, VARLEN: tl.constexpr,
    WINDOWED: tl.constexpr,
):  # fmt: skip
    """This program's query tile of one kv head (head chunk) and the blocks its rows see.

    Grid: (num_tiles * H * NCH,), program p -> head unit ``p % (H * NCH)``, tile
    ``p // (H * NCH)``. Returns (b, kvh, kbase, rows, row_ok, heads, nvis, n_hi, n_full, nlo,
    n_start, n_open): the batch row, kv head and first compressed key of the tile's sequence;
    the rows of :func:`group_rows`; nvis [BM] the blocks each row sees; n_hi the blocks some row
    sees, the key tiles of BN blocks below n_full are seen by every row (from above).
    WINDOWED: nlo [BM] each row's first visible key, n_start the first key tile some row sees,
    and the tiles from n_open on are seen by every row from below; else nlo = 0 and
    n_start = n_open = 0.
    """
    pid = tl.program_id(0)
    units = num_kv_heads * NCH
    unit = pid % units
    kvh = unit // NCH
    chunk = unit - kvh * NCH
    b, r0, r_end, t0, kbase = query_tile(
        tiles_ptr, cu_ptr, cmp_cu_ptr, pid // units, batch, tq, q_start, TPP, VARLEN
    )
    tok, rows, row_ok, heads = group_rows(r0, r_end, chunk, kvh, G, HPP, TPP, BM)
    nvis = visible_blocks(t0 + tok, LBLK, DSTR)
    # The tile's first token sees the fewest blocks, its last the most.
    tokens = tl.minimum(r_end - r0, TPP)
    n_lo = tl.where(tokens > 0, visible_blocks(t0, LBLK, DSTR), 0)
    n_hi = tl.where(tokens > 0, visible_blocks(t0 + tokens - 1, LBLK, DSTR), 0)
    if WINDOWED:
        nlo = window_start(t0 + tok, window)
        lo_first = tl.where(tokens > 0, window_start(t0, window), 0)
        lo_last = window_start(t0 + tokens - 1, window)
    else:
        nlo = nvis * 0
        lo_first = n_lo * 0
        lo_last = lo_first
    n_start, n_open, n_full, n_hi = stretch_bounds(lo_first, lo_last, n_lo, n_hi, BN)
    return b, kvh, kbase, rows, row_ok, heads, nvis, n_hi, n_full, nlo, n_start, n_open


@triton.jit
def _fwd_key_tile(
    q,
    k_head,
    v_head,
    key_row,
    n0,
    n_hi,
    nvis,
    nlo,
    m_i,
    l_i,
    acc,
    stride_kt,
    stride_vt,
    qk_scale,
    DK: tl.constexpr,
    BK: tl.constexpr,
    DV: tl.constexpr,
    BV: tl.constexpr,
    BN: tl.constexpr,
    MASK: tl.constexpr,
    CONTAIN: tl.constexpr,
    WINDOWED: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """One online-softmax step over blocks [n0, n0 + BN): -> (m_i, l_i, acc) [BM], [BM], [BM, BV].

    MASK: some row does not see every block of the tile (per-row prefix ``nvis``, from ``nlo``
    on when WINDOWED, and blocks at or past ``n_hi`` do not exist for any row); without it every
    block is visible to every row. CONTAIN (with MASK): the values may hold a non-finite one,
    which must not reach the rows that do not see it.
    """
    offs_n = tl.arange(0, BN)
    blocks = n0 + offs_n
    k_rows = key_row + offs_n.to(tl.int64)
    live = blocks < n_hi
    kt = load_key_rows(k_head, k_rows, stride_kt, live, DK, BK, MASK)
    s = tl.dot(q, tl.trans(kt), input_precision=DOT_PREC) * qk_scale
    if MASK:
        seen = blocks[None, :] < nvis[:, None]
        if WINDOWED:
            seen = seen & (blocks[None, :] >= nlo[:, None])
        s = tl.where(seen, s, float("-inf"))
    # m_i starts finite (-1e30), so a row that sees nothing keeps p = exp2(-inf) = 0, alpha = 1.
    m_new, alpha, p, l_i = online_softmax_step(m_i, l_i, s)
    vt = load_key_rows(v_head, k_rows, stride_vt, live, DV, BV, MASK)
    if CONTAIN:
        # A row meets the values of blocks it does not see with p = 0, and 0 x NaN = NaN: the
        # dot takes finite values only, and a channel whose visible values hold a non-finite
        # one becomes NaN (docs/spec.md, "Non-finite values"). It costs the tile a second dot
        # and a trip of V through registers: only calls whose values are not all finite pay it.
        finite = (vt == vt) & (vt != float("inf")) & (vt != float("-inf"))
        sees = seen.to(vt.dtype)
        hits = tl.dot(sees, (~finite).to(vt.dtype), input_precision=DOT_PREC)
        vt = tl.where(finite, vt, 0.0)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(vt.dtype), vt, acc, input_precision=DOT_PREC)
    if CONTAIN:
        acc = tl.where(hits > 0.0, float("nan"), acc)
    return m_new, l_i, acc


@triton.jit
def cmp_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, loc_o_ptr, loc_lse_ptr, finite_ptr,
    tiles_ptr, cu_ptr, cmp_cu_ptr,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
    batch, tq, q_start, num_kv_heads, window, qk_scale,
    G: tl.constexpr, HPP: tl.constexpr, TPP: tl.constexpr, NCH: tl.constexpr, BM: tl.constexpr,
    DK: tl.constexpr, BK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
    LBLK: tl.constexpr, DSTR: tl.constexpr, BN: tl.constexpr,
    VARLEN: tl.constexpr, WINDOWED: tl.constexpr, CONTAIN: tl.constexpr, DOT_PREC: tl.constexpr,
    LOCAL: tl.constexpr = False, SEL: tl.constexpr = 1,
):  # fmt: skip
    """o [BM, DV] and lse [BM] of one query tile of one kv head (head chunk).

    q [B, Tq, HQ, DK], k [B, N, H, DK], v [B, N, H, DV], o [B, Tq, HQ, DV], lse [B, Tq, HQ].
    Grid: that of :func:`query_tile_rows`.

    A call launches the kernel twice, and exactly one launch does the work, as finite [1] int32
    (nonzero: every value of v is finite) says: CONTAIN=False for finite values, CONTAIN=True
    (the masked tiles contain non-finite values) otherwise; the other one's programs return at
    once. Containment in the same kernel behind a branch would cost every call: its registers
    (a second accumulator and V in registers) make the kernel spill on sm_90 at the default
    tiles (ci/compile_triton.py --resources).

    LOCAL (the sliding branch, l = d = 1, with w >= 2 SEL or no window): each row walks its
    local keys ``[max(jt - 1, 0) * SEL, t]`` (jt = t // SEL, SEL = l') first and stores that
    softmax, normalised, as loc_o and loc_lse (at o's and lse's strides), then the rest of its
    window on the same running state; block 0's keys join the stored softmax only (a copy of
    the state). The selected branch always attends to those keys (its forced blocks 0, jt - 1
    and jt) and starts its own walk from that state
    (:func:`nsa_kernels.selected.forward.forward`'s ``local``): their tiles are loaded once per
    query tile here instead of once per row there.
    """
    if (tl.load(finite_ptr) != 0) == CONTAIN:
        return
    b, kvh, kbase, rows, row_ok, heads, nvis, n_hi, n_full, nlo, n_start, n_open = (
        query_tile_rows(
            tiles_ptr, cu_ptr, cmp_cu_ptr, batch, tq, q_start, num_kv_heads, window,
            G, HPP, TPP, NCH, BM, LBLK, DSTR, BN, VARLEN, WINDOWED,
        )
    )  # fmt: skip

    q = load_group_rows(q_ptr, b, rows, heads, row_ok, stride_qb, stride_qt, stride_qh, DK, BK)
    k_head = k_ptr + b * stride_kb + kvh * stride_kh
    v_head = v_ptr + b * stride_vb + kvh * stride_vh

    m_i = tl.full([BM], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, BV], dtype=tl.float32)
    if LOCAL:
        # With l = d = 1 a row's visible prefix ends at its position: t = nvis - 1. Its local
        # keys [lb, t] first, from below and above masked per row (an empty tile reads
        # t_last = -1: every range below is empty).
        lb = local_start(nvis - 1, SEL)
        t_last = n_hi - 1
        t_first = tl.min(tl.where(row_ok, nvis - 1, t_last), axis=0)
        lb_first = local_start(t_first, SEL)
        lb_last = local_start(t_last, SEL)
        # A few tiles (two at l' = BN), all masked: one loop costs fewer registers than the
        # three stretches, and ran faster.
        for n0 in range((lb_first // BN) * BN, n_hi, BN):
            m_i, l_i, acc = _fwd_key_tile(
                q, k_head, v_head, kbase + n0, n0, n_hi, nvis, lb, m_i, l_i, acc,
                stride_kt, stride_vt, qk_scale, DK, BK, DV, BV, BN, True, CONTAIN, True, DOT_PREC,
            )  # fmt: skip
        # Block 0 joins a copy of that state for the rows whose local keys start past it (it
        # lies outside their window): stored, it is the softmax over the forced blocks. The
        # copy costs a second accumulator for one tile; taking block 0 after the window walk
        # instead, from the stored softmax, cost more time.
        m_z, l_z, acc_z = m_i, l_i, acc
        if lb_last > 0:
            apart = tl.where(row_ok & (lb > 0), SEL, 0)
            for z0 in tl.static_range(0, SEL, BN):
                m_z, l_z, acc_z = _fwd_key_tile(
                    q, k_head, v_head, kbase + z0, z0, SEL, apart, apart, m_z, l_z, acc_z,
                    stride_kt, stride_vt, qk_scale, DK, BK, DV, BV, BN, True, CONTAIN, False,
                    DOT_PREC,
                )  # fmt: skip
        _store_rows(
            loc_o_ptr, loc_lse_ptr, b, rows, heads, row_ok, m_z, l_z, acc_z,
            stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, DV, BV, True,
        )  # fmt: skip
        # Then the rest of the window, [nlo, lb), on the same running softmax.
        ws_last = tl.max(tl.where(row_ok, nlo, 0), axis=0)
        b_start, b_open, b_full, b_hi = stretch_bounds(n_start, ws_last, lb_first, lb_last, BN)
        m_i, l_i, acc = _fwd_walk(
            q, k_head, v_head, kbase, b_start, b_open, b_full, b_hi, lb, nlo, m_i, l_i, acc,
            stride_kt, stride_vt, qk_scale, DK, BK, DV, BV, BN, CONTAIN, WINDOWED, DOT_PREC,
        )  # fmt: skip
    else:
        m_i, l_i, acc = _fwd_walk(
            q, k_head, v_head, kbase, n_start, n_open, n_full, n_hi, nvis, nlo, m_i, l_i, acc,
            stride_kt, stride_vt, qk_scale, DK, BK, DV, BV, BN, CONTAIN, WINDOWED, DOT_PREC,
        )  # fmt: skip
    _store_rows(
        o_ptr, lse_ptr, b, rows, heads, row_ok, m_i, l_i, acc,
        stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, DV, BV,
    )  # fmt: skip


@triton.jit
def _fwd_walk(
    q, k_head, v_head, kbase, n_start, n_open, n_full, n_hi, upper, lower, m_i, l_i, acc,
    stride_kt, stride_vt, qk_scale,
    DK: tl.constexpr, BK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, BN: tl.constexpr,
    CONTAIN: tl.constexpr, FROM_BELOW: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """The online softmax (m_i, l_i, acc) carried over each row's keys ``[lower, upper)``
    [BM] in the three stretches of :func:`nsa_kernels.compressed.triton_tiles.key_stretch`;
    FROM_BELOW: ``lower`` bounds the rows (else it is 0 and stretch 0 is empty)."""
    for stretch in tl.static_range(3):
        if FROM_BELOW or stretch > 0:
            lo, hi = key_stretch(stretch, n_start, n_open, n_full, n_hi)
            for n0 in range(lo, hi, BN):
                m_i, l_i, acc = _fwd_key_tile(
                    q, k_head, v_head, kbase + n0, n0, n_hi, upper, lower, m_i, l_i, acc,
                    stride_kt, stride_vt, qk_scale,
                    DK, BK, DV, BV, BN, stretch != 1, CONTAIN and stretch != 1, FROM_BELOW,
                    DOT_PREC,
                )  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def _store_rows(
    o_ptr, lse_ptr, b, rows, heads, row_ok, m_i, l_i, acc,
    stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, DV: tl.constexpr, BV: tl.constexpr,
    KEEP_NAN: tl.constexpr = False,
):  # fmt: skip
    """o = acc / l and lse = m + log2 l (natural log) of the tile's rows: 0 and -inf where a
    row saw nothing. KEEP_NAN: a NaN sum (a NaN or infinite logit among the row's keys) stores
    lse = NaN rather than -inf, so that a walk continued from it (the selected branch's, from
    the local softmax) stays NaN as the softmax over all its keys would."""
    seen = l_i > 0.0
    denom = tl.where(seen, l_i, 1.0)
    # One reciprocal a row, then products: an IEEE division per element costs several times
    # more, in an epilogue that a short walk (the sliding branch's few key tiles) feels.
    o = acc * (1.0 / denom)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(denom)) * _LN2, float("-inf"))
    if KEEP_NAN:
        lse = tl.where(l_i != l_i, l_i, lse)
    offs_v = tl.arange(0, BV)
    tl.store(
        o_ptr + b * stride_ob + rows[:, None] * stride_ot + heads[:, None] * stride_oh
        + offs_v[None, :],
        o.to(o_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (offs_v < DV)[None, :],
    )  # fmt: skip
    tl.store(lse_ptr + b * stride_lb + rows * stride_lt + heads, lse, mask=row_ok)
