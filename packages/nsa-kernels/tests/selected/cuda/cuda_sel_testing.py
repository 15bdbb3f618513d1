"""Block indices for the CUDA selection tests, shaped as NSA's selection produces them."""

from __future__ import annotations

import torch


def nsa_like_indices(
    batch: int,
    tq: int,
    h: int,
    n: int,
    sel_block: int,
    q_start: int,
    num_blocks: int,
    device: str = "cpu",
    seed: int = 0,
) -> torch.Tensor:
    """int32 [B, Tq, H, n]: the valid members of {0, jt, jt-1} plus random valid blocks, ascending,
    -1 padded (blocks j with j * sel_block <= t are valid; jt = t // sel_block)."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(batch, tq, h, num_blocks, generator=gen)
    t = torch.arange(q_start, q_start + tq).view(1, tq, 1, 1)
    j = torch.arange(num_blocks).view(1, 1, 1, -1)
    jt = t // sel_block
    scores = torch.where((j == 0) | (j == jt) | (j == jt - 1), torch.full_like(scores, 2.0), scores)
    scores = scores.masked_fill(j > jt, -1.0)
    top = scores.topk(min(n, num_blocks), dim=-1)
    idx = torch.where(top.values >= 0, top.indices, torch.full_like(top.indices, num_blocks))
    idx = idx.sort(dim=-1).values
    idx = torch.where(idx == num_blocks, torch.full_like(idx, -1), idx)
    if idx.shape[-1] < n:
        pad = torch.full((*idx.shape[:-1], n - idx.shape[-1]), -1, dtype=idx.dtype)
        idx = torch.cat([idx, pad], dim=-1)
    return idx.to(torch.int32).to(device)


def messy_indices(
    batch: int, tq: int, h: int, n: int, num_blocks: int, device: str = "cpu", seed: int = 0
) -> torch.Tensor:
    """int32 [B, Tq, H, n] uniform in [-1, num_blocks): repeats, future blocks and -1 anywhere."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(-1, num_blocks, (batch, tq, h, n), generator=gen)
    return idx.to(torch.int32).to(device)
