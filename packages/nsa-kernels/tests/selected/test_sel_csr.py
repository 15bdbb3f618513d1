"""The reverse index (CSR) and the dk/dv work plan against a brute-force listing."""

from __future__ import annotations

import zlib

import pytest
import torch

pytest.importorskip("triton")

from nsa_kernels.selected.csr import (
    RED_FIELDS,
    SEG_FIELDS,
    BlockCSR,
    build_block_csr,
    build_dkv_work,
    default_segment_tokens,
    start_block_csr,
)


def _gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def _brute(
    idx: torch.Tensor, sel_block: int, num_keys: int, q_start: int, cu: list[int] | None
) -> dict[tuple[int, int, int, int], list[int]]:
    """(b, h, tok0 of the block's sequence, block) -> ascending rows that select it."""
    batch, tq, heads, _n = idx.shape
    out: dict[tuple[int, int, int, int], list[int]] = {}
    for b in range(batch):
        for r in range(tq):
            if cu is None:
                t, tok0 = q_start + r, 0
            else:
                seq = max(i for i in range(len(cu) - 1) if cu[i] <= r)
                t, tok0 = r - cu[seq], cu[seq]
            for h in range(heads):
                for j in sorted(set(int(x) for x in idx[b, r, h])):
                    if j >= 0 and j * sel_block <= t:
                        out.setdefault((b, h, tok0, j), []).append(r)
    return out


def _as_dict(csr: BlockCSR, sel_block: int) -> dict[tuple[int, int, int, int], list[int]]:
    out = {}
    for s in range(csr.num_slots):
        lo, hi = int(csr.offsets[s]), int(csr.offsets[s + 1])
        if hi > lo:
            pos0 = int(csr.slot_pos0[s])
            tok0 = int(csr.slot_krow0[s]) - pos0
            key = (int(csr.slot_b[s]), int(csr.slot_h[s]), tok0, pos0 // sel_block)
            out[key] = csr.rows[lo:hi].tolist()
    return out


def test_dense_csr_lists_each_selecting_query_once(request: pytest.FixtureRequest) -> None:
    gen = _gen(request)
    batch, tq, heads, n, sel_block, q_start = 2, 23, 3, 4, 8, 5
    num_keys = q_start + tq + 3
    nb = -(-num_keys // sel_block)
    # Uniform in [-1, nb): padding, future blocks and repeated entries all occur.
    idx = torch.randint(-1, nb, (batch, tq, heads, n), generator=gen, dtype=torch.int32)
    csr = build_block_csr(idx, sel_block, num_keys, q_start=q_start)
    assert csr.num_slots == batch * heads * nb
    assert _as_dict(csr, sel_block) == _brute(idx, sel_block, num_keys, q_start, None)
    assert int(csr.offsets[-1]) == csr.rows.numel()
    assert torch.all(csr.slot_tshift == q_start)
    assert torch.all(csr.slot_kend == num_keys)


def test_varlen_csr_restarts_positions_per_sequence(request: pytest.FixtureRequest) -> None:
    gen = _gen(request)
    lengths = [1, 9, 0, 14]
    cu_list = [0, 1, 10, 10, 24]
    tq, heads, n, sel_block = 24, 2, 3, 4
    idx = torch.randint(-1, 4, (1, tq, heads, n), generator=gen, dtype=torch.int32)
    cu = torch.tensor(cu_list, dtype=torch.int32)
    csr = build_block_csr(idx, sel_block, tq, cu_seqlens=cu)
    assert csr.num_slots == heads * sum(-(-x // sel_block) for x in lengths)
    assert _as_dict(csr, sel_block) == _brute(idx, sel_block, tq, 0, cu_list)
    for s in range(csr.num_slots):
        tok0 = int(csr.slot_krow0[s] - csr.slot_pos0[s])
        assert int(csr.slot_tshift[s]) == -tok0
        assert int(csr.slot_kend[s]) in cu_list[1:]


def test_work_segments_cover_every_row_once(request: pytest.FixtureRequest) -> None:
    gen = _gen(request)
    tq, heads, sel_block = 40, 2, 8
    jt = torch.arange(tq).view(1, tq, 1, 1) // sel_block
    # Block 0 for everyone (one heavy slot) plus each query's own block.
    idx = torch.cat([torch.zeros_like(jt), jt], dim=-1).expand(1, tq, heads, 2).contiguous()
    idx = idx.to(torch.int32)
    csr = build_block_csr(idx, sel_block, tq)
    seg_tokens = 9  # above the 8 queries of a block of their own, below block 0's 40
    work = build_dkv_work(csr, seg_tokens)
    seg = work.segments
    assert seg.shape[1] == SEG_FIELDS
    assert work.reductions.shape[1] == RED_FIELDS
    lengths = seg[:, 6] - seg[:, 5]
    assert torch.all(lengths[:-1] >= lengths[1:]), "segments go longest first"
    assert torch.all((lengths >= 1) & (lengths <= seg_tokens))
    covered = torch.zeros(csr.rows.numel(), dtype=torch.int64)
    for start, end in seg[:, 5:7].tolist():
        covered[start:end] += 1
    assert torch.all(covered == 1)
    counts = csr.counts()
    heavy = int((counts > seg_tokens).sum())
    assert heavy == 2
    assert work.reductions.shape[0] == heavy
    parts = sorted(p for p in seg[:, 7].tolist() if p >= 0)
    assert parts == list(range(work.num_parts))
    for first, count in work.reductions[:, 4:6].tolist():
        assert count == -(-tq // seg_tokens)
        mine = seg[(seg[:, 7] >= first) & (seg[:, 7] < first + count)]
        assert mine[:, 5].unique().numel() == count
    del gen


def test_default_segment_tokens_has_a_floor() -> None:
    assert default_segment_tokens(10, 132) == 256
    assert default_segment_tokens(65536 * 4 * 16, 132) == -(-(65536 * 4 * 16) // (8 * 132))


def test_rows_given_as_sets_skip_the_repeat_search_and_give_the_same_index(
    request: pytest.FixtureRequest,
) -> None:
    """The backward hands the index its rows as sets (unique_block_rows: distinct blocks
    ascending, then -1) and says so: the CSR is the one raw rows with repeats give."""
    gen = _gen(request)
    batch, tq, heads, n, sel_block, q_start = 2, 21, 2, 5, 4, 3
    num_keys = q_start + tq
    nb = -(-num_keys // sel_block)
    idx = torch.randint(-1, nb, (batch, tq, heads, n), generator=gen, dtype=torch.int32)
    ordered = torch.sort(idx, dim=-1).values
    repeat = torch.zeros_like(ordered, dtype=torch.bool)
    repeat[..., 1:] = ordered[..., 1:] == ordered[..., :-1]
    # Distinct blocks ascending, then -1: repeats and padding sort last as nb, then read -1.
    sets = torch.sort(torch.where(repeat | (ordered < 0), nb, ordered), dim=-1).values
    sets = sets.masked_fill(sets == nb, -1)
    raw = build_block_csr(idx, sel_block, num_keys, q_start=q_start)
    given = start_block_csr(sets, sel_block, num_keys, q_start=q_start, rows_are_sets=True)
    from_sets = given.finish()
    assert torch.equal(from_sets.rows, raw.rows)
    assert torch.equal(from_sets.offsets, raw.offsets)
    assert torch.equal(from_sets.host_offsets, raw.host_offsets)
