# Triton kernels take untyped pointer/scalar parameters (types come from the launch), and
# triton.jit is untyped without triton installed: mypy checks only the plain Python here.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Split-K attention of a decode step: partial softmax states of the three branches.

One query token per sequence; the G query heads of kv head h form the rows of every ``tl.dot``
(padded to BG >= 16). Each program covers a slice of one branch's keys for one (sequence b,
kv head h), ``bh = b*H + h``, and leaves a partial state in slot ``slot`` of the workspace:

- ``part_m [B*H, slots, G]``: running max of the base-2 logits ``s = q.k * scale * log2(e)``;
- ``part_l [B*H, slots, G]``: ``sum exp2(s - m)`` over the slice's keys;
- ``part_acc [B*H, slots, G, dv]``: ``sum exp2(s - m) * v``;
- ``part_n [B*H, slots]``: how many keys entered the softmax (the reads).

Slots: ``[0, cmp_chunks)`` compressed chunks, then ``win_chunks`` window chunks, then the
selected splits up to ``slots``; combine_kernels.py merges them in slot order. Buffers are
contiguous: q ``[B, HQ, dk]``, cache buffers ``[B, rows, H, D]``.
"""

# No `from __future__ import annotations`: the triton 3.0/3.1 interpreter reads a string
# annotation as a runtime argument, so `BG: tl.constexpr` would stop being a constant.

import triton
import triton.language as tl

from nsa_kernels.common.launch_chain import wait_for_prior_launch
from nsa_kernels.common.online_softmax import online_softmax_step
from nsa_kernels.decode.topn_kernels import merge_topn


@triton.jit
def _load_q(
    q_ptr, b, h,
    HQ: tl.constexpr, G: tl.constexpr, BG: tl.constexpr, DK: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """q [BG, BK] of the G heads of kv head h (padding rows and columns are 0)."""
    g = tl.arange(0, BG)
    col = tl.arange(0, BK)
    return tl.load(
        q_ptr + (b * HQ + h * G + g[:, None]) * DK + col[None, :],
        mask=(g < G)[:, None] & (col < DK)[None, :],
        other=0.0,
    )


@triton.jit
def _attend_tile(
    q, k_ptr, v_ptr, key_rows, live, h, m_i, l_i, acc, qk_scale,
    H: tl.constexpr, DK: tl.constexpr, BK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
    DOT_PREC: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over the keys at rows ``key_rows`` [BN] (``b*rows + row``).

    Returns (p [BG, BN], m, l, acc); p = exp2(s - m) with the updated m, 0 where not live.
    """
    col = tl.arange(0, BK)
    kt = tl.load(
        k_ptr + (key_rows * H + h)[:, None] * DK + col[None, :],
        mask=live[:, None] & (col < DK)[None, :],
        other=0.0,
    )
    s = tl.dot(q, tl.trans(kt), input_precision=DOT_PREC) * qk_scale
    s = tl.where(live[None, :], s, float("-inf"))
    m_new, alpha, p, l_i = online_softmax_step(m_i, l_i, s)
    vcol = tl.arange(0, BV)
    vt = tl.load(
        v_ptr + (key_rows * H + h)[:, None] * DV + vcol[None, :],
        mask=live[:, None] & (vcol < DV)[None, :],
        other=0.0,
    )
    acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PREC)
    return p, m_new, l_i, acc


