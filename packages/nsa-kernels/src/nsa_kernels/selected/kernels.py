# Triton kernels take untyped pointer/scalar parameters (types come from the launch), and
# triton.jit is untyped without triton installed: mypy checks only the plain Python here.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Triton kernels of the selected branch, forward and backward side by side.

Notation (docs/spec.md): a query row at position t of kv head h serves the G query heads of that
group; it attends to the tokens p of its selected blocks (block j covers ``[j*l', (j+1)*l')``)
with ``p <= t``. Softmax runs in base 2: ``qk_scale = scale * log2(e)`` and ``lse`` is stored in
natural log, so ``p = exp2(qk_scale * q.k - lse * log2(e))``.

Kernels:
- ``block_set_kernel``: the index rows as sets (ascending, repeats and out-of-range entries -1).
- ``sel_fwd_kernel``: one program per (query row, kv head[, head chunk][, dv chunk]); loads each
  selected K/V block once for all G heads (rows padded to BG >= 16 for ``tl.dot``).
- ``sel_bwd_dq_kernel``: the same walk, recomputing p from lse; writes dq and delta = rowsum(o*do).
- ``sel_bwd_dkv_kernel``: one program per work segment of one (key block, kv head): a slice of the
  queries that selected the block (the CSR of csr.py), gathered TPI tokens x G heads at a time.
- ``sel_dkv_reduce_kernel``: sums the fp32 partials of blocks split over several segments, in a
  fixed order, so gradients are bitwise reproducible (no atomics anywhere).
