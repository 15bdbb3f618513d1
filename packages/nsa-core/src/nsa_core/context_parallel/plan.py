"""How a sequence of T tokens is split over the W ranks of a context-parallel group.

The token axis is cut into chunks of near-equal length (the first ``T % C`` of the C chunks hold
one token more than the others). ``contiguous``: C = W, rank r holds chunk r. ``zigzag``:
C = 2W, rank r holds chunks r and 2W-1-r, so every rank gets one early and one late chunk and
the causal work (which grows with the position) is balanced. A rank's local tensors hold its
chunks one after the other, in ascending position. Every chunk holds at least one token, so
T >= W (contiguous) or T >= 2W (zigzag).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from nsa_core.checks import check_int, shape
from nsa_core.limits import MAX_TOKENS

Layout = Literal["contiguous", "zigzag"]
LAYOUTS: tuple[Layout, ...] = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Chunk:
    """Tokens [start, end) of the global sequence, held by ``rank`` at local rows from
    ``local_start``."""

    index: int
    rank: int
    start: int
    end: int
    local_start: int

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ShardPlan:
    """The split of ``total_tokens`` tokens over ``world_size`` ranks.

    Attributes:
        total_tokens: T, tokens of the whole (packed) sequence.
        world_size: W, ranks of the context-parallel group.
        layout: ``"contiguous"`` (rank r holds chunk r of W) or ``"zigzag"`` (chunks r and
            2W-1-r of 2W).
    """

    total_tokens: int
    world_size: int
    layout: Layout = "contiguous"

    def __post_init__(self) -> None:
        check_int("world_size", self.world_size, 1)
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        check_int("total_tokens", self.total_tokens, self.num_chunks, MAX_TOKENS)

    @property
    def num_chunks(self) -> int:
        """C: W chunks for ``contiguous``, 2W for ``zigzag``."""
        return self.world_size if self.layout == "contiguous" else 2 * self.world_size

    def chunk_rank(self, index: int) -> int:
        """The rank holding chunk ``index``."""
        w = self.world_size
        return index if self.layout == "contiguous" or index < w else 2 * w - 1 - index

    def chunks(self) -> tuple[Chunk, ...]:
        """Every chunk in ascending position, with its rank and its rows in that rank's tensors."""
        count = self.num_chunks
        base, extra = divmod(self.total_tokens, count)
        lengths = [base + (1 if c < extra else 0) for c in range(count)]
        local_used = [0] * self.world_size
        out = []
        start = 0
        for index, length in enumerate(lengths):
            rank = self.chunk_rank(index)
            out.append(Chunk(index, rank, start, start + length, local_used[rank]))
            local_used[rank] += length
            start += length
        return tuple(out)

    def chunks_of(self, rank: int) -> tuple[Chunk, ...]:
        """The chunks of ``rank`` in local (and global) order."""
        check_int("rank", rank, 0, self.world_size - 1)
        return tuple(c for c in self.chunks() if c.rank == rank)

    def local_tokens(self, rank: int) -> int:
        """T_local of ``rank``: the tokens its local tensors hold."""
        return sum(c.length for c in self.chunks_of(rank))

    def positions(self, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
        """[T_local] int64: the global position of each local row of ``rank``."""
        parts = [torch.arange(c.start, c.end, device=device) for c in self.chunks_of(rank)]
        return torch.cat(parts)

    def shard(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """The rows of ``rank`` from a global tensor: x [B, T, ...] -> [B, T_local, ...].

        ``dim`` is the token axis (1 for every tensor of the attention core).
        """
        if x.shape[dim] != self.total_tokens:
            raise ValueError(
                f"x {shape(x)} must hold the plan's {self.total_tokens} tokens on dim {dim}"
            )
        return torch.cat([x.narrow(dim, c.start, c.length) for c in self.chunks_of(rank)], dim)

    def unshard(self, parts: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """The global tensor from every rank's local one: parts[r] [B, T_local(r), ...] ->
        [B, T, ...]."""
        if len(parts) != self.world_size:
            raise ValueError(f"unshard needs {self.world_size} parts, got {len(parts)}")
        for rank, part in enumerate(parts):
            if part.shape[dim] != self.local_tokens(rank):
                raise ValueError(
                    f"parts[{rank}] {shape(part)} must hold {self.local_tokens(rank)} tokens "
                    f"on dim {dim}"
                )
        pieces = [parts[c.rank].narrow(dim, c.local_start, c.length) for c in self.chunks()]
        return torch.cat(pieces, dim)
