"""Host-side work of the Triton selection forward: index rows as sets, config strings."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from nsa_kernels.selection.function import (
    SelConfig,
    parse_config,
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


def test_parse_config_names_unknown_fields() -> None:
    assert parse_config("tma=1,block_l=32") == SelConfig(tma=1, block_l=32)
    with pytest.raises(ValueError, match="tile_rows"):
        parse_config("tile_rows=4")


def test_unique_block_rows_drops_entries_outside_the_keys() -> None:
    idx = rows([5, -3, 1, 1 << 30], [4, 0, -1, 2])
    out = unique_block_rows(idx, num_blocks=5)[0, :, 0].tolist()
    assert out == [[1, -1, -1, -1], [0, 2, 4, -1]]
