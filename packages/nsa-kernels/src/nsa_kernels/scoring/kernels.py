# Triton kernels take untyped pointer/scalar parameters (types come from the launch), and
# triton.jit is untyped without triton installed: mypy checks only the plain Python here.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""The block-scoring kernel: compressed probabilities -> selection scores -> top-n, on chip.

Notation (docs/spec.md, "Selection scores", "Choosing blocks"): compressed block i covers tokens
``[i*d, i*d + l)``, selection block j covers ``[j*l', (j+1)*l')``; a query at position t sees
block i iff ``i*d + l - 1 <= t``. With r = l'/d and L = l/d, block i = j*r + m (phase m < r) is
*owned* by selection block j and overlaps blocks j, j+1, ..., j+Q; its weight for block j + q
depends on (q, m) only: ``w[q, m]`` (function.phase_weights), Q = (L + r - 2) // r. So

    S[t, j] = sum_q sum_m w[q, m] * P[t, (j - q)*r + m],   P[t, i] = sum_g p[t, g, i].

One program serves BT query tokens x GP heads of one kv head (BM = BT * GP rows, row
``tok * GP + g``, GP = G padded to a power of two) and walks the selection blocks in tiles of BS:
a tile loads the compressed keys its blocks own, ``(j0 + s) * r + m`` for s < BS, m < RP (r
padded to a power of two, masked), as the RP * BS columns of one ``tl.dot``, phase-major
(column ``m * BS + s``: in the dot's accumulator the phase index lies in each thread's
registers, so the phase sums need no shuffles). Then, all in registers: p = exp2(logit - lse),
a reshape to [BT, GP, RP, BS] sums the heads, the phases are weighed, the q > 0 terms come from
the same sums shifted by q selection blocks (the first ones from the previous tile, carried),
and the tile's scores merge into a running top-n per token. Nothing of size T x N_cmp or
T x Nsel is written; the output is the n indices and the count.

The walk has two parts: tiles whose blocks every row of the program sees (no masks: rows
without a normaliser get lse = +inf, hence p = 0), then the tiles along the causal edge (masked).

Softmax runs in base 2 (``qk_scale = scale * log2 e``); the normaliser is the lse argument
(natural log, converted) or, without it, a first pass over the visible blocks (online max/sum).