"""

# No `from __future__ import annotations`: the triton 3.0/3.1 interpreter reads a string
# annotation as a runtime argument, so `B: tl.constexpr` would stop being a constant.
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# The kernels see these as compile-time constants (plain module floats are not visible to @jit).
_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(LN2)

# Integer fields of one dk/dv work segment (rows of the int64 table csr.py builds).
SEG_B, SEG_H, SEG_KROW0, SEG_KEND, SEG_POS0, SEG_START, SEG_END, SEG_PART, SEG_TSHIFT = range(9)
SEG_FIELDS = 9
# Fields of one multi-segment block for the reduction: b, h, key row 0, key end, first part, parts.
RED_FIELDS = 6

# tl.gather arrived in triton 3.3; before it, block_set_kernel finds left neighbours with a scan.
_HAS_GATHER = tl.constexpr(hasattr(tl, "gather"))


@triton.jit
def _last_two(prev_a, last_a, prev_b, last_b):
    """Combine of a scan over (entry before the last, last entry); -1 stands for none."""
    return tl.where(prev_b < 0, last_a, prev_b), last_b


@triton.jit
def block_set_kernel(
    idx_ptr,
    out_ptr,
    n_rows,
    nsel,
    num_blocks,
    NP: tl.constexpr,
    ROWS: tl.constexpr,
):
    """out [ROWS, nsel] int32: each index row as a set, ascending, then -1.

    Entries outside [0, num_blocks) and repeats of an earlier entry become -1. The range test runs
    in the input's integer type, before the int32 cast, so large int64 values cannot wrap into
    range. Rows are padded to NP (a power of two) with a key that sorts last.
    """
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, NP)
    inside = (rows < n_rows)[:, None] & (cols < nsel)[None, :]
    offs = rows[:, None] * nsel + cols[None, :]
    x = tl.load(idx_ptr + offs, mask=inside, other=-1)
    pad = 2147483647
    key = tl.sort(tl.where((x >= 0) & (x < num_blocks), x, pad).to(tl.int32), dim=1)
    # A sorted row holds a repeat where an entry equals its left neighbour; a second sort moves
    # the repeats behind the distinct entries.
    if _HAS_GATHER:
        left = tl.gather(key, tl.maximum(cols - 1, 0)[None, :].broadcast_to(ROWS, NP), axis=1)
        repeat = (cols > 0)[None, :] & (key == left)
    else:
        # Keys are >= 0, so the -1 that the first entry of each row keeps never matches.
        none = tl.full([ROWS, NP], -1, dtype=tl.int32)
        left, _ = tl.associative_scan((none, key), axis=1, combine_fn=_last_two)
        repeat = key == left
    key = tl.sort(tl.where(repeat, pad, key), dim=1)
    tl.store(out_ptr + offs, tl.where(key == pad, -1, key), mask=inside)


@triton.jit
def sel_fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    lse_ptr,
    idx_ptr,
    seq_ptr,
    cu_ptr,
    k_desc,
    v_desc,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_ob,
    stride_ot,
    stride_oh,
    stride_lb,
    stride_lt,
    stride_ib,
    stride_it,
    stride_ih,
    n_rows,
    tq,
    tk,
    q_start,
    nsel,
    qk_scale,
    G: tl.constexpr,
    HPP: tl.constexpr,
    BG: tl.constexpr,
    DK: tl.constexpr,
    BK: tl.constexpr,
    NK: tl.constexpr,
    DV: tl.constexpr,
    BV: tl.constexpr,
    SEL: tl.constexpr,
    BL: tl.constexpr,
    NSUB: tl.constexpr,
    RPP: tl.constexpr,
    KV_HINT: tl.constexpr,
    VARLEN: tl.constexpr,
    DOT_PREC: tl.constexpr,
    TMA: tl.constexpr,
):
    """o [BG, BV] and lse [BG] of one query row for HPP heads of one kv head's group.

    Grid: (ceil(rows / RPP), H * ceil(G / HPP), ceil(DV / BV)). Axis 0 varies fastest, so the
    programs in flight share one kv head and its K/V stays in L2 (KV_HINT="evict_last" asks L2
    to keep K/V over the streamed q and o).

    TMA (NK == 1, BK == DK, BV == DV): K/V tiles come through tensor descriptors over
    k, v viewed as [B * Tk, H * D]; a tile is loaded whole (the visibility mask applies to s, and
    selects zeros for V's invisible rows), rows past the end read as 0.
    """
    pid_h = tl.program_id(1)
    pid_v = tl.program_id(2)
    NCH: tl.constexpr = (G + HPP - 1) // HPP
    h = pid_h // NCH
    chunk = pid_h - h * NCH
    # RPP consecutive rows per program: rows of one query block share their forced blocks
    # (0, jt-1, jt), which the second row then finds in L1.
    for rr in range(RPP):
        row = tl.minimum(tl.program_id(0).to(tl.int64) * RPP + rr, n_rows - 1)
        if VARLEN:
            # Packed sequences: row indexes T directly; tok0 is the sequence's first token.
            tok0 = tl.load(cu_ptr + tl.load(seq_ptr + row)).to(tl.int64)
            b = row * 0
            r = row
            t = row - tok0
        else:
            b = row // tq
            r = row - b * tq
            t = r + q_start
            tok0 = row * 0

        offs_g = tl.arange(0, BG)
        g_in = chunk * HPP + offs_g
        g_mask = (offs_g < HPP) & (g_in < G)
        heads = h * G + g_in
        offs_l = tl.arange(0, BL)
        offs_v = pid_v * BV + tl.arange(0, BV)
        v_mask = offs_v < DV
        offs_k = tl.arange(0, BK)

        q_row = q_ptr + b * stride_qb + r * stride_qt + heads[:, None] * stride_qh
        k_head = k_ptr + b * stride_kb + tok0 * stride_kt + h * stride_kh
        v_head = v_ptr + b * stride_vb + tok0 * stride_vt + h * stride_vh
        idx_row = idx_ptr + b * stride_ib + r * stride_it + h * stride_ih

        if NK == 1:
            q = tl.load(
                q_row + offs_k[None, :], mask=g_mask[:, None] & (offs_k < DK)[None, :], other=0.0
            )

        m_i = tl.full([BG], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BG], dtype=tl.float32)
        acc = tl.zeros([BG, BV], dtype=tl.float32)
        for it in range(nsel * NSUB):
            i = it // NSUB
            j = it - i * NSUB
            blk = tl.load(idx_row + i).to(tl.int32)
            in_blk = j * BL + offs_l
            pos = tl.maximum(blk, 0) * SEL + in_blk
            # blk tested as a block: `scalar_bool & block_bool` comes out int32 under the
            # triton 3.9 interpreter, which then refuses it as a load mask.
            live = (blk + tl.zeros_like(in_blk) >= 0) & (in_blk < SEL) & (pos <= t)
            k_rows = k_head + pos.to(tl.int64)[:, None] * stride_kt
            if TMA:
                kv_row = (b * tk + tok0 + tl.maximum(blk, 0) * SEL + j * BL).to(tl.int32)
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
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if TMA:
                # The whole tile arrives, keys the row cannot see included (later tokens of the
                # block, the next sequence's first ones, block 0 under a -1 slot). Their p is 0,
                # but 0 * NaN = NaN: select exact zeros so a bad V reaches only the rows that
                # see it (docs/spec.md, "Non-finite values"), as the masked loads below do.
                vt = v_desc.load([kv_row, (h * DV).to(tl.int32)])
                vt = tl.where(live[:, None], vt, tl.zeros_like(vt))
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
        o_rows = o_ptr + b * stride_ob + r * stride_ot + heads[:, None] * stride_oh
        tl.store(
            o_rows + offs_v[None, :],
            o.to(o_ptr.dtype.element_ty),
            mask=g_mask[:, None] & v_mask[None, :],
        )
        if pid_v == 0:
            lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * _LN2, float("-inf"))
            tl.store(lse_ptr + b * stride_lb + r * stride_lt + heads, lse, mask=g_mask)


@triton.jit
def sel_bwd_dq_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dq_ptr,
    idx_ptr,
    seq_ptr,
    cu_ptr,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_ob,
    stride_ot,
    stride_oh,
    stride_db,
    stride_dt,
    stride_dh,
    stride_lb,
    stride_lt,
    stride_ib,
    stride_it,
    stride_ih,
    n_rows,
    tq,
    q_start,
    nsel,
    qk_scale,
    scale,
    G: tl.constexpr,
    HPP: tl.constexpr,
    BG: tl.constexpr,
    DK: tl.constexpr,
    BK: tl.constexpr,
    DV: tl.constexpr,
    BV: tl.constexpr,
    SEL: tl.constexpr,
    BL: tl.constexpr,
    NSUB: tl.constexpr,
    RPP: tl.constexpr,
    KV_HINT: tl.constexpr,
    VARLEN: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """dq [BG, BK] and delta [BG] of one query row for HPP heads of one kv head's group.

    ``q``/``dq`` share strides, as do ``o``/``do``, and ``lse``/``delta``. Grid:
    (ceil(rows / RPP), H * NCH).
    """
    pid_h = tl.program_id(1)
    NCH: tl.constexpr = (G + HPP - 1) // HPP
    h = pid_h // NCH
    chunk = pid_h - h * NCH
    # RPP consecutive rows per program: rows of one query block share their forced blocks
    # (0, jt-1, jt), which the second row then finds in L1.
    for rr in range(RPP):
        row = tl.minimum(tl.program_id(0).to(tl.int64) * RPP + rr, n_rows - 1)
        if VARLEN:
            # Packed sequences: row indexes T directly; tok0 is the sequence's first token.
            tok0 = tl.load(cu_ptr + tl.load(seq_ptr + row)).to(tl.int64)
            b = row * 0
            r = row
            t = row - tok0
        else:
            b = row // tq
            r = row - b * tq
            t = r + q_start
            tok0 = row * 0

        offs_g = tl.arange(0, BG)
        g_in = chunk * HPP + offs_g
        g_mask = (offs_g < HPP) & (g_in < G)
        heads = h * G + g_in
        offs_l = tl.arange(0, BL)
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
        lse2 = tl.where(lse > float("-inf"), lse * _LOG2E, 0.0)

        k_head = k_ptr + b * stride_kb + tok0 * stride_kt + h * stride_kh
        v_head = v_ptr + b * stride_vb + tok0 * stride_vt + h * stride_vh
        idx_row = idx_ptr + b * stride_ib + r * stride_it + h * stride_ih

        dq = tl.zeros([BG, BK], dtype=tl.float32)
        for it in range(nsel * NSUB):
            i = it // NSUB
            j = it - i * NSUB
            blk = tl.load(idx_row + i).to(tl.int32)
            in_blk = j * BL + offs_l
            pos = tl.maximum(blk, 0) * SEL + in_blk
            live = (blk + tl.zeros_like(in_blk) >= 0) & (in_blk < SEL) & (pos <= t)
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
def sel_bwd_dkv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dk_ptr,
    dv_ptr,
    dk_part_ptr,
    dv_part_ptr,
    seg_ptr,
    csr_ptr,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_ob,
    stride_ot,
    stride_oh,
    stride_lb,
    stride_lt,
    qk_scale,
    scale,
    G: tl.constexpr,
    R: tl.constexpr,
    TPI: tl.constexpr,
    DK: tl.constexpr,
    BK: tl.constexpr,
    DV: tl.constexpr,
    BV: tl.constexpr,
    SEL: tl.constexpr,
    BL: tl.constexpr,
    SELP: tl.constexpr,
    SEG_FIELDS: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """dk, dv [BL, *] of key sub-tile ``program_id(1)`` of one segment's block.

    A segment is a slice ``[start, end)`` of the CSR rows of one (batch, kv head, key block); its
    query rows are processed TPI at a time as R = TPI * G (padded) rows of one ``tl.dot``. ``dk``
    go to k's and v's layout, or, when the block is split over several segments, to the fp32
    partials ``dk_part [P, SELP, BK]`` / ``dv_part [P, SELP, BV]`` at row ``part``.
    """
    seg = seg_ptr + tl.program_id(0).to(tl.int64) * SEG_FIELDS
    j = tl.program_id(1)
    b = tl.load(seg + 0)
    h = tl.load(seg + 1)
    krow0 = tl.load(seg + 2)
    kend = tl.load(seg + 3)
    pos0 = tl.load(seg + 4)
    start = tl.load(seg + 5)
    end = tl.load(seg + 6)
    part = tl.load(seg + 7)
    tshift = tl.load(seg + 8)

    in_blk = j * BL + tl.arange(0, BL)
    krow = krow0 + in_blk
    kvalid = (in_blk < SEL) & (krow < kend)
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
        lse2 = tl.load(lse_ptr + stat, mask=rvalid, other=0.0) * _LOG2E
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
        tl.store(
            dk_ptr + b * stride_kb + krow[:, None] * stride_kt + h * stride_kh + offs_k[None, :],
            dk.to(dk_ptr.dtype.element_ty),
            mask=kvalid[:, None] & k_mask[None, :],
        )
        tl.store(
            dv_ptr + b * stride_vb + krow[:, None] * stride_vt + h * stride_vh + offs_v[None, :],
            dv.to(dv_ptr.dtype.element_ty),
            mask=kvalid[:, None] & v_mask[None, :],
        )
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
    dk_ptr,
    dv_ptr,
    dk_part_ptr,
    dv_part_ptr,
    red_ptr,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    DK: tl.constexpr,
    BK: tl.constexpr,
    DV: tl.constexpr,
    BV: tl.constexpr,
    SEL: tl.constexpr,
    BL: tl.constexpr,
    SELP: tl.constexpr,
    RED_FIELDS: tl.constexpr,
):
    """Sum, in part order, the fp32 partials of one block split over several segments."""
    red = red_ptr + tl.program_id(0).to(tl.int64) * RED_FIELDS
    j = tl.program_id(1)
    b = tl.load(red + 0)
    h = tl.load(red + 1)
    krow0 = tl.load(red + 2)
    kend = tl.load(red + 3)
    first = tl.load(red + 4)
    count = tl.load(red + 5)
    in_blk = j * BL + tl.arange(0, BL)
    krow = krow0 + in_blk
    kvalid = (in_blk < SEL) & (krow < kend)
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
    tl.store(
        dk_ptr + b * stride_kb + krow[:, None] * stride_kt + h * stride_kh + offs_k[None, :],
        dk.to(dk_ptr.dtype.element_ty),
        mask=kvalid[:, None] & (offs_k < DK)[None, :],
    )
    tl.store(
        dv_ptr + b * stride_vb + krow[:, None] * stride_vt + h * stride_vh + offs_v[None, :],
        dv.to(dv_ptr.dtype.element_ty),
        mask=kvalid[:, None] & (offs_v < DV)[None, :],
    )


@triton.jit
def quick_fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    cu_ptr,
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kl,
    stride_vn,
    stride_vl,
    stride_on,
    stride_oh,
    num_keys,
    qk_scale,
    H: tl.constexpr,
    BH: tl.constexpr,
    D: tl.constexpr,
    BD: tl.constexpr,
    DV: tl.constexpr,
    BDV: tl.constexpr,
    BL: tl.constexpr,
    VARLEN: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """o [H, DV] of row n: its H heads attend, unmasked, to the keys of row n's range."""
    n = tl.program_id(0).to(tl.int64)
    if VARLEN:
        lo = tl.load(cu_ptr + n).to(tl.int64)
        hi = tl.load(cu_ptr + n + 1).to(tl.int64)
        k_row = k_ptr
        v_row = v_ptr
    else:
        lo = n * 0
        hi = lo + num_keys
        k_row = k_ptr + n * stride_kn
        v_row = v_ptr + n * stride_vn
    offs_h = tl.arange(0, BH)
    offs_d = tl.arange(0, BD)
    offs_v = tl.arange(0, BDV)
    offs_l = tl.arange(0, BL)
    h_mask = offs_h < H
    q = tl.load(
        q_ptr + n * stride_qn + offs_h[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None] & (offs_d < D)[None, :],
        other=0.0,
    )
    m_i = tl.full([BH], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, BDV], dtype=tl.float32)
    for start in range(lo, hi, BL):
        keys = start + offs_l
        live = keys < hi
        kt = tl.load(
            k_row + keys[:, None] * stride_kl + offs_d[None, :],
            mask=live[:, None] & (offs_d < D)[None, :],
            other=0.0,
        )
        s = tl.dot(q, tl.trans(kt), input_precision=DOT_PREC) * qk_scale
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt = tl.load(
            v_row + keys[:, None] * stride_vl + offs_v[None, :],
            mask=live[:, None] & (offs_v < DV)[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PREC)
        m_i = m_new
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        o_ptr + n * stride_on + offs_h[:, None] * stride_oh + offs_v[None, :],
        o.to(o_ptr.dtype.element_ty),
        mask=h_mask[:, None] & (offs_v < DV)[None, :],
    )


