"""Tile tables of packed sequences, built on the device: the varlen launches of the compressed and
block-scoring kernels walk them instead of reading sequence lengths back to the host."""

from __future__ import annotations

from collections.abc import Callable

import torch


def tile_table(
    lengths: torch.Tensor,
    per_tile: int,
    bound: int,
    work: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Tiles of ``per_tile`` items over packed sequences, longest work first, on the device.

    Args:
        lengths: [S] items (tokens or compressed blocks) per sequence.
        per_tile: items per tile.
        bound: rows of the table, at least the number of tiles (``ceil(total / per_tile) + S``
            always is); the extra rows are padding.
        work: (sequence [bound], first item [bound]) -> work estimate [bound] of each tile.

    Returns:
        int32 [bound, 2]: (sequence, first item counted from the sequence's start), sorted by
        decreasing work (stable); padding rows are (-1, 0) and come last.
    """
    lengths = lengths.to(torch.int64)
    count = lengths.numel()
    tiles = (lengths + per_tile - 1) // per_tile
    ends = torch.cumsum(tiles, 0)
    index = torch.arange(bound, device=lengths.device)
    seq = torch.searchsorted(ends, index, right=True)
    valid = seq < count
    seq_c = seq.clamp(max=count - 1)
    first = (index - (ends - tiles)[seq_c]) * per_tile
    effort = torch.where(valid, work(seq_c, first), torch.full_like(first, -1))
    order = torch.argsort(effort, descending=True, stable=True)
    table = torch.stack(
        [torch.where(valid, seq, -1), torch.where(valid, first, torch.zeros_like(first))], dim=1
    )
    return table[order].to(torch.int32).contiguous()