Ties: equal keys give bit-equal logits (every column of a ``tl.dot`` is the same dot product
of its operands), every later step treats all columns and all blocks alike (the same reductions
in the same order; the shifts only move values, exactly), so equal inputs give bit-equal scores
wherever they sit. A score and its block pack into one int64 key
``(bits(S) + 1) << 32 | (2^31-1-j)`` (S >= 0, so its bits order like its value): sorting keys
descending orders by score, ties to the lower j. A NaN or +inf score gets the high half 0.
A NaN logit among the blocks a row sees makes every score of its group NaN (the softmax's
denominator is NaN): such a token keeps its forced blocks and takes the lowest valid j for the
rest, whatever the normaliser (the lse argument, or the first pass) says. The kernel reads such
a logit off the token's scores: whatever the normaliser, it makes the score of the block that
owns it NaN (padding heads and padded phases, which may meet 0 x inf in a dot, are kept out of
the sums).
"""

from __future__ import annotations

import triton
import triton.language as tl

from nsa_kernels.common.online_softmax import online_softmax_step

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)
# The low half of a key holds j ^ _LOW = 2^31 - 1 - j (j < 2^31): larger for lower j.
_LOW = tl.constexpr(0x7FFFFFFF)


@triton.jit
def _bitonic(
    x,
    LOG_ROWS: tl.constexpr,
    LOG_N: tl.constexpr,
    DESCENDING: tl.constexpr,
    MERGE_ONLY: tl.constexpr,
):
    """x [2^LOG_ROWS, 2^LOG_N] integers, each row sorted (MERGE_ONLY: each row bitonic, merged).

    The bitonic network of ``tl.sort`` on the [2] * n hypercube view, written out here with an
    integer sum for the partner exchange: (a + b) - a == b holds exactly in wrapping integer
    arithmetic, and a sum is a plain reduction (the Triton interpreter runs it natively, unlike
    the custom-combine reduction of ``tl.sort``, which made the tests many times slower).
    """
    N_DIMS: tl.constexpr = LOG_ROWS + LOG_N
    h = tl.reshape(x, [2] * N_DIMS)
    # Each element's flat index: along axis a it sits on side bit (N_DIMS - 1 - a) of its pair.
    # A full-shape index rather than [1, .., 2, .., 1] reshapes of arange(0, 2): Triton 3.6/3.7
    # fail to compile those in some tile shapes (TritonGPURemoveLayoutConversions; found by
    # ci/compile_triton.py).
    pos = tl.reshape(tl.arange(0, 1 << N_DIMS), [2] * N_DIMS)
    for stage in tl.static_range(LOG_N if MERGE_ONLY else 1, LOG_N + 1):
        for i in tl.static_range(stage):
            # Compare-and-swap along axis N_DIMS - stage + i (the (stage-1-i)-th innermost).
            partner = tl.sum(h, axis=N_DIMS - stage + i, keep_dims=True) - h
            right = (pos >> (stage - 1 - i)) & 1
            # Runs of 2^stage alternate ascending / descending, making bitonic runs of 2x; the
            # last stage sorts the whole row one way.
            flip = (pos >> stage) & 1 if stage < LOG_N else DESCENDING
            # Keep the larger of the pair where (right ^ flip), else the smaller: one comparison
            # picks between h and its partner (equal values make either choice the same).
            h = tl.where((h < partner) == ((right ^ flip) != 0), partner, h)
    return tl.reshape(h, x.shape)


@triton.jit
def _phase_weights(q: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, L: tl.constexpr):
    """w[q, :] [RP] float32 of function.phase_weights, from the constexpr geometry.

    Compile-time values: in the dot's accumulator the phase index lies in registers, so the
    products fold (see :func:`_weigh`).
    """
    m = tl.arange(0, RP)
    w = tl.minimum(R - m, L) if q == 0 else tl.maximum(tl.minimum(m + L - q * R, R), 0)
    return tl.where(m < R, w, 0).to(tl.float32)


@triton.jit
def _weigh(p, w):
    """p * w for phase weights w (broadcast), with the terms of weight 0 left out of the sums.

    0 * p is not 0 to the compiler (p may be NaN or inf), so a plain product keeps a multiply
    and an add for every zero weight; -0.0 is the identity of a float sum, so those terms fold
    away. A NaN in a phase of weight 0 then stays out of that sum: it still reaches the score
    of the block that owns it (whose weight is positive), which is all the NaN rule reads.
    """
    return tl.where(w != 0.0, p * w, -0.0)


@triton.jit
def _shift_blocks(cur, prev, q, BS: tl.constexpr, USE_GATHER: tl.constexpr):
    """out [BT, BS]: ``out[:, s] = cur[:, s - q]`` for s >= q, else ``prev[:, s - q + BS]``.

    Pure data movement (no rounding): ``tl.gather`` where Triton has it, else a one-hot
    contraction whose every sum holds one nonzero term.
    """
    s = tl.arange(0, BS)
    src = s - q
    if USE_GATHER:
        bt: tl.constexpr = cur.shape[0]
        from_cur = tl.gather(cur, tl.broadcast_to(tl.maximum(src, 0)[None, :], (bt, BS)), axis=1)
        from_prev = tl.gather(
            prev, tl.broadcast_to(tl.where(src < 0, src + BS, 0)[None, :], (bt, BS)), axis=1
        )
        out = tl.where((src >= 0)[None, :], from_cur, from_prev)
    else:
        pick_cur = (s[:, None] == src[None, :]).to(tl.float32)
        pick_prev = (s[:, None] == (src + BS)[None, :]).to(tl.float32)
        out = tl.sum(
            cur[:, :, None] * pick_cur[None, :, :] + prev[:, :, None] * pick_prev[None, :, :],
            axis=1,
        )
    return out


@triton.jit
def _tile_logits(
    q1,
    q2,
    k_rows,
    load_ok,
    DK: tl.constexpr,
    BK1: tl.constexpr,
    BK2: tl.constexpr,
    MASK_ROWS: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """s [BM, BC] float32 = q . k for the BC keys at row pointers ``k_rows`` [BC].

    q1 [BM, BK1] (and q2 [BM, BK2] when BK2 > 0) hold q's dk in two chunks; MASK_ROWS: keys
    with ``load_ok`` false read as 0 (else every row is read).
    """
    d1 = tl.arange(0, BK1)
    rows_ok = load_ok if MASK_ROWS else tl.full(load_ok.shape, True, tl.int1)
    k1 = tl.load(
        k_rows[:, None] + d1[None, :], mask=rows_ok[:, None] & (d1 < DK)[None, :], other=0.0
    )
    s = tl.dot(q1, tl.trans(k1), input_precision=DOT_PREC)
    if BK2 > 0:
        d2 = BK1 + tl.arange(0, BK2)
        k2 = tl.load(
            k_rows[:, None] + d2[None, :], mask=rows_ok[:, None] & (d2 < DK)[None, :], other=0.0
        )
        s = tl.dot(q2, tl.trans(k2), s, input_precision=DOT_PREC)
    return s


@triton.jit
def _lse_tile(
    m_i,
    l_i,
    c0,
    q1,
    q2,
    k_head,
    stride_kt,
    t_row,
    n_vis,
    qk_scale,
    DK: tl.constexpr,
    BK1: tl.constexpr,
    BK2: tl.constexpr,
    BL: tl.constexpr,
    CMP_BLOCK: tl.constexpr,
    CMP_STRIDE: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Online max m_i and sum l_i [BM] (base 2) over blocks c0 .. c0 + BL - 1.

    MASKED: the tile holds blocks some row does not see (or past n_vis); else all are seen.
    """
    blk = c0 + tl.arange(0, BL)
    blk_ok = blk < n_vis
    k_rows = k_head + blk.to(tl.int64) * stride_kt
    s = _tile_logits(q1, q2, k_rows, blk_ok, DK, BK1, BK2, MASKED, DOT_PREC) * qk_scale
    if MASKED:
        last = blk * CMP_STRIDE + CMP_BLOCK - 1
        s = tl.where(blk_ok[None, :] & (last[None, :] <= t_row[:, None]), s, float("-inf"))
    m_new, _, _, l_i = online_softmax_step(m_i, l_i, s)
    return m_new, l_i