@triton.jit
def gather_probe_kernel(
    k_ptr,
    v_ptr,
    idx_ptr,
    out_ptr,
    k_desc,
    v_desc,
    stride_kt,
    stride_vt,
    stride_it,
    nsel,
    H: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    SEL: tl.constexpr,
    BL: tl.constexpr,
    ROWS: tl.constexpr,
    DOT: tl.constexpr,
    TMA: tl.constexpr,
):
    """Bandwidth probe (benches only): the forward's K/V block reads without its softmax.

    Per (row, kv head) of a B == 1 problem it loads the selected blocks as ``sel_fwd_kernel``
    does and feeds them to dots with a constant [ROWS, BL] operand (DOT: pipelined like the
    forward's loads) or merely sums them; its time is the floor of a gather-bound forward.
    TMA: the tiles come through descriptors over k, v as [T, H * D] (whole tiles, no mask).
    """
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_l = tl.arange(0, BL)
    offs_k = tl.arange(0, DK)
    offs_v = tl.arange(0, DV)
    ones = tl.full([ROWS, BL], 1.0, dtype=k_ptr.dtype.element_ty)
    acc_k = tl.zeros([ROWS, DK], dtype=tl.float32)
    acc_v = tl.zeros([ROWS, DV], dtype=tl.float32)
    NSUB: tl.constexpr = SEL // BL
    for it in range(nsel * NSUB):
        i = it // NSUB
        j = it - i * NSUB
        blk = tl.load(idx_ptr + row * stride_it + h * nsel + i)
        pos = tl.maximum(blk, 0) * SEL + j * BL + offs_l
        live = (blk + tl.zeros_like(pos) >= 0) & (pos <= row)
        if TMA:
            kv_row = (tl.maximum(blk, 0) * SEL + j * BL).to(tl.int32)
            kt = k_desc.load([kv_row, h * DK])
            vt = v_desc.load([kv_row, h * DV])
        else:
            kt = tl.load(
                k_ptr + pos.to(tl.int64)[:, None] * stride_kt + h * DK + offs_k[None, :],
                mask=live[:, None],
                other=0.0,
            )
            vt = tl.load(
                v_ptr + pos.to(tl.int64)[:, None] * stride_vt + h * DV + offs_v[None, :],
                mask=live[:, None],
                other=0.0,
            )
        if DOT:
            acc_k = tl.dot(ones, kt, acc_k)
            acc_v = tl.dot(ones, vt, acc_v)
        else:
            acc_k += tl.sum(kt.to(tl.float32), 0)[None, :]
            acc_v += tl.sum(vt.to(tl.float32), 0)[None, :]
    out = out_ptr + (row * H + h) * (DK + DV)
    tl.store(out + offs_k, tl.sum(acc_k, 0))
    tl.store(out + DK + offs_v, tl.sum(acc_v, 0))
