# Triton kernels take untyped pointer/scalar parameters (types come from the launch), and
# triton.jit is untyped without triton installed: mypy checks only the plain Python here.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Block scoring and top-n of a decode step (docs/spec.md, "Selection scores", "Choosing blocks").

The compressed-attention programs leave, per tile of compressed keys, the running max ``m`` of
each head (base 2) and the band sums ``u[e, g, r] = sum_i c[i, r + e] * exp2(s[g, i] - m)`` over
the compressed blocks i of "range" r (the l'/d blocks that start inside selection block r),
split by how many selection blocks e past its own range block i reaches. With the head's
log-sum-exp ``lse`` over all chunks, selection block j scores

    S[j] = sum_g sum_e u[e, g, j - e] * exp2(m[tile(j - e), g] - lse[g])

which is Eq. 9-10: the group-summed compressed probabilities through the overlap weights.

Top-n works on int64 keys ``(float bits of S + 1) << 32 | (2^31 - 1 - j)``: scores are >= 0, so
their bits order like the floats, and among equal scores the lower j has the larger key (the
tie rule). Forced blocks carry the bits of +inf (plus 1), a non-finite score the high half 0
(below every finite score, docs/spec.md "Non-finite values"), invalid blocks the key -1.
``score_topn_kernel``
keeps the n best keys of each chunk of selection blocks; :func:`merge_topn` takes the n best
of all chunks' candidates, exactly the n best overall.
"""

# No `from __future__ import annotations`: the triton 3.0/3.1 interpreter reads a string
# annotation as a runtime argument, so `BG: tl.constexpr` would stop being a constant.

import triton
import triton.language as tl

from nsa_kernels.common.launch_chain import wait_for_prior_launch

# The kernels spell these out: 2^31 - 1 (the largest block key), 0x7F800000 (+inf's bits),
# 0xFFFFFFFF (the block half of a key). A constexpr on the left of a tensor operator stays a
# constexpr under the interpreter, so plain literals keep both backends equal.
MAX_BLOCK = 2147483647
# tl.topk (a partial bitonic sort: a few exchange rounds inside registers and warps) merges the
# chunks' candidates in less time than N dependent max-reductions over all of them
# (docs/results/2026-11-29-h200-decode-b32.md). Tritons without it take the reductions.
HAS_TOPK = tl.constexpr(hasattr(tl, "topk"))
# A scoring chunk sorts its keys with tl.topk too (measured faster than an all-pairs rank
# count, docs/results). Without it, a chunk of at most RANK_MAX_KEYS blocks ranks its keys by
# one all-pairs count ([JS, JS] comparisons in registers), a longer one takes N dependent
# max-reductions.
RANK_MAX_KEYS = tl.constexpr(64)


@triton.jit
def topn_keys(keys, N: tl.constexpr, NP: tl.constexpr):
    """The N largest of keys [M] (int64, distinct where >= 0): [NP] descending, then -1."""
    offs = tl.arange(0, NP)
    best_n = tl.full([NP], -1, tl.int64)
    for r in range(N):
        best = tl.max(keys, axis=0)
        best_n = tl.where(offs == r, best, best_n)
        keys = tl.where(keys == best, -1, keys)
    return best_n


@triton.jit
def topn_keys_by_rank(keys, N: tl.constexpr, NP: tl.constexpr):
    """The N largest of keys [M] (int64, distinct where >= 0), by rank: [NP], then -1.

    One all-pairs count instead of N dependent reductions: key i has rank
    ``#{j: keys[j] > keys[i]}`` and is kept when its rank is below N. Entry r of the result is
    the key of rank r. For small M only ([M, M] comparisons live in registers).
    """
    rank = tl.sum((keys[None, :] > keys[:, None]).to(tl.int32), axis=1)
    keep = (rank < N) & (keys >= 0)
    hit = keep[None, :] & (rank[None, :] == tl.arange(0, NP)[:, None])  # [NP, M]
    found = tl.sum(hit.to(tl.int32), axis=1) > 0
    return tl.where(found, tl.sum(tl.where(hit, keys[None, :], 0), axis=1), -1)


@triton.jit
def merge_topn(
    cand_ptr,
    bh,
    score_chunks,
    NSCP: tl.constexpr,
    N: tl.constexpr,
    NP: tl.constexpr,
):
    """The chosen blocks of (sequence, kv head) ``bh``: [NP] int32 ascending, -1 padded.

    ``cand [B*H, score_chunks, NP]`` holds each chunk's best keys, rewritten by every step (-1
    keys in the chunks past the sequence's length), so its load needs no length.
    """
    c = tl.arange(0, NSCP)[:, None]
    r = tl.arange(0, NP)[None, :]
    keys = tl.load(
        cand_ptr + (bh * score_chunks + c) * NP + r, mask=(c < score_chunks) & (r < N), other=-1
    )
    flat = tl.reshape(keys, (NSCP * NP,))
    if HAS_TOPK:
        # The keys are distinct where >= 0, so the NP largest, descending, are topn_keys' too.
        top = tl.where(tl.arange(0, NP) < N, tl.topk(flat, NP), -1)
    else:
        top = topn_keys(flat, N, NP)
    block = tl.where(top >= 0, 2147483647 - (top & 0xFFFFFFFF), 2147483647).to(tl.int32)
    # Ascending order by rank: entry i goes to slot #{blocks below it}; the missing ones
    # (2^31 - 1, all equal) rank after every chosen block and are written as -1.
    below = tl.sum((block[None, :] < block[:, None]).to(tl.int32), axis=1)  # [NP]
    slot = tl.arange(0, NP)
    placed = tl.sum(tl.where(below[None, :] == slot[:, None], block[None, :], 0), axis=1)
    count = tl.sum((block < 2147483647).to(tl.int32), axis=0)
    return tl.where(slot < count, placed, -1)


@triton.jit
def score_topn_kernel(
    u_ptr,
    tile_m_ptr,
    part_m_ptr,
    part_l_ptr,
    seqlens_ptr,
    num_cmp_ptr,
    cand_ptr,
    H: tl.constexpr,
    G: tl.constexpr,
    BG: tl.constexpr,
    slots,
    NCP: tl.constexpr,
    cmp_chunk,
    tiles,
    ranges,
    BN: tl.constexpr,
    R: tl.constexpr,
    EXTRA: tl.constexpr,
    SEL: tl.constexpr,
    JS: tl.constexpr,
    score_chunks,
    N: tl.constexpr,
    NP: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Scores of selection blocks ``[c*JS, (c+1)*JS)`` of one (sequence, kv head) and their n best.

    Grid: (B*H, score_chunks). Writes ``cand[bh, c, :NP]`` (keys, module docstring). The head's
    lse comes from the compressed partials ``part_m/part_l [B*H, slots, G]`` (the first
    ceil(N_cmp / cmp_chunk) slots), combined in slot order.
    """
    wait_for_prior_launch(PDL)
    bh = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    b = bh // H
    length = tl.load(seqlens_ptr + b)
    n_cmp = tl.load(num_cmp_ptr + b)
    t = length - 1
    jt = t // SEL

    # A chunk past the sequence's last block writes -1 keys and skips the scoring: in a ragged
    # batch, most chunks of the short sequences.
    best = tl.full([NP], -1, tl.int64)
    if c * JS <= jt:
        g = tl.arange(0, BG)
        g_in = g < G
        k = tl.arange(0, NCP)
        stat = (bh * slots + k[:, None]) * G + g[None, :]
        have = (k < tl.cdiv(n_cmp, cmp_chunk))[:, None] & g_in[None, :]
        m_k = tl.load(part_m_ptr + stat, mask=have, other=-1.0e30)
        l_k = tl.load(part_l_ptr + stat, mask=have, other=0.0)
        m_all = tl.max(m_k, axis=0)
        l_all = tl.sum(l_k * tl.exp2(m_k - m_all[None, :]), axis=0)
        seen = l_all > 0.0
        lse = tl.where(seen, m_all + tl.log2(tl.where(seen, l_all, 1.0)), 0.0)  # [BG], base 2

        j = c * JS + tl.arange(0, JS)
        score = tl.zeros([JS], dtype=tl.float32)
        for e in tl.static_range(EXTRA + 1):
            rng = j - e
            live = g_in[:, None] & ((rng >= 0) & (rng * R < n_cmp))[None, :]
            u = tl.load(
                u_ptr + ((bh * (EXTRA + 1) + e) * G + g[:, None]) * ranges + rng[None, :],
                mask=live,
                other=0.0,
            )
            tile = (rng * R) // BN
            m_t = tl.load(
                tile_m_ptr + (bh * tiles + tile[None, :]) * G + g[:, None], mask=live, other=0.0
            )
            score += tl.sum(tl.where(live, u * tl.exp2(m_t - lse[:, None]), 0.0), axis=0)

        valid = j <= jt
        forced = valid & ((j == 0) | (j == jt) | (j == jt - 1))
        # Scores are sums of non-negative terms; a -0.0 would carry the sign bit, so zero it.
        # Finite scores shift up by one so that a NaN or +inf (high half 0) ranks below them.
        finite = score < float("inf")
        bits = tl.where(score > 0.0, score.to(tl.int32, bitcast=True), 0) + 1
        bits = tl.where(finite, bits, 0)
        bits = tl.where(forced, 0x7F800001, bits)
        key = (bits.to(tl.int64) << 32) | (2147483647 - j).to(tl.int64)
        key = tl.where(valid, key, -1)
        if HAS_TOPK:
            best = tl.where(tl.arange(0, NP) < N, tl.topk(key, NP), -1)
        elif JS <= RANK_MAX_KEYS:
            best = topn_keys_by_rank(key, N, NP)
        else:
            best = topn_keys(key, N, NP)
    tl.store(cand_ptr + (bh * score_chunks + c) * NP + tl.arange(0, NP), best)