@triton.jit
def _score_tile(
    j0,
    run,
    p_prev,
    nan_tok,
    real_rows,
    q1,
    q2,
    k_head,
    stride_kt,
    lse2,
    t_row,
    tok_ok,
    jt,
    n_vis,
    qk_scale,
    DK: tl.constexpr,
    BK1: tl.constexpr,
    BK2: tl.constexpr,
    CMP_BLOCK: tl.constexpr,
    CMP_STRIDE: tl.constexpr,
    R: tl.constexpr,
    RP: tl.constexpr,
    REACH: tl.constexpr,
    BT: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    BS: tl.constexpr,
    NP: tl.constexpr,
    LOG_BT: tl.constexpr,
    LOG_BS: tl.constexpr,
    LOG_NP: tl.constexpr,
    MASKED: tl.constexpr,
    USE_GATHER: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Score selection blocks j0 .. j0 + BS - 1 and merge them into the running top-n.

    run [BT, NP] int64: each token's best keys so far, descending (-1: none). p_prev: what the
    previous tile carries into this one (its blocks spill into this tile's first ones): for
    Q <= 1 its spill sums [BT, BS] (the weights w[1] applied), else its group-summed
    probabilities [BT, RP, BS]. lse2 [BM]: base-2 normalisers, +inf on rows that must give
    p = 0. nan_tok [BT, BS] int32: 1 where a token has had a NaN score so far (reduced at
    the end). real_rows [BM]: rows of a real head (g < G). MASKED: some row does not see some
    block of the tile. Returns (run, the carry, nan_tok), each updated with this tile.
    """
    cols = tl.arange(0, RP * BS)
    col_m = cols // BS
    blk = (j0 + cols % BS) * R + col_m
    load_ok = (col_m < R) & (blk < n_vis)
    k_rows = k_head + blk.to(tl.int64) * stride_kt
    s = _tile_logits(q1, q2, k_rows, load_ok, DK, BK1, BK2, MASKED or RP > R, DOT_PREC)
    p = tl.exp2(s * qk_scale - lse2[:, None])
    if MASKED:
        last = blk * CMP_STRIDE + CMP_BLOCK - 1
        seen = load_ok[None, :] & (last[None, :] <= t_row[:, None])
        p = tl.where(seen, p, 0.0)
    elif RP > R:
        # Padded phases (m >= r) read zero keys and weigh 0, but a non-finite q makes their
        # logit NaN, and NaN x 0 = NaN: only real blocks may reach the scores.
        p = tl.where((col_m < R)[None, :], p, 0.0)
    if GP > G:
        # Padding heads read q = 0, and 0 x inf = NaN in a dot: keep them out of the sums.
        p = tl.where(real_rows[:, None], p, 0.0)
    p4 = tl.reshape(p, (BT, GP, RP, BS))
    L: tl.constexpr = CMP_BLOCK // CMP_STRIDE
    w_own = _phase_weights(0, R, RP, L)[None, None, :, None]
    if REACH <= 1:
        # Weigh the phases per head first (in registers), then sum the heads of the two
        # [BT, GP, BS] results; the spill into the next block is carried as is.
        score = tl.sum(tl.sum(_weigh(p4, w_own), axis=2), axis=1)
        carry = score
        if REACH == 1:
            w_next = _phase_weights(1, R, RP, L)[None, None, :, None]
            carry = tl.sum(tl.sum(_weigh(p4, w_next), axis=2), axis=1)
            score += _shift_blocks(carry, p_prev, 1, BS, USE_GATHER)
    else:
        # [BT, RP, BS]: per token, the group's probability of each owned block; carried.
        carry = tl.sum(p4, axis=1)
        score = tl.sum(_weigh(carry, _phase_weights(0, R, RP, L)[None, :, None]), axis=1)
        for q in tl.static_range(1, REACH + 1):
            w_q = _phase_weights(q, R, RP, L)[None, :, None]
            spill_cur = tl.sum(_weigh(carry, w_q), axis=1)
            spill_prev = tl.sum(_weigh(p_prev, w_q), axis=1)
            score += _shift_blocks(spill_cur, spill_prev, q, BS, USE_GATHER)

    # A NaN logit among the blocks a row sees makes its softmax's denominator NaN: every
    # probability of the row, hence every score of its group, is NaN (docs/spec.md,
    # "Non-finite values"). Whatever the normaliser, such a logit makes p, and so the score
    # of the block that owns it (a positive weight), NaN here: flagged per token, applied to
    # the top-n at the end. Elementwise, so that a tile pays no reduction for it.
    nan_tok = tl.maximum(nan_tok, (score != score).to(tl.int32))

    # Candidates: valid (j <= jt), not forced (0, jt - 1, jt): 1 <= j <= jt - 2.
    j = j0 + tl.arange(0, BS)
    cand = tok_ok[:, None] & (j >= 1)[None, :] & (j[None, :] <= jt[:, None] - 2)
    # Finite scores shift up by one so that a NaN or +inf (high half 0) ranks below every
    # finite score and above no candidate (docs/spec.md, "Non-finite values").
    finite = score < float("inf")
    bits = tl.where(finite, score.to(tl.int32, bitcast=True).to(tl.int64) + 1, 0)
    key = tl.where(cand, (bits << 32) | (j.to(tl.int64) ^ _LOW)[None, :], -1)
    # Merge only when some key beats the weakest kept one of its token.
    beats = tl.max(key, axis=1) > tl.min(run, axis=1)
    if tl.max(beats.to(tl.int32), axis=0) > 0:
        # The NP largest keys of the tile, ascending: the last NP of the sorted tile are
        # elementwise the largest of its NP-wide chunks.
        ordered = _bitonic(key, LOG_BT, LOG_BS, 0, False)
        top = tl.max(tl.reshape(ordered, (BT, BS // NP, NP)), axis=1)
        # run is descending, top ascending: their elementwise max holds the NP largest of
        # both and is bitonic, so one merge sorts it.
        run = _bitonic(tl.maximum(run, top), LOG_BT, LOG_NP, 1, True)
    return run, carry, nan_tok


@triton.jit
def score_topn_kernel(
    q_ptr,
    k_ptr,
    lse_ptr,
    idx_ptr,
    cnt_ptr,
    tiles_ptr,
    cu_ptr,
    cmp_cu_ptr,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_lb,
    stride_lt,
    stride_lh,
    stride_ib,
    stride_it,
    stride_ih,
    stride_cb,
    stride_ct,
    batch,
    tq,
    q_start,
    num_cmp,
    qk_scale,
    H: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    BT: tl.constexpr,
    DK: tl.constexpr,
    BK1: tl.constexpr,
    BK2: tl.constexpr,
    CMP_BLOCK: tl.constexpr,
    CMP_STRIDE: tl.constexpr,
    SEL: tl.constexpr,
    R: tl.constexpr,
    RP: tl.constexpr,
    REACH: tl.constexpr,
    BS: tl.constexpr,
    BL: tl.constexpr,
    NUM_SEL: tl.constexpr,
    NP: tl.constexpr,
    LOG_BT: tl.constexpr,
    LOG_BS: tl.constexpr,
    LOG_NP: tl.constexpr,
    HAS_LSE: tl.constexpr,
    VARLEN: tl.constexpr,
    USE_GATHER: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """indices [BT, n] and counts [BT] of BT query tokens for one kv head.

    Grid: (query tiles, H), query tiles ordered longest first (dense: the last tile of each
    batch row first; varlen: ``tiles_ptr`` rows (sequence, first token), sequence -1 = none).
    q [B, Tq, HQ, dk] and k_cmp [B, N, H, dk] have unit stride in dk; lse [B, Tq, HQ] float32
    (natural log) when HAS_LSE. dk is split into two
    power-of-two chunks BK1 + BK2 >= DK (BK2 = 0: one chunk), so dk = 192 runs as 128 + 64.
    Positions are int32; memory offsets int64.
    """
    i = tl.program_id(0)
    h = tl.program_id(1)
    if VARLEN:
        seq = tl.load(tiles_ptr + 2 * i)
        seq_c = tl.maximum(seq, 0)
        first = tl.load(cu_ptr + seq_c)
        t0 = tl.load(tiles_ptr + 2 * i + 1)
        row0 = first + t0
        seq_len = tl.load(cu_ptr + seq_c + 1) - first
        n_rows = tl.where(seq >= 0, tl.minimum(seq_len - t0, BT), 0)
        kbase = tl.load(cmp_cu_ptr + seq_c)
        n_cmp = tl.load(cmp_cu_ptr + seq_c + 1) - kbase
        b = i * 0
    else:
        # Later tiles walk more blocks: program 0 takes the last tile of each batch row.
        per_b = tl.cdiv(tq, BT)
        b = i % batch
        row0 = (per_b - 1 - i // batch) * BT
        t0 = row0 + q_start
        n_rows = tl.minimum(tq - row0, BT)
        kbase = i * 0
        n_cmp = kbase + num_cmp
    t_last = t0 + n_rows - 1
    # N_cmp(t + 1) (clamped at 0 below l - 1): blocks the first and the last token see.
    n_vis_first = tl.minimum(tl.maximum((t0 + 1 - CMP_BLOCK + CMP_STRIDE) // CMP_STRIDE, 0), n_cmp)
    n_vis = tl.minimum(tl.maximum((t_last + 1 - CMP_BLOCK + CMP_STRIDE) // CMP_STRIDE, 0), n_cmp)

    # Rows of the dots: token tok, head g of the group.
    BM: tl.constexpr = BT * GP
    rows = tl.arange(0, BM)
    tok = rows // GP
    g = rows % GP
    row_ok = (tok < n_rows) & (g < G)
    t_row = t0 + tok
    head = h * G + g
    q_rows = (
        q_ptr
        + b.to(tl.int64) * stride_qb
        + (row0 + tok).to(tl.int64) * stride_qt
        + head * stride_qh
    )
    d1 = tl.arange(0, BK1)
    q1 = tl.load(
        q_rows[:, None] + d1[None, :], mask=row_ok[:, None] & (d1 < DK)[None, :], other=0.0
    )
    q2 = q1
    if BK2 > 0:
        d2 = BK1 + tl.arange(0, BK2)
        q2 = tl.load(
            q_rows[:, None] + d2[None, :], mask=row_ok[:, None] & (d2 < DK)[None, :], other=0.0
        )
    k_head = k_ptr + b.to(tl.int64) * stride_kb + kbase.to(tl.int64) * stride_kt + h * stride_kh

    if HAS_LSE:
        lse_rows = (
            lse_ptr
            + b.to(tl.int64) * stride_lb
            + (row0 + tok).to(tl.int64) * stride_lt
            + head * stride_lh
        )
        lse2 = tl.load(lse_rows, mask=row_ok, other=float("-inf")) * _LOG2E
    else:
        m_i = tl.full([BM], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BM], dtype=tl.float32)
        # Blocks every row sees first (no masks), then the causal edge.
        seen_by_all = n_vis_first // BL * BL
        for c0 in range(0, seen_by_all, BL):
            m_i, l_i = _lse_tile(
                m_i, l_i, c0, q1, q2, k_head, stride_kt, t_row, n_vis, qk_scale,
                DK, BK1, BK2, BL, CMP_BLOCK, CMP_STRIDE, False, DOT_PREC,
            )  # fmt: skip
        for c0 in range(seen_by_all, n_vis, BL):
            m_i, l_i = _lse_tile(
                m_i, l_i, c0, q1, q2, k_head, stride_kt, t_row, n_vis, qk_scale,
                DK, BK1, BK2, BL, CMP_BLOCK, CMP_STRIDE, True, DOT_PREC,
            )  # fmt: skip
        # Rows that see no block keep l == 0: lse = -inf. A NaN sum (a visible NaN or +inf
        # logit) stays NaN, so the row scores NaN as the reference's softmax does.
        lse2 = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        lse2 = tl.where(l_i != l_i, l_i, lse2)
    # p = exp2(logit - lse2) is then exactly 0 on rows that are padding or see nothing.
    lse2 = tl.where(row_ok & (lse2 > float("-inf")), lse2, float("inf"))

    toks = tl.arange(0, BT)
    tok_ok = toks < n_rows
    jt = (t0 + toks) // SEL
    run = tl.full([BT, NP], -1, dtype=tl.int64)
    if REACH <= 1:
        p_prev = tl.zeros([BT, BS], dtype=tl.float32)
    else:
        p_prev = tl.zeros([BT, RP, BS], dtype=tl.float32)
    # Selection tiles whose owned blocks every row sees, then the rest up to the last jt.
    seen_by_all = n_vis_first // R // BS * BS
    sel_end = tl.where(n_rows > 0, t_last // SEL + 1, 0)
    nan_tok = tl.zeros([BT, BS], dtype=tl.int32)
    real_rows = g < G
    for j0 in range(0, seen_by_all, BS):
        run, p_prev, nan_tok = _score_tile(
            j0, run, p_prev, nan_tok, real_rows, q1, q2, k_head, stride_kt, lse2, t_row, tok_ok,
            jt, n_vis, qk_scale, DK, BK1, BK2, CMP_BLOCK, CMP_STRIDE, R, RP, REACH, BT, G, GP, BS,
            NP, LOG_BT, LOG_BS, LOG_NP, False, USE_GATHER, DOT_PREC,
        )  # fmt: skip
    for j0 in range(seen_by_all, sel_end, BS):
        run, p_prev, nan_tok = _score_tile(
            j0, run, p_prev, nan_tok, real_rows, q1, q2, k_head, stride_kt, lse2, t_row, tok_ok,
            jt, n_vis, qk_scale, DK, BK1, BK2, CMP_BLOCK, CMP_STRIDE, R, RP, REACH, BT, G, GP, BS,
            NP, LOG_BT, LOG_BS, LOG_NP, True, USE_GATHER, DOT_PREC,
        )  # fmt: skip

    # Forced blocks {0, jt - 1, jt} as a set (jt = 0: {0}; jt = 1: {0, 1}); the first
    # min(n, |F|) of them, then the n - |F| best candidates.
    num_forced = tl.minimum(jt, 2) + 1
    take_forced = tl.minimum(num_forced, NUM_SEL)
    free = tl.maximum(NUM_SEL - num_forced, 0)
    rank = tl.arange(0, NP)[None, :]
    from_run = (rank < free[:, None]) & (run >= 0)
    run_j = ((run & _LOW) ^ _LOW).to(tl.int32)
    # A token whose group has a row with a NaN normaliser scores NaN on every block: the
    # non-finite rule ranks them by ascending j, so its free slots take the lowest candidates
    # 1, 2, ..., jt - 2.
    nan_tok = tl.max(nan_tok, axis=1) > 0
    lowest = rank + 1
    from_lowest = (rank < free[:, None]) & (lowest <= jt[:, None] - 2)
    from_run = tl.where(nan_tok[:, None], from_lowest, from_run)
    run_j = tl.where(nan_tok[:, None], lowest, run_j)
    nth = rank - free[:, None]
    second = tl.where(jt >= 2, jt - 1, jt)[:, None]
    forced_j = tl.where(nth == 0, 0, tl.where(nth == 1, second, jt[:, None]))
    from_forced = (nth >= 0) & (nth < take_forced[:, None])
    out = tl.where(from_run, run_j, tl.where(from_forced, forced_j, _LOW))
    out = _bitonic(out, LOG_BT, LOG_NP, 0, False)
    count = tl.sum(from_run.to(tl.int32) + from_forced.to(tl.int32), axis=1)
    out_rows = b.to(tl.int64) * stride_ib + (row0 + toks).to(tl.int64) * stride_it + h * stride_ih
    tl.store(
        idx_ptr + out_rows[:, None] + rank,
        tl.where(out == _LOW, -1, out),
        mask=tok_ok[:, None] & (rank < NUM_SEL),
    )
    cnt_rows = b.to(tl.int64) * stride_cb + (row0 + toks).to(tl.int64) * stride_ct + h
    tl.store(cnt_ptr + cnt_rows, count, mask=tok_ok)
