# Triton kernels take untyped pointer/scalar parameters (types come from the launch), and
# triton.jit is untyped without triton installed: mypy checks only the plain Python here.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""The split-K combine of a decode step: partial softmax states -> branch outputs -> gated o.

For one branch with partial states (m_k, l_k, acc_k) (attention_kernels.py), the output is
``sum_k exp2(m_k - M) acc_k / sum_k exp2(m_k - M) l_k`` with ``M = max_k m_k``, summed in slot
order in fixed-size tiles: the same inputs give the same bits on every run. A branch that saw
no key gives 0 (docs/spec.md, "Compressed branch": never NaN).
"""

# No `from __future__ import annotations`: the triton 3.0/3.1 interpreter reads a string
# annotation as a runtime argument, so `BG: tl.constexpr` would stop being a constant.

import triton
import triton.language as tl

from nsa_kernels.common.launch_chain import wait_for_prior_launch


@triton.jit
def _slot_branch(k, n_cmp_used, cmp_chunks, win_chunks, slots):
    """Branch of partial-state slot k [KT]: 0 compressed, 1 window, 2 selected, -1 unused.

    Compressed slots past the n_cmp_used chunks that hold blocks were not written this step.
    """
    win_end = cmp_chunks + win_chunks
    return tl.where(
        k < n_cmp_used,
        0,
        tl.where(
            (k >= cmp_chunks) & (k < win_end), 1, tl.where((k >= win_end) & (k < slots), 2, -1)
        ),
    )


@triton.jit
def _online_max_sum(M, L, m, denom, mine):
    """Running (max, sum of exp2(m - max) * denom) [HB] of one branch over a tile's slots
    ``mine``: m and denom [KT, HB] are the slots' partial maxima and softmax denominators."""
    tile_max = tl.max(tl.where(mine[:, None], m, -1.0e30), axis=0)
    new_max = tl.maximum(M, tile_max)
    w = tl.where(mine[:, None], tl.exp2(m - new_max[None, :]), 0.0)
    return new_max, L * tl.exp2(M - new_max) + tl.sum(w * denom, axis=0)


@triton.jit
def _slot_tile(
    part_m_ptr,
    k0,
    bh,
    heads,
    head_ok,
    n_cmp_used,
    cmp_chunks,
    win_chunks,
    slots,
    G: tl.constexpr,
    KT: tl.constexpr,
):
    """Slots k0 .. k0 + KT - 1 of kv head bh for the query heads ``heads`` [HB]: (k [KT], branch
    [KT], row [KT, HB] into the partial-state tables, have [KT, HB]: written and a real head,
    m [KT, HB]: the partial maxima, -1e30 where not ``have``). Both passes start so."""
    k = k0 + tl.arange(0, KT)
    branch = _slot_branch(k, n_cmp_used, cmp_chunks, win_chunks, slots)
    row = (bh * slots + k[:, None]) * G + heads[None, :]
    have = (branch >= 0)[:, None] & head_ok[None, :]
    m = tl.load(part_m_ptr + row, mask=have, other=-1.0e30)
    return k, branch, row, have, m


