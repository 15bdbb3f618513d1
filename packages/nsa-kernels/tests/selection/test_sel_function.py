"""Host-side index work of the Triton selection forward: row sets, forced-block split, configs."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from nsa_kernels.selection.function import (
    SelConfig,
    forced_tile_rows,
    parse_config,
    split_forced_blocks,
    unique_block_rows,
)


def rows(*entries: list[int]) -> torch.Tensor:
    """[1, Tq, 1, n] int32 from one list per query row."""
    return torch.tensor(entries, dtype=torch.int32).view(1, len(entries), 1, -1)


def test_unique_block_rows_sorts_and_drops_repeats() -> None:
    idx = rows([3, -1, 3, 0], [2, 2, 2, 2], [-1, -1, -1, -1])
    out = unique_block_rows(idx)[0, :, 0].tolist()
    # Ascending, one copy of each block; repeats become -1 in place (the walk skips them).
    assert [[b for b in row if b >= 0] for row in out] == [[0, 3], [2], []]
    assert all(row[0] >= 0 for row in out[:2])


def test_split_forced_blocks_takes_out_0_and_the_two_local_blocks() -> None:
    # l' = 4, q_start = 8: rows at t = 8, 9 (jt = 2) and t = 10 (jt = 2), t = 11.
    idx = unique_block_rows(rows([0, 1, 2, -1], [1, 2, -1, -1], [0, -1, -1, -1], [2, 0, 1, 1]))
    rest, flags = split_forced_blocks(idx, 4, 8)
    assert rest[0, :, 0].tolist() == [[-1] * 4] * 4
    assert flags[0, :, 0].tolist() == [0b111, 0b110, 0b001, 0b111]


def test_split_forced_blocks_keeps_other_blocks_first_and_ascending() -> None:
    # l' = 2, q_start = 0, row t = 9: jt = 4, forced {0, 3, 4}; 1 and 2 stay.
    idx = torch.full((1, 10, 1, 5), -1, dtype=torch.int32)
    idx[0, 9, 0] = torch.tensor([4, 2, 0, 1, 3])
    rest, flags = split_forced_blocks(unique_block_rows(idx), 2, 0)
    assert rest[0, 9, 0].tolist() == [1, 2, -1, -1, -1]
    assert int(flags[0, 9, 0]) == 0b111


def test_split_forced_blocks_near_the_start() -> None:
    # jt = 0: only block 0 is forced; jt = 1: blocks 0 and 1 (jt - 1 = 0 is block 0 itself).
    idx = unique_block_rows(rows([0, -1], [0, 1]))
    rest, flags = split_forced_blocks(idx, 1, 0)
    assert rest[0, :, 0].tolist() == [[-1, -1], [-1, -1]]
    assert flags[0, :, 0].tolist() == [0b001, 0b101]


def test_forced_tile_rows() -> None:
    assert forced_tile_rows(SelConfig(), 16, 64) == 4  # 4 rows x 16 heads = 64
    assert forced_tile_rows(SelConfig(), 1, 64) == 64
    assert forced_tile_rows(SelConfig(), 3, 24) == 8  # 16 rows capped by 8 | 24
    assert forced_tile_rows(SelConfig(forced_rows=2), 16, 64) == 2
    with pytest.raises(ValueError, match="forced_rows=3"):
        forced_tile_rows(SelConfig(forced_rows=3), 16, 64)
    with pytest.raises(ValueError, match="forced_rows=16"):
        forced_tile_rows(SelConfig(forced_rows=16), 16, 24)


def test_parse_config_names_unknown_fields() -> None:
    assert parse_config("split_forced=2,tma=1") == SelConfig(split_forced=2, tma=1)
    with pytest.raises(ValueError, match="tile_rows"):
        parse_config("tile_rows=4")
