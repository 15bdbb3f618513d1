"""CPU checks of the index mappings behind the FA-2 adapters and the torch fallbacks.

Each mapping is compared with the masks written straight from docs/spec.md:
compressed: query t sees block i iff ``i*d + l - 1 <= t``; sliding: ``max(0, t-w+1) <= p <= t``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from fa2_testing import cu_seqlens_of

from nsa_core.blocks import cmp_cu_seqlens, num_cmp_blocks
from nsa_kernels.common.flex import interval_block_tables
from nsa_kernels.common.intervals import (
    compressed_intervals,
    compressed_intervals_varlen,
    num_visible_cmp,
    sliding_intervals,
    sliding_intervals_varlen,
)
from nsa_kernels.common.sdpa import _chunks
from nsa_kernels.compressed.cmp_fold import dense_fold, fold_heads, unfold_heads, varlen_fold

BLOCK_CONFIGS = [(1, 1), (2, 1), (4, 2), (8, 4), (32, 16), (12, 4), (16, 16)]  # (l, d) as (cl, d)


def spec_cmp_mask(positions: torch.Tensor, num_blocks: int, cl: int, d: int) -> torch.Tensor:
    i = torch.arange(num_blocks)
    return (i * d + cl - 1).unsqueeze(0) <= positions.unsqueeze(1)


def fa2_causal_keep(row: torch.Tensor, rows: int, num_keys: int, width: int) -> torch.Tensor:
    """FA-2 bottom-right causal: row m keeps key j < num_keys iff j <= m + num_keys - rows."""
    j = torch.arange(width).unsqueeze(0)
    return (j <= (row + num_keys - rows).unsqueeze(1)) & (j < num_keys)


@pytest.mark.parametrize(("cl", "d"), BLOCK_CONFIGS)
def test_num_visible_matches_n_cmp(cl: int, d: int) -> None:
    t = torch.arange(0, 200)
    expected = torch.tensor([num_cmp_blocks(int(x) + 1, cl, d) for x in t])
    assert torch.equal(num_visible_cmp(t, cl, d), expected)


@pytest.mark.parametrize(("cl", "d"), BLOCK_CONFIGS)
def test_residue_class_offsets(cl: int, d: int) -> None:
    """The brief's statement: t = r + m*d sees blocks i <= m - l/d + [r == d-1]."""
    for t in range(0, 150):
        m, r = divmod(t, d)
        last_visible = m - cl // d + (1 if r == d - 1 else 0)
        assert int(num_visible_cmp(torch.tensor(t), cl, d)) - 1 == max(last_visible, -1)


@pytest.mark.parametrize(("cl", "d"), BLOCK_CONFIGS)
def test_dense_fold_reproduces_the_compressed_mask(cl: int, d: int) -> None:
    for tq, q_start in itertools.product([1, 2, 5, 17, 64, 97], [0, 1, 3, 15, 16, 31, 40, 130]):
        fold = dense_fold(tq, q_start, cl, d)
        assert fold.front + tq + fold.back == fold.rows * d
        assert 0 <= fold.front < d
        assert 0 <= fold.back < d
        needed = num_cmp_blocks(q_start + tq, cl, d)
        assert max(fold.num_keys, 0) == needed
        width = max(needed, 1)
        row = (fold.front + torch.arange(tq)) // d
        keep = fa2_causal_keep(row, fold.rows, max(fold.num_keys, 0), width)
        spec = spec_cmp_mask(torch.arange(q_start, q_start + tq), width, cl, d)
        spec &= torch.arange(width).unsqueeze(0) < needed
        assert torch.equal(keep, spec), (tq, q_start)


