# Triton kernels take untyped pointer/scalar parameters (types come from the launch), and
# triton.jit is untyped without triton installed: mypy checks only the plain Python here.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Backward kernels of the compressed branch (FA-2 style, no atomics: bitwise reproducible).

With p = exp2(qk_scale * q.k - lse * log2(e)) recomputed from the forward's lse and
delta = rowsum(o * do):  dv = p^T do,  ds = p * (do v^T - delta),  dq = scale * ds k,
dk = scale * ds^T q.

- ``cmp_bwd_dq_kernel``: the forward's query tiles; walks the visible key tiles, writes dq,
  delta and lse2, the forward's lse in base 2 as the exponent takes it (the dk/dv kernel reads
  both, so it runs second: each of its steps loads rows that every key tile loads again, and
  the conversion would cost each step a multiply, a compare and a select per row and thread).
- ``cmp_bwd_dkv_kernel``: one program per (key tile of BN blocks, kv head, query segment). The
  queries that see a block are a suffix of its sequence; that suffix is cut into segments of
  ``seg_rows`` rows (absolute row ranges ``[j * seg_rows, (j+1) * seg_rows)``) so that the
  early blocks, seen by almost every query, spread over several programs. A key tile whose
  queries fit one segment stores dk/dv directly; otherwise each segment stores float32
  partials and ``cmp_dkv_reduce_kernel`` sums them in segment order.

WINDOWED (the sliding branch, l = d = 1): a query also sees no key before its window, and a key
tile's queries end where their windows stop reaching it (:func:`dkv_tile`).

Rows that see nothing and padding rows get lse = +inf here, so their p is exactly 0.
"""

from __future__ import annotations

import triton
import triton.language as tl

from nsa_kernels.common.key_rows import load_key_rows, store_key_grads
from nsa_kernels.compressed.triton_fwd import LOG2E, group_rows, load_group_rows, query_tile_rows
from nsa_kernels.compressed.triton_tiles import (
    key_stretch,
    key_tile,
    visible_blocks,
    window_start,
)

# Plain module floats are not visible inside @jit; constexpr globals are.
_LOG2E = tl.constexpr(LOG2E)


@triton.jit
def _load_lse2(lse_rows, row_ok):
    """The forward's lse [BM] of the rows at ``lse_rows`` in base 2, +inf where it is -inf (the
    row sees nothing) or the row is not ``row_ok``: there p = exp2(s - lse2) is exactly 0."""
    lse = tl.load(lse_rows, mask=row_ok, other=float("-inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse * _LOG2E)


@triton.jit
def _dq_key_tile(
    q, do, lse2, delta, dq, k_head, v_head, key_row, n0, n_hi, nvis, nlo,
    stride_kt, stride_vt, qk_scale,
    DK: tl.constexpr, BK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, BN: tl.constexpr,
    MASK: tl.constexpr, WINDOWED: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """dq [BM, BK] (unscaled) plus the contribution of blocks [n0, n0 + BN) (MASK, nvis, nlo as
    in the forward's ``_fwd_key_tile``)."""
    offs_n = tl.arange(0, BN)
    blocks = n0 + offs_n
    k_rows = key_row + offs_n.to(tl.int64)
    live = blocks < n_hi
    kt = load_key_rows(k_head, k_rows, stride_kt, live, DK, BK, MASK)
    vt = load_key_rows(v_head, k_rows, stride_vt, live, DV, BV, MASK)
    s = tl.dot(q, tl.trans(kt), input_precision=DOT_PREC) * qk_scale
    p = tl.exp2(s - lse2[:, None])
    if MASK:
        seen = blocks[None, :] < nvis[:, None]
        if WINDOWED:
            seen = seen & (blocks[None, :] >= nlo[:, None])
        p = tl.where(seen, p, 0.0)
    dp = tl.dot(do, tl.trans(vt), input_precision=DOT_PREC)
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(kt.dtype), kt, dq, input_precision=DOT_PREC)


