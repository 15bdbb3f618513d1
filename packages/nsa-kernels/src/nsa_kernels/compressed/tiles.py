"""Tile tables of the interval kernels' launches: the query tiles (forward, dq) and key tiles
(dk/dv) of a call, in the order the programs take them, and the query segments of a key tile.

A dense call needs no table: a program finds its tile from its id
(:func:`nsa_kernels.compressed.triton_tiles.query_tile` and ``key_tile``). Packed sequences
(``cu_seqlens``) get one built on the device (:func:`nsa_kernels.common.tile_table.tile_table`)
and sized from the shapes alone, so that no launch reads a device value on the host.
"""

from __future__ import annotations

import torch

from nsa_kernels.common.interval_launch import IntervalLaunch
from nsa_kernels.common.tile_table import tile_table
from nsa_kernels.compressed.config import CmpConfig

# The dk/dv kernel aims at this many programs per SM, so the unequal key tiles balance out.
DKV_PROGRAMS_PER_SM = 4
# Fewest query rows one dk/dv program takes when a key tile is split over several programs.
MIN_SEGMENT_ROWS = 512


def _no_table(device: torch.device) -> torch.Tensor:
    """What a dense launch passes where a varlen one passes a table (never read)."""
    return torch.zeros(2, dtype=torch.int32, device=device)


def query_tiles(
    info: IntervalLaunch, tokens: int, device: torch.device
) -> tuple[torch.Tensor, int]:
    """(varlen table int32 [bound, 2] or a dummy, number of query tiles) for ``tokens`` tokens
    per tile."""
    if info.cu_seqlens is None:
        return _no_table(device), info.batch * -(-info.tq // tokens)
    lengths = (info.cu_seqlens[1:] - info.cu_seqlens[:-1]).to(torch.int64)
    bound = -(-info.tq // tokens) + lengths.numel()
    # A tile's last token sees the most blocks: its position + 1 measures the work.
    table = tile_table(
        lengths, tokens, bound, lambda seq, first: torch.minimum(first + tokens, lengths[seq])
    )
    return table, bound


def key_tiles(info: IntervalLaunch, blocks: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """(varlen table int32 [bound, 2] or a dummy, number of key tiles) for ``blocks`` blocks
    per tile."""
    if info.cu_seqlens is None or info.cmp_cu is None:
        return _no_table(device), info.batch * -(-info.num_blocks // blocks)
    lengths = (info.cu_seqlens[1:] - info.cu_seqlens[:-1]).to(torch.int64)
    cmp_lengths = (info.cmp_cu[1:] - info.cmp_cu[:-1]).to(torch.int64)
    bound = -(-info.num_blocks // blocks) + lengths.numel()
    first_row = info.cmp_block - 1
    # The queries that see a tile's first block: the rows from its end token to the sequence end.
    table = tile_table(
        cmp_lengths,
        blocks,
        bound,
        lambda seq, first: (lengths[seq] - first * info.cmp_stride - first_row).clamp_min(0),
    )
    return table, bound


def varlen_args(info: IntervalLaunch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cu_seqlens, cmp_cu) as the kernels take them: dummies for a dense call."""
    if info.cu_seqlens is None or info.cmp_cu is None:
        dummy = _no_table(device)
        return dummy, dummy
    return info.cu_seqlens, info.cmp_cu


def segment_rows(info: IntervalLaunch, cfg: CmpConfig, tokens: int, num_sms: int) -> int:
    """Query rows per dk/dv program: cfg.dkv_segment, or from the work and the SM count.

    Without a setting: the (query row, key tile) pairs over DKV_PROGRAMS_PER_SM * num_sms
    programs, a multiple of ``tokens`` (rows per step), at least MIN_SEGMENT_ROWS; in windowed
    mode (the sliding branch) no split: every tile's rows, the whole sequence.

    The work is the number of (query row, key tile) pairs of one sequence of ``tq`` rows (for
    packed sequences an overestimate: it treats them as one sequence, which splits less).
    """
    if cfg.dkv_segment:
        return cfg.dkv_segment
    bn = cfg.dkv_block_n
    rows = info.tq
    if info.windowed:
        # A windowed key tile meets at most bn + w - 1 rows, and T / bn tiles share the work
        # evenly. Segments are absolute row ranges, so a split would allocate float32 partials
        # for every (tile, segment) pair, most never met (gigabytes at long T), and launch as
        # many programs, most loading K/V for nothing.
        return max(rows, 1)
    pairs = 0
    for tile in range(-(-info.num_blocks // bn)):
        # The rows from the one at the tile's first block's end token on see the tile.
        first = tile * bn * info.cmp_stride + info.cmp_block - 1 - info.q_start
        pairs += max(0, rows - max(0, first))
    work = pairs * info.batch * info.h
    seg = max(MIN_SEGMENT_ROWS, -(-work // (DKV_PROGRAMS_PER_SM * num_sms)))
    seg = -(-seg // tokens) * tokens
    return min(seg, max(rows, 1))