@triton.jit
def _store_partial(
    part_m_ptr, part_l_ptr, part_acc_ptr, part_n_ptr, bh, slot, m_i, l_i, acc, count, slots,
    G: tl.constexpr, BG: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """A slice's partial state to slot ``slot`` of (b, h) = ``bh``: m and l [G], acc [G, dv]
    and ``count``, the keys that entered its softmax."""
    g = tl.arange(0, BG)
    vcol = tl.arange(0, BV)
    row = (bh * slots + slot) * G + g
    tl.store(part_m_ptr + row, m_i, mask=g < G)
    tl.store(part_l_ptr + row, l_i, mask=g < G)
    tl.store(
        part_acc_ptr + row[:, None] * DV + vcol[None, :],
        acc,
        mask=(g < G)[:, None] & (vcol < DV)[None, :],
    )
    tl.store(part_n_ptr + bh * slots + slot, count)


@triton.jit
def _store_band_sums(
    p, m_i, tile_m_ptr, u_ptr, bh, tile, tiles, ranges,
    G: tl.constexpr, BG: tl.constexpr, BN: tl.constexpr, R: tl.constexpr,
    EXTRA: tl.constexpr, LCMP: tl.constexpr, DSTRIDE: tl.constexpr, SEL: tl.constexpr,
):  # fmt: skip
    """The score terms of one tile of compressed blocks (topn_kernels.py).

    ``tile_m [B*H, tiles, G]`` = m (the max p is relative to); ``u [B*H, EXTRA+1, G, ranges]``:
    block i = tile*BN + rr*R + r starts r*d into selection block tile*BN/R + rr (its "range"),
    so relative to that block it covers [r*d, r*d + l) and overlaps selection block range + e
    by w_e[r] units of d.
    """
    g = tl.arange(0, BG)
    RPT: tl.constexpr = BN // R  # ranges per tile
    tl.store(tile_m_ptr + (bh * tiles + tile) * G + g, m_i, mask=g < G)
    p3 = tl.reshape(p, (BG, RPT, R))
    r = tl.arange(0, R)
    rng = tile * RPT + tl.arange(0, RPT)
    for e in tl.static_range(EXTRA + 1):
        lo = tl.maximum(r * DSTRIDE, e * SEL)
        hi = tl.minimum(r * DSTRIDE + LCMP, (e + 1) * SEL)
        w = tl.maximum(hi - lo, 0).to(tl.float32) / DSTRIDE
        u = tl.sum(p3 * w[None, None, :], axis=2)
        tl.store(
            u_ptr + ((bh * (EXTRA + 1) + e) * G + g[:, None]) * ranges + rng[None, :],
            u,
            mask=(g < G)[:, None],
        )


@triton.jit
def cmp_window_kernel(
    q_ptr, k_cmp, v_cmp, k_win, v_win, seqlens_ptr, num_cmp_ptr,
    tile_m_ptr, u_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, part_n_ptr,
    cmp_rows, qk_scale, slots, cmp_chunks, chunk_tiles, tiles, ranges,
    H: tl.constexpr, HQ: tl.constexpr, G: tl.constexpr, BG: tl.constexpr,
    DK: tl.constexpr, BK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, BN: tl.constexpr,
    R: tl.constexpr, EXTRA: tl.constexpr, LCMP: tl.constexpr, DSTRIDE: tl.constexpr,
    SEL: tl.constexpr, WINDOW: tl.constexpr, WC: tl.constexpr, DOT_PREC: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """The branches that need no selection: grid (B*H, cmp_chunks + window chunks).

    Slot ``s < cmp_chunks``: compressed blocks ``[s*chunk_tiles*BN, (s+1)*chunk_tiles*BN)``
    that are visible (``i < num_cmp[b]``, after this step's append), leaving the score terms of
    every tile; it writes its partial only when it saw a block. Slot ``cmp_chunks + c``: window
    positions ``[start + c*WC, start + (c+1)*WC)`` of ``[start, L)``, ``start = max(0, L - w)``,
    token p at ring row ``p % w``; it always writes its partial (l = 0 when empty).

    Both kinds share one loop over BN keys ("x": block index or position) so the program holds
    one copy of the attention tile.
    """
    wait_for_prior_launch(PDL)
    bh = tl.program_id(0).to(tl.int64)
    slot = tl.program_id(1)
    b = bh // H
    h = bh % H
    q = _load_q(q_ptr, b, h, HQ, G, BG, DK, BK)
    is_cmp = slot < cmp_chunks
    if is_cmp:
        lo = slot * chunk_tiles * BN
        hi = tl.minimum(lo + chunk_tiles * BN, tl.load(num_cmp_ptr + b))
        k_base = k_cmp
        v_base = v_cmp
        rows = cmp_rows
        ring = 2147483647  # x % ring == x: compressed block i sits at row i
    else:
        length = tl.load(seqlens_ptr + b)
        lo = tl.maximum(length - WINDOW, 0) + (slot - cmp_chunks) * WC
        hi = tl.minimum(lo + WC, length)
        k_base = k_win
        v_base = v_win
        rows = WINDOW
        ring = WINDOW
    m_i = tl.full([BG], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BG], dtype=tl.float32)
    acc = tl.zeros([BG, BV], dtype=tl.float32)
    count = hi * 0
    for x0 in range(lo, hi, BN):
        x = x0 + tl.arange(0, BN)
        live = x < hi
        p, m_i, l_i, acc = _attend_tile(
            q, k_base, v_base, b * rows + x % ring, live, h, m_i, l_i, acc, qk_scale,
            H, DK, BK, DV, BV, DOT_PREC,
        )  # fmt: skip
        count += tl.sum(live.to(tl.int32), axis=0)
        if is_cmp:
            _store_band_sums(
                p, m_i, tile_m_ptr, u_ptr, bh, x0 // BN, tiles, ranges,
                G, BG, BN, R, EXTRA, LCMP, DSTRIDE, SEL,
            )  # fmt: skip
    if (not is_cmp) or (lo < hi):
        _store_partial(
            part_m_ptr, part_l_ptr, part_acc_ptr, part_n_ptr, bh, slot, m_i, l_i, acc, count,
            slots, G, BG, DV, BV,
        )  # fmt: skip


@triton.jit
def selected_kernel(
    q_ptr, k_sel, v_sel, cand_ptr, seqlens_ptr, indices_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr, part_n_ptr,
    block_table_ptr, pages_per_seq, capacity, qk_scale,
    PAGE: tl.constexpr, H: tl.constexpr, HQ: tl.constexpr, G: tl.constexpr, BG: tl.constexpr,
    DK: tl.constexpr, BK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
    slots, sel_slot0,
    SEL: tl.constexpr, BL: tl.constexpr, NSUB: tl.constexpr, BPS: tl.constexpr,
    BPSP: tl.constexpr,
    score_chunks, NSCP: tl.constexpr, N: tl.constexpr, NP: tl.constexpr, DOT_PREC: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Selected branch: grid (B*H, splits); split s attends to the chosen blocks of ranks
    ``[s*BPS, (s+1)*BPS)``.

    Every split merges the chunk candidates itself (the same n blocks, ascending), which costs
    less than a launch; split 0 writes them to ``indices [B, H, N]``. A block's tokens past the
    query (``p > t``) are masked (docs/spec.md, "Selected branch"). With PAGE > 0 the selected
    K/V are pages of PAGE tokens (``block_table [B, pages_per_seq]``), else rows
    ``b * capacity + p``. BPSP: BPS rounded up to a power of two.
    """
    wait_for_prior_launch(PDL)
    bh = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    b = bh // H
    h = bh % H
    # q, the length and the candidates load at once: none waits for another.
    q = _load_q(q_ptr, b, h, HQ, G, BG, DK, BK)
    length = tl.load(seqlens_ptr + b)
    t = length - 1
    chosen = merge_topn(cand_ptr, bh, score_chunks, NSCP, N, NP)
    offs = tl.arange(0, NP)
    tl.store(indices_ptr + bh * N + offs, chosen, mask=offs < tl.where(split == 0, N, 0))

    m_i = tl.full([BG], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BG], dtype=tl.float32)
    acc = tl.zeros([BG, BV], dtype=tl.float32)
    count = length * 0
    # Pages of whole blocks (page size a multiple of l'): each block lies in one page.
    WHOLE_PAGES: tl.constexpr = PAGE > 0 and PAGE % SEL == 0
    if WHOLE_PAGES:
        # This split's pages [BPSP] in one load before the loop, so that the loop's K/V loads
        # depend on no load of their own.
        mine = split * BPS + tl.arange(0, BPSP)
        mine_blocks = tl.sum(tl.where(offs[None, :] == mine[:, None], chosen[None, :], 0), axis=1)
        mine_live = (mine < N) & (mine < (split + 1) * BPS) & (mine_blocks >= 0)
        mine_pages = tl.load(
            block_table_ptr + b * pages_per_seq + tl.maximum(mine_blocks, 0) * SEL // PAGE,
            mask=mine_live,
            other=0,
        )
    # One loop over (block, sub-tile), not two nested ones: Triton pipelines the innermost loop
    # only, so the next block's K/V loads go out while this one is attended.
    for it in range(BPS * NSUB):
        rank = split * BPS + it // NSUB
        block = tl.sum(tl.where(offs == rank, chosen, 0), axis=0)
        block = tl.where(rank < N, block, -1)
        in_block = (it % NSUB) * BL + tl.arange(0, BL)
        pos = tl.maximum(block, 0) * SEL + in_block
        # block as a block tensor: triton 3.9's interpreter turns scalar & block into int32.
        live = ((block + tl.zeros_like(in_block)) >= 0) & (in_block < SEL) & (pos <= t)
        if WHOLE_PAGES:
            page = tl.sum(tl.where(tl.arange(0, BPSP) == it // NSUB, mine_pages, 0), axis=0)
            rows = page.to(tl.int64) * PAGE + pos % PAGE
        elif PAGE > 0:
            page = tl.load(block_table_ptr + b * pages_per_seq + pos // PAGE, mask=live, other=0)
            rows = page.to(tl.int64) * PAGE + pos % PAGE
        else:
            rows = b * capacity + pos
        _, m_i, l_i, acc = _attend_tile(
            q, k_sel, v_sel, rows, live, h, m_i, l_i, acc, qk_scale,
            H, DK, BK, DV, BV, DOT_PREC,
        )  # fmt: skip
        count += tl.sum(live.to(tl.int32), axis=0)
    _store_partial(
        part_m_ptr, part_l_ptr, part_acc_ptr, part_n_ptr, bh, sel_slot0 + split,
        m_i, l_i, acc, count, slots, G, BG, DV, BV,
    )  # fmt: skip
