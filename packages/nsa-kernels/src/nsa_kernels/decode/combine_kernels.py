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


@triton.jit
def _merge_branch(
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    part_n_ptr,
    bh,
    heads,
    head_ok,
    first,
    count,
    slots,
    G: tl.constexpr,
    HB: tl.constexpr,
    DV: tl.constexpr,
    BV: tl.constexpr,
    KT: tl.constexpr,
):
    """(o [HB, BV] float32, keys read) of ``heads`` [HB] over slots ``[first, first + count)``."""
    vcol = tl.arange(0, BV)
    m_run = tl.full([KT, HB], -1.0e30, dtype=tl.float32)
    for k0 in range(0, count, KT):
        k = k0 + tl.arange(0, KT)
        row = (bh * slots + first + k[:, None]) * G + heads[None, :]
        have = (k < count)[:, None] & head_ok[None, :]
        m_run = tl.maximum(m_run, tl.load(part_m_ptr + row, mask=have, other=-1.0e30))
    m_all = tl.max(m_run, axis=0)  # [HB]
    l_sum = tl.zeros([KT, HB], dtype=tl.float32)
    reads = tl.zeros([KT], dtype=tl.int32)
    acc = tl.zeros([HB, BV], dtype=tl.float32)
    for k0 in range(0, count, KT):
        k = k0 + tl.arange(0, KT)
        row = (bh * slots + first + k[:, None]) * G + heads[None, :]
        have = (k < count)[:, None] & head_ok[None, :]
        w = tl.exp2(tl.load(part_m_ptr + row, mask=have, other=-1.0e30) - m_all[None, :])
        l_sum += w * tl.load(part_l_ptr + row, mask=have, other=0.0)
        reads += tl.load(part_n_ptr + bh * slots + first + k, mask=k < count, other=0)
        part = tl.load(
            part_acc_ptr + row[:, :, None] * DV + vcol[None, None, :],
            mask=have[:, :, None] & (vcol < DV)[None, None, :],
            other=0.0,
        )
        acc += tl.sum(w[:, :, None] * part, axis=0)
    total = tl.sum(l_sum, axis=0)
    seen = total > 0.0
    o = tl.where(seen[:, None], acc / tl.where(seen, total, 1.0)[:, None], 0.0)
    return o, tl.sum(reads, axis=0)


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
    sel_splits,
    cmp_chunk,
    DV: tl.constexpr,
    BV: tl.constexpr,
    KT: tl.constexpr,
):
    """o = g0 * o_cmp + g1 * o_slc + g2 * o_win for HPC query heads of one kv head.

    Grid: (B*H, ceil(G / HPC)); program (bh, c) serves heads ``[c*HPC, (c+1)*HPC)`` of group h
    (HB = HPC rounded up to a power of two). gates ``[B, HQ, 3]`` and o ``[B, HQ, dv]``
    contiguous. Program c == 0 also writes the keys each branch read, ``reads [3, B, H]``
    (cmp, slc, win), summed from the partials. Compressed slots past ceil(N_cmp / cmp_chunk)
    were not written this step and are not read.
    """
    bh = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    b = bh // H
    h = bh % H
    hh = tl.arange(0, HB)
    heads = c * HPC + hh
    head_ok = (hh < HPC) & (heads < G)
    n_cmp = tl.load(num_cmp_ptr + b)
    o_cmp, n_cmp_read = _merge_branch(
        part_m_ptr, part_l_ptr, part_acc_ptr, part_n_ptr, bh, heads, head_ok,
        0, tl.cdiv(n_cmp, cmp_chunk), slots, G, HB, DV, BV, KT,
    )  # fmt: skip
    o_win, n_win_read = _merge_branch(
        part_m_ptr, part_l_ptr, part_acc_ptr, part_n_ptr, bh, heads, head_ok,
        cmp_chunks, win_chunks, slots, G, HB, DV, BV, KT,
    )  # fmt: skip
    o_slc, n_slc_read = _merge_branch(
        part_m_ptr, part_l_ptr, part_acc_ptr, part_n_ptr, bh, heads, head_ok,
        cmp_chunks + win_chunks, sel_splits, slots, G, HB, DV, BV, KT,
    )  # fmt: skip
    row = b * HQ + h * G + heads  # [HB] query-head rows
    gate = gates_ptr + row * 3
    g_cmp = tl.load(gate + 0, mask=head_ok, other=0.0).to(tl.float32)[:, None]
    g_slc = tl.load(gate + 1, mask=head_ok, other=0.0).to(tl.float32)[:, None]
    g_win = tl.load(gate + 2, mask=head_ok, other=0.0).to(tl.float32)[:, None]
    o = g_cmp * o_cmp + g_slc * o_slc + g_win * o_win
    vcol = tl.arange(0, BV)
    tl.store(
        o_ptr + row[:, None] * DV + vcol[None, :],
        o.to(o_ptr.dtype.element_ty),
        mask=head_ok[:, None] & (vcol < DV)[None, :],
    )
    first = c == 0
    tl.store(reads_ptr + bh, n_cmp_read, mask=first)
    tl.store(reads_ptr + batch * H + bh, n_slc_read, mask=first)
    tl.store(reads_ptr + 2 * batch * H + bh, n_win_read, mask=first)