@triton.jit
def combine_kernel(
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    part_n_ptr,
    gates_ptr,
    o_ptr,
    num_cmp_ptr,
    reads_ptr,
    batch,
    H: tl.constexpr,
    G: tl.constexpr,
    HQ: tl.constexpr,
    HPC: tl.constexpr,
    HB: tl.constexpr,
    slots,
    cmp_chunks,
    win_chunks,
    cmp_chunk,
    DV: tl.constexpr,
    BV: tl.constexpr,
    KT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """o = g0 * o_cmp + g1 * o_sel + g2 * o_win for HPC query heads of one kv head.

    Grid: (B*H, ceil(G / HPC)); program (bh, c) serves heads ``[c*HPC, (c+1)*HPC)`` of group h
    (HB = HPC rounded up to a power of two). gates ``[B, HQ, 3]`` and o ``[B, HQ, dv]``
    contiguous. Program c == 0 also writes the keys each branch read, ``reads [3, B, H]``
    (cmp, sel, win), summed from the partials.

    Two passes over all slots of the three branches together, KT slots a tile (one tile when
    KT >= slots, the usual case): the first reads only the small (m, l, n) and gives each
    branch's max M and sum L; the second weighs every slot's acc by
    ``g_branch * exp2(m - M_branch) / L_branch`` and sums, so the step's latency is two rounds
    of loads whatever the number of branches. A branch with L = 0 saw no key and gives 0.
    """
    wait_for_prior_launch(PDL)
    bh = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    b = bh // H
    h = bh % H
    hh = tl.arange(0, HB)
    heads = c * HPC + hh
    head_ok = (hh < HPC) & (heads < G)
    row_q = b * HQ + h * G + heads  # [HB] query-head rows
    gate = gates_ptr + row_q * 3
    g_cmp = tl.load(gate + 0, mask=head_ok, other=0.0).to(tl.float32)
    g_sel = tl.load(gate + 1, mask=head_ok, other=0.0).to(tl.float32)
    g_win = tl.load(gate + 2, mask=head_ok, other=0.0).to(tl.float32)
    n_cmp_used = tl.cdiv(tl.load(num_cmp_ptr + b), cmp_chunk)

    m_cmp = tl.full([HB], -1.0e30, dtype=tl.float32)
    m_win = tl.full([HB], -1.0e30, dtype=tl.float32)
    m_sel = tl.full([HB], -1.0e30, dtype=tl.float32)
    l_cmp = tl.zeros([HB], dtype=tl.float32)
    l_win = tl.zeros([HB], dtype=tl.float32)
    l_sel = tl.zeros([HB], dtype=tl.float32)
    reads = tl.zeros([KT], dtype=tl.int32)
    reads_cmp = tl.zeros([KT], dtype=tl.int32)
    reads_win = tl.zeros([KT], dtype=tl.int32)
    for k0 in range(0, slots, KT):
        k, branch, row, have, m = _slot_tile(
            part_m_ptr, k0, bh, heads, head_ok, n_cmp_used, cmp_chunks, win_chunks, slots, G, KT
        )
        denom = tl.load(part_l_ptr + row, mask=have, other=0.0)
        n = tl.load(part_n_ptr + bh * slots + k, mask=branch >= 0, other=0)
        m_cmp, l_cmp = _online_max_sum(m_cmp, l_cmp, m, denom, branch == 0)
        m_win, l_win = _online_max_sum(m_win, l_win, m, denom, branch == 1)
        m_sel, l_sel = _online_max_sum(m_sel, l_sel, m, denom, branch == 2)
        reads += n
        reads_cmp += tl.where(branch == 0, n, 0)
        reads_win += tl.where(branch == 1, n, 0)

    # Per branch: g / L where the branch saw a key, else 0 (its output is 0, never NaN).
    s_cmp = tl.where(l_cmp > 0.0, g_cmp / tl.where(l_cmp > 0.0, l_cmp, 1.0), 0.0)
    s_win = tl.where(l_win > 0.0, g_win / tl.where(l_win > 0.0, l_win, 1.0), 0.0)
    s_sel = tl.where(l_sel > 0.0, g_sel / tl.where(l_sel > 0.0, l_sel, 1.0), 0.0)
    vcol = tl.arange(0, BV)
    o = tl.zeros([HB, BV], dtype=tl.float32)
    for k0 in range(0, slots, KT):
        _, branch, row, have, m = _slot_tile(
            part_m_ptr, k0, bh, heads, head_ok, n_cmp_used, cmp_chunks, win_chunks, slots, G, KT
        )
        part = tl.load(
            part_acc_ptr + row[:, :, None] * DV + vcol[None, None, :],
            mask=have[:, :, None] & (vcol < DV)[None, None, :],
            other=0.0,
        )
        is_cmp = (branch == 0)[:, None]
        is_win = (branch == 1)[:, None]
        top = tl.where(is_cmp, m_cmp[None, :], tl.where(is_win, m_win[None, :], m_sel[None, :]))
        scale = tl.where(is_cmp, s_cmp[None, :], tl.where(is_win, s_win[None, :], s_sel[None, :]))
        weight = tl.where(have, scale * tl.exp2(m - top), 0.0)  # [KT, HB]
        o += tl.sum(weight[:, :, None] * part, axis=0)
    tl.store(
        o_ptr + row_q[:, None] * DV + vcol[None, :],
        o.to(o_ptr.dtype.element_ty),
        mask=head_ok[:, None] & (vcol < DV)[None, :],
    )
    first = c == 0
    n_cmp_read = tl.sum(reads_cmp, axis=0)
    n_win_read = tl.sum(reads_win, axis=0)
    tl.store(reads_ptr + bh, n_cmp_read, mask=first)
    tl.store(
        reads_ptr + batch * H + bh, tl.sum(reads, axis=0) - n_cmp_read - n_win_read, mask=first
    )
    tl.store(reads_ptr + 2 * batch * H + bh, n_win_read, mask=first)