@triton.jit
def cmp_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, delta_ptr, lse2_ptr, dq_ptr,
    tiles_ptr, cu_ptr, cmp_cu_ptr,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
    batch, tq, q_start, num_kv_heads, window, qk_scale, scale,
    G: tl.constexpr, HPP: tl.constexpr, TPP: tl.constexpr, NCH: tl.constexpr, BM: tl.constexpr,
    DK: tl.constexpr, BK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
    LBLK: tl.constexpr, DSTR: tl.constexpr, BN: tl.constexpr,
    VARLEN: tl.constexpr, WINDOWED: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """dq [BM, DK], delta and lse2 [BM] of one query tile (the forward's tiling and grid).

    ``q``/``dq`` share strides, as do ``o``/``do`` and ``lse``/``delta``/``lse2`` [B, Tq, HQ].
    """
    b, kvh, kbase, rows, row_ok, heads, nvis, n_hi, n_full, nlo, n_start, n_open = (
        query_tile_rows(
            tiles_ptr, cu_ptr, cmp_cu_ptr, batch, tq, q_start, num_kv_heads, window,
            G, HPP, TPP, NCH, BM, LBLK, DSTR, BN, VARLEN, WINDOWED,
        )
    )  # fmt: skip

    offs_k = tl.arange(0, BK)
    offs_v = tl.arange(0, BV)
    q_rows = b * stride_qb + rows[:, None] * stride_qt + heads[:, None] * stride_qh
    qk_mask = row_ok[:, None] & (offs_k < DK)[None, :]
    q = tl.load(q_ptr + q_rows + offs_k[None, :], mask=qk_mask, other=0.0)
    o_rows = b * stride_ob + rows[:, None] * stride_ot + heads[:, None] * stride_oh
    ov_mask = row_ok[:, None] & (offs_v < DV)[None, :]
    do = tl.load(do_ptr + o_rows + offs_v[None, :], mask=ov_mask, other=0.0)
    o = tl.load(o_ptr + o_rows + offs_v[None, :], mask=ov_mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    stat = b * stride_lb + rows * stride_lt + heads
    tl.store(delta_ptr + stat, delta, mask=row_ok)
    lse2 = _load_lse2(lse_ptr + stat, row_ok)
    tl.store(lse2_ptr + stat, lse2, mask=row_ok)

    k_head = k_ptr + b * stride_kb + kvh * stride_kh
    v_head = v_ptr + b * stride_vb + kvh * stride_vh
    dq = tl.zeros([BM, BK], dtype=tl.float32)
    # The forward's three stretches of key tiles (triton_tiles.key_stretch).
    for stretch in tl.static_range(3):
        if WINDOWED or stretch > 0:
            lo, hi = key_stretch(stretch, n_start, n_open, n_full, n_hi)
            for n0 in range(lo, hi, BN):
                dq = _dq_key_tile(
                    q, do, lse2, delta, dq, k_head, v_head, kbase + n0, n0, n_hi, nvis, nlo,
                    stride_kt, stride_vt, qk_scale,
                    DK, BK, DV, BV, BN, stretch != 1, WINDOWED, DOT_PREC,
                )  # fmt: skip
    tl.store(
        dq_ptr + q_rows + offs_k[None, :], (dq * scale).to(dq_ptr.dtype.element_ty), mask=qk_mask
    )


@triton.jit
def _dkv_query_tile(
    kt, vt, dk, dv, blocks, q_ptr, do_ptr, lse2_ptr, delta_ptr,
    b, kvh, start, seg_hi, chunk, shift, window,
    stride_qb, stride_qt, stride_qh, stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
    qk_scale,
    G: tl.constexpr, HPP: tl.constexpr, TPQ: tl.constexpr, BMQ: tl.constexpr,
    DK: tl.constexpr, BK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
    LBLK: tl.constexpr, DSTR: tl.constexpr, MASK: tl.constexpr, WINDOWED: tl.constexpr,
    DOT_PREC: tl.constexpr,
):  # fmt: skip
    """dk, dv [BN, *] plus the contribution of query rows [start, start + TPQ) x head chunk.

    Computed transposed (blocks on the rows): st = k q^T [BN, BMQ]. MASK: some query row does
    not see every block of the tile (WINDOWED: from below as well).
    """
    _, rows, row_ok, heads = group_rows(start, seg_hi, chunk, kvh, G, HPP, TPQ, BMQ)
    qt = load_group_rows(q_ptr, b, rows, heads, row_ok, stride_qb, stride_qt, stride_qh, DK, BK)
    dot_ = load_group_rows(do_ptr, b, rows, heads, row_ok, stride_ob, stride_ot, stride_oh, DV, BV)
    stat = b * stride_lb + rows * stride_lt + heads
    # +inf on padding rows too: p = exp2(s - lse2) is exactly 0 there.
    lse2 = tl.load(lse2_ptr + stat, mask=row_ok, other=float("inf"))
    delta = tl.load(delta_ptr + stat, mask=row_ok, other=0.0)

    st = tl.dot(kt, tl.trans(qt), input_precision=DOT_PREC) * qk_scale
    pt = tl.exp2(st - lse2[None, :])
    if MASK:
        nvis = visible_blocks(rows - shift, LBLK, DSTR)
        seen = blocks[:, None] < nvis[None, :]
        if WINDOWED:
            seen = seen & (blocks[:, None] >= window_start(rows - shift, window)[None, :])
        pt = tl.where(seen, pt, 0.0)
    dv = tl.dot(pt.to(dot_.dtype), dot_, dv, input_precision=DOT_PREC)
    dpt = tl.dot(vt, tl.trans(dot_), input_precision=DOT_PREC)
    dst = pt * (dpt - delta[None, :])
    dk = tl.dot(dst.to(qt.dtype), qt, dk, input_precision=DOT_PREC)
    return dk, dv


@triton.jit
def dkv_tile(
    tiles_ptr, cu_ptr, cmp_cu_ptr, tile, batch, tq, q_start, num_blocks, seg_rows, window,
    LBLK: tl.constexpr, DSTR: tl.constexpr, BN: tl.constexpr, VARLEN: tl.constexpr,
    WINDOWED: tl.constexpr,
):  # fmt: skip
    """(b, n0, n_end, kbase, shift, row_first, r_end, j_lo, j_hi) of key tile ``tile``: the
    facts of :func:`key_tile` and the query segments that see it.

    row_first: first row that sees block n0 (clamped to [r_lo, r_end]); its queries are the rows
    [row_first, r_end), covered by segments j_lo .. j_hi (j_hi < j_lo when there are none).
    WINDOWED: r_end comes back lowered to one past the last row whose window reaches the tile.
    """
    b, n0, n_end, kbase, r_lo, r_end, shift = key_tile(
        tiles_ptr, cu_ptr, cmp_cu_ptr, tile, batch, tq, q_start, num_blocks, BN, VARLEN
    )
    if WINDOWED:
        r_end = tl.maximum(tl.minimum(r_end, n0 + BN + window - 1 + shift), r_lo)
    row_first = tl.minimum(tl.maximum(n0 * DSTR + LBLK - 1 + shift, r_lo), r_end)
    j_lo = row_first // seg_rows
    j_hi = tl.where(row_first < r_end, (r_end - 1) // seg_rows, j_lo - 1)
    return b, n0, n_end, kbase, shift, row_first, r_end, j_lo, j_hi


@triton.jit
def cmp_bwd_dkv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse2_ptr, delta_ptr, dk_ptr, dv_ptr, dk_part_ptr, dv_part_ptr,
    tiles_ptr, cu_ptr, cmp_cu_ptr,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh, stride_ob, stride_ot, stride_oh, stride_lb, stride_lt,
    batch, tq, q_start, num_blocks, num_kv_heads, num_tiles, num_segs, seg_rows, window,
    qk_scale, scale,
    G: tl.constexpr, HPP: tl.constexpr, TPQ: tl.constexpr, NCH: tl.constexpr, BMQ: tl.constexpr,
    DK: tl.constexpr, BK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
    LBLK: tl.constexpr, DSTR: tl.constexpr, BN: tl.constexpr,
    VARLEN: tl.constexpr, WINDOWED: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """dk [BN, DK], dv [BN, DV] of one key tile of one kv head, over one query segment.

    k/dk share strides, as do v/dv, q (its strides also index the query rows of dq's layout),
    do, and lse2/delta (lse2: the dq kernel's, base 2, +inf on rows that see nothing).
    Partials: dk_part [num_tiles * H * num_segs, BN, BK] float32 (dv_part likewise with BV),
    entry ``(tile * H + kvh) * num_segs + j``. Grid: (num_segs * num_tiles * H,), program
    p -> kv head ``p % H``, tile ``(p // H) % num_tiles``,
    segment ``num_segs - 1 - p // (H * num_tiles)`` (the last segments are the fullest).
    """
    pid = tl.program_id(0)
    kvh = pid % num_kv_heads
    rest = pid // num_kv_heads
    tile = rest % num_tiles
    j = num_segs - 1 - rest // num_tiles
    b, n0, n_end, kbase, shift, row_first, r_end, j_lo, j_hi = dkv_tile(
        tiles_ptr, cu_ptr, cmp_cu_ptr, tile, batch, tq, q_start, num_blocks, seg_rows, window,
        LBLK, DSTR, BN, VARLEN, WINDOWED,
    )  # fmt: skip
    split = j_hi > j_lo
    # A tile no query sees still owns its (zero) gradient rows: segment 0 writes them.
    direct = ((j_hi == j_lo) & (j == j_lo)) | ((j_hi < j_lo) & (j == 0))
    active = (j >= j_lo) & (j <= j_hi)
    seg_lo = tl.maximum(j * seg_rows, row_first)
    seg_hi = tl.minimum((j + 1) * seg_rows, r_end)
    n_iter = tl.where(active, tl.cdiv(seg_hi - seg_lo, TPQ), 0)
    # Rows from row_full on see the tile's last block, hence all of it.
    row_full = (n0 + BN - 1) * DSTR + LBLK - 1 + shift
    n_masked = tl.minimum(tl.maximum(tl.cdiv(row_full - seg_lo, TPQ), 0), n_iter)
    if WINDOWED:
        # A row's window also leaves the tile's first blocks behind: every step masks.
        n_masked = n_iter

    blocks = n0 + tl.arange(0, BN)
    live = blocks < n_end
    k_rows = (kbase + blocks).to(tl.int64)
    offs_k = tl.arange(0, BK)
    offs_v = tl.arange(0, BV)
    k_off = b * stride_kb + k_rows[:, None] * stride_kt + kvh * stride_kh + offs_k[None, :]
    v_off = b * stride_vb + k_rows[:, None] * stride_vt + kvh * stride_vh + offs_v[None, :]
    kd_mask = live[:, None] & (offs_k < DK)[None, :]
    vd_mask = live[:, None] & (offs_v < DV)[None, :]
    kt = tl.load(k_ptr + k_off, mask=kd_mask, other=0.0)
    vt = tl.load(v_ptr + v_off, mask=vd_mask, other=0.0)

    dk = tl.zeros([BN, BK], dtype=tl.float32)
    dv = tl.zeros([BN, BV], dtype=tl.float32)
    # Two walks over the segment's (token step, head chunk) pairs: first the steps some of
    # whose rows do not see the whole tile (masked), then the rest (unmasked).
    for walk in tl.static_range(2):
        it_lo = 0
        it_hi = n_masked * NCH
        if walk == 1:
            it_lo = n_masked * NCH
            it_hi = n_iter * NCH
        for it in range(it_lo, it_hi):
            dk, dv = _dkv_query_tile(
                kt, vt, dk, dv, blocks, q_ptr, do_ptr, lse2_ptr, delta_ptr,
                b, kvh, seg_lo + (it // NCH) * TPQ, seg_hi, it % NCH, shift, window,
                stride_qb, stride_qt, stride_qh, stride_ob, stride_ot, stride_oh,
                stride_lb, stride_lt, qk_scale,
                G, HPP, TPQ, BMQ, DK, BK, DV, BV, LBLK, DSTR, walk == 0, WINDOWED, DOT_PREC,
            )  # fmt: skip
    dk = dk * scale

    # A block mask, not scalar & block: triton 3.9's interpreter makes the latter int32.
    direct_k = (direct.to(tl.int32) + tl.zeros_like(k_off)) > 0
    direct_v = (direct.to(tl.int32) + tl.zeros_like(v_off)) > 0
    tl.store(dk_ptr + k_off, dk.to(dk_ptr.dtype.element_ty), mask=kd_mask & direct_k)
    tl.store(dv_ptr + v_off, dv.to(dv_ptr.dtype.element_ty), mask=vd_mask & direct_v)
    part = ((tile * num_kv_heads + kvh) * num_segs + j).to(tl.int64)
    offs_n = tl.arange(0, BN)
    keep = ((split & active).to(tl.int32) + tl.zeros_like(offs_n)[:, None]) > 0
    tl.store(
        dk_part_ptr + (part * BN + offs_n[:, None]) * BK + offs_k[None, :],
        dk,
        mask=(offs_n < BN)[:, None] & keep,
    )
    tl.store(
        dv_part_ptr + (part * BN + offs_n[:, None]) * BV + offs_v[None, :],
        dv,
        mask=(offs_n < BN)[:, None] & keep,
    )


@triton.jit
def cmp_dkv_reduce_kernel(
    dk_ptr, dv_ptr, dk_part_ptr, dv_part_ptr, tiles_ptr, cu_ptr, cmp_cu_ptr,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    batch, tq, q_start, num_blocks, num_kv_heads, num_segs, seg_rows, window,
    DK: tl.constexpr, BK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
    LBLK: tl.constexpr, DSTR: tl.constexpr, BN: tl.constexpr,
    VARLEN: tl.constexpr, WINDOWED: tl.constexpr,
):  # fmt: skip
    """Sum, in segment order, the partials of one key tile split over several segments.

    Grid: (num_tiles * H,), program p -> tile ``p // H``, kv head ``p % H``. Tiles that were not
    split were written by ``cmp_bwd_dkv_kernel``; their programs store nothing.
    """
    pid = tl.program_id(0)
    kvh = pid % num_kv_heads
    tile = pid // num_kv_heads
    b, n0, n_end, kbase, _, _, _, j_lo, j_hi = dkv_tile(
        tiles_ptr, cu_ptr, cmp_cu_ptr, tile, batch, tq, q_start, num_blocks, seg_rows, window,
        LBLK, DSTR, BN, VARLEN, WINDOWED,
    )  # fmt: skip
    split = j_hi > j_lo
    j_stop = tl.where(split, j_hi + 1, j_lo)
    offs_n = tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    offs_v = tl.arange(0, BV)
    dk = tl.zeros([BN, BK], dtype=tl.float32)
    dv = tl.zeros([BN, BV], dtype=tl.float32)
    for j in range(j_lo, j_stop):
        part = ((tile * num_kv_heads + kvh) * num_segs + j).to(tl.int64)
        dk += tl.load(dk_part_ptr + (part * BN + offs_n[:, None]) * BK + offs_k[None, :])
        dv += tl.load(dv_part_ptr + (part * BN + offs_n[:, None]) * BV + offs_v[None, :])
    blocks = n0 + offs_n
    # split folded into a block mask: triton 3.9's interpreter turns scalar & block into int32.
    live = (blocks < n_end) & ((split.to(tl.int32) + tl.zeros_like(offs_n)) > 0)
    k_rows = (kbase + blocks).to(tl.int64)
    store_key_grads(
        dk_ptr, dv_ptr, dk, dv, b, kvh, k_rows, live,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
        DK=DK, BK=BK, DV=DV, BV=BV,
    )  # fmt: skip
