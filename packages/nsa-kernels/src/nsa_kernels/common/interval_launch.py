"""The facts of one call of the interval kernels, which both the compressed and the sliding
branch launch.

Each query row of those kernels attends to one contiguous interval of keys
(:mod:`nsa_kernels.common.intervals` gives the same intervals in plain torch): the compressed
blocks ``0 .. N_cmp(t + 1) - 1`` (compressed branch: blocks of l tokens every d), or, with
l = d = 1 and a window w, the tokens ``max(0, t - w + 1) .. t`` (sliding branch). An
:class:`IntervalLaunch` holds what every launch of one call shares: shapes, block geometry, the
window, the packed sequences; :func:`row_tiles` lays a query group out on a tile's rows. Plain
Python and torch: no triton import here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nsa_kernels.common.tile_config import pow2

# Fewest columns of a value tile whose last columns are masked (see IntervalLaunch.bv).
MIN_MASKED_VALUE_TILE = 64


@dataclass(frozen=True)
class IntervalLaunch:
    """The facts every launch of one call shares.

    Attributes:
        batch, tq: q [B, Tq, HQ, dk].
        q_start: position of q[:, 0] (dense only).
        hq, h, dk, dv: q [B, Tq, HQ, dk], keys [B, N, H, dk], values [B, N, H, dv].
        num_blocks: N, the compressed blocks (the sliding branch: the keys).
        cmp_block, cmp_stride: l and d (1 and 1 for the sliding branch).
        scale: softmax scale.
        cu_seqlens: int32 [S+1] over the packed tokens, or None (dense).
        cmp_cu: int32 [S+1] over the packed blocks (the sliding branch: cu_seqlens), or None.
        window: w, a query sees only the last w keys (sliding branch); 0: no window.
        local_block: l' of the local softmax the sliding forward also stores for the selected
            branch (the forward kernel's LOCAL); 0: none.
    """

    batch: int
    tq: int
    q_start: int
    hq: int
    h: int
    dk: int
    dv: int
    num_blocks: int
    cmp_block: int
    cmp_stride: int
    scale: float
    cu_seqlens: torch.Tensor | None
    cmp_cu: torch.Tensor | None
    window: int = 0
    local_block: int = 0

    @classmethod
    def of_call(
        cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
        q_start: int, cu_seqlens: torch.Tensor | None, *, cmp_block: int, cmp_stride: int,
        cmp_cu: torch.Tensor | None, window: int = 0, local_block: int = 0,
    ) -> IntervalLaunch:  # fmt: skip
        """The facts of a validated call: q [B, Tq, HQ, dk], k [B, N, H, dk], v [B, N, H, dv]
        (N blocks, or tokens for the sliding branch); scale None: dk ** -0.5."""
        batch, tq, hq, dk = q.shape
        return cls(
            batch=batch, tq=tq, hq=hq, h=k.shape[2], dk=dk, dv=v.shape[3],
            num_blocks=k.shape[1], cmp_block=cmp_block, cmp_stride=cmp_stride, q_start=q_start,
            scale=dk**-0.5 if scale is None else float(scale), cu_seqlens=cu_seqlens,
            cmp_cu=cmp_cu, window=window, local_block=local_block,
        )  # fmt: skip

    @property
    def windowed(self) -> bool:
        return self.window > 0

    @property
    def group(self) -> int:
        """G: query heads per kv head."""
        return self.hq // self.h

    @property
    def bk(self) -> int:
        """Columns of a q/K tile: dk padded to a power of two (masked)."""
        return pow2(max(self.dk, 16))

    @property
    def bv(self) -> int:
        """Columns of a V tile: dv padded to a power of two (masked), at least
        MIN_MASKED_VALUE_TILE where padding masks its tail."""
        tile = pow2(max(self.dv, 16))
        if self.dv != tile and tile < MIN_MASKED_VALUE_TILE:
            # A value tile of 16 or 32 columns with a masked tail (dv = 8, 24), beside a q/K tile
            # with one (dk not a multiple of 16), gave wrong outputs in 16 bits and an illegal
            # address in the sliding forward (docs/results/2026-11-26-h100-layer-6.md); a
            # 64-column tile with the same tail was exact.
            return MIN_MASKED_VALUE_TILE
        return tile


@dataclass(frozen=True)
class RowTiles:
    """How a query group is laid out on ``block_m`` rows: HPP heads x TPP tokens, NCH chunks."""

    heads: int
    tokens: int
    chunks: int


def row_tiles(group: int, block_m: int) -> RowTiles:
    """A group of G <= block_m heads takes block_m // G tokens a tile; a larger group is split
    into chunks of block_m heads, one token each."""
    heads = min(group, block_m)
    return RowTiles(heads=heads, tokens=block_m // heads, chunks=-(-group // heads))