@pytest.mark.parametrize(("cl", "d"), BLOCK_CONFIGS)
@pytest.mark.parametrize("dense", [False, True])
def test_varlen_fold_reproduces_the_compressed_mask(cl: int, d: int, dense: bool) -> None:
    lengths = [0, 1, cl - 1, cl, cl + 1, 3 * cl + d - 1, 5, 2 * cl + 7, 0]
    cu = cu_seqlens_of(lengths)
    fold = varlen_fold(cu, cl, d, dense=dense)
    assert torch.equal(fold.cu_keys, cmp_cu_seqlens(cu, cl, d))
    num_seq = len(lengths)
    rows = (fold.cu_rows[1:] - fold.cu_rows[:-1]).tolist()
    keys = (fold.cu_keys[1:] - fold.cu_keys[:-1]).tolist()
    assert rows == [n // d + 1 for n in lengths]
    # Every query slot is distinct and lies inside its sequence's rows.
    assert len(set(fold.slot.tolist())) == fold.slot.numel()
    total_keys = int(fold.cu_keys[-1])
    assert len(set(fold.key_slot.tolist())) == total_keys
    for s in range(num_seq):
        t0, t1 = int(cu[s]), int(cu[s + 1])
        if dense:
            row_start, key_start = s * fold.max_rows, s * fold.max_keys
            seq_rows, seq_keys = fold.max_rows, fold.max_keys
        else:
            row_start, key_start = int(fold.cu_rows[s]), int(fold.cu_keys[s])
            seq_rows, seq_keys = rows[s], keys[s]
        key_range = fold.key_slot[int(fold.cu_keys[s]) : int(fold.cu_keys[s + 1])]
        assert torch.equal(key_range, torch.arange(key_start, key_start + keys[s]))
        if t1 == t0:
            continue
        slots = fold.slot[t0:t1]
        assert torch.equal(slots, torch.arange(row_start * d + 1, row_start * d + 1 + t1 - t0))
        row = slots // d - row_start
        width = max(seq_keys, 1)
        keep = fa2_causal_keep(row, seq_rows, seq_keys, width)
        # A dense batch pads keys after each sequence; real queries must never reach them.
        spec = spec_cmp_mask(torch.arange(t1 - t0), width, cl, d)
        spec &= torch.arange(width).unsqueeze(0) < keys[s]
        assert torch.equal(keep, spec), (s, lengths[s])


@pytest.mark.parametrize(("h", "g", "d"), [(1, 1, 1), (2, 3, 4), (4, 2, 16), (3, 1, 2)])
def test_fold_heads_round_trip_and_gqa_pairing(h: int, g: int, d: int) -> None:
    rows, dim = 3, 5
    x = torch.randn(2, rows * d, h * g, dim)
    y = fold_heads(x, h, d)
    assert y.shape == (2, rows, h * d * g, dim)
    assert torch.equal(unfold_heads(y, h, d), x)
    # Folded head i must come from kv head i // (d*G), as FA-2's GQA assumes.
    for m, r, kv, gi in itertools.product(range(rows), range(d), range(h), range(g)):
        folded = kv * d * g + r * g + gi
        assert folded // (d * g) == kv
        assert torch.equal(y[:, m, folded], x[:, m * d + r, kv * g + gi])


@pytest.mark.parametrize(("cl", "d"), BLOCK_CONFIGS)
def test_compressed_intervals_match_spec(cl: int, d: int) -> None:
    tq, q_start = 50, 7
    lo, hi = compressed_intervals(tq, q_start, cl, d, torch.device("cpu"))
    n = num_cmp_blocks(q_start + tq, cl, d) + 2
    j = torch.arange(n).unsqueeze(0)
    keep = (j >= lo.unsqueeze(1)) & (j <= hi.unsqueeze(1))
    assert torch.equal(keep, spec_cmp_mask(torch.arange(q_start, q_start + tq), n, cl, d))

    lengths = [3, 0, cl, 2 * cl + 5, 1, 4 * d + cl]
    cu = cu_seqlens_of(lengths)
    cmp_cu = cmp_cu_seqlens(cu, cl, d)
    lo, hi = compressed_intervals_varlen(cu, cmp_cu, cl, d)
    total = int(cmp_cu[-1])
    j = torch.arange(total).unsqueeze(0)
    keep = (j >= lo.unsqueeze(1)) & (j <= hi.unsqueeze(1))
    expected = torch.zeros(sum(lengths), total, dtype=torch.bool)
    for s, n_tok in enumerate(lengths):
        t0, c0 = int(cu[s]), int(cmp_cu[s])
        n_blk = int(cmp_cu[s + 1]) - c0
        expected[t0 : t0 + n_tok, c0 : c0 + n_blk] = spec_cmp_mask(
            torch.arange(n_tok), n_blk, cl, d
        )
    assert torch.equal(keep, expected)
    assert bool((lo[1:] >= lo[:-1]).all())
    assert bool((hi[1:] >= hi[:-1]).all())


@pytest.mark.parametrize("window", [1, 2, 7, 64])
def test_sliding_intervals_match_spec(window: int) -> None:
    tq, q_start = 40, 9
    lo, hi = sliding_intervals(tq, q_start, window, torch.device("cpu"))
    t = torch.arange(q_start, q_start + tq).unsqueeze(1)
    p = torch.arange(q_start + tq).unsqueeze(0)
    keep = (p >= lo.unsqueeze(1)) & (p <= hi.unsqueeze(1))
    assert torch.equal(keep, (p <= t) & (p >= t - window + 1))

    lengths = [5, 0, 1, 30, 12]
    cu = cu_seqlens_of(lengths)
    lo, hi = sliding_intervals_varlen(cu, window)
    total = sum(lengths)
    p = torch.arange(total).unsqueeze(0)
    keep = (p >= lo.unsqueeze(1)) & (p <= hi.unsqueeze(1))
    expected = torch.zeros(total, total, dtype=torch.bool)
    for s, n in enumerate(lengths):
        t0 = int(cu[s])
        t = torch.arange(n).unsqueeze(1)
        pp = torch.arange(n).unsqueeze(0)
        expected[t0 : t0 + n, t0 : t0 + n] = (pp <= t) & (pp >= t - window + 1)
    assert torch.equal(keep, expected)


@pytest.mark.parametrize("block", [4, 16, 128])
def test_flex_block_tables_cover_every_visible_pair(block: int) -> None:
    """The compiled FlexAttention skips key tiles not listed; they must hold no visible key."""
    cases = []
    for tq, q_start, window in [(300, 0, 5), (257, 40, 64), (9, 100, 300)]:
        lo, hi = sliding_intervals(tq, q_start, window, torch.device("cpu"))
        cases.append((lo, hi, q_start + tq))
    for tq, q_start, cl, d in [(700, 0, 32, 16), (33, 500, 8, 4), (200, 0, 16, 16)]:
        lo, hi = compressed_intervals(tq, q_start, cl, d, torch.device("cpu"))
        cases.append((lo, hi, num_cmp_blocks(q_start + tq, cl, d)))
    cu = cu_seqlens_of([100, 3, 0, 270, 31])
    cases.append((*sliding_intervals_varlen(cu, 17), int(cu[-1])))
    cmp_cu = cmp_cu_seqlens(cu, 8, 4)
    cases.append((*compressed_intervals_varlen(cu, cmp_cu, 8, 4), int(cmp_cu[-1])))
    for lo, hi, kv_len in cases:
        counts, indices = interval_block_tables(lo, hi, kv_len, block)
        assert counts.dtype == torch.int32
        assert indices.dtype == torch.int32
        # BlockMask transposes the table: one column per key tile.
        assert indices.shape == (-(-lo.numel() // block), max(1, -(-kv_len // block)))
        for i in range(lo.numel()):
            if hi[i] < lo[i]:
                continue
            tile = i // block
            listed = set(indices[tile, : int(counts[tile])].tolist())
            needed = set(range(int(lo[i]) // block, int(hi[i]) // block + 1))
            assert needed <= listed, (i, needed - listed)
        assert int(indices.max()) <= max(0, (kv_len - 1) // block)


def test_sdpa_chunks_cover_queries_within_budget() -> None:
    lo, hi = sliding_intervals(1000, 0, 100, torch.device("cpu"))
    chunks = _chunks(lo.tolist(), hi.tolist(), row_cost=4, budget=20_000)
    assert chunks[0][0] == 0
    assert chunks[-1][1] == 1000
    assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks))
    for c0, c1 in chunks:
        span = int(hi[c1 - 1]) - int(lo[c0]) + 1
        assert (c1 - c0) * 4 * span <= 20_000 or c1 - c0 == 1
    assert len(chunks) > 1
