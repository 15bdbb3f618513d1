"""Block arithmetic of docs/spec.md: compressed blocks, selection blocks and their overlap.

These functions trust their arguments: nsa-core's ops, layer and decode cache call them after
their validators ran. The public, checked versions are :mod:`nsa_core.blocks`.
"""

from __future__ import annotations

import torch


def num_cmp_blocks(length: int, cmp_block: int, cmp_stride: int) -> int:
    """N_cmp(L): complete blocks ``[i*d, i*d + l)`` inside a prefix of ``length`` tokens."""
    return 0 if length < cmp_block else (length - cmp_block) // cmp_stride + 1


def num_sel_blocks(length: int, sel_block: int) -> int:
    """Selection blocks ``[j*l', (j+1)*l')`` that hold at least one of ``length`` tokens."""
    return -(-length // sel_block)


def _shared_tokens(
    i: torch.Tensor, j: torch.Tensor, cmp_block: int, cmp_stride: int, sel_block: int
) -> torch.Tensor:
    """``|[i*d, i*d+l) ∩ [j*l', (j+1)*l')|``: the tokens compressed block i and selection block j
    share, for integer block indices i and j that broadcast together."""
    lo = torch.maximum(i * cmp_stride, j * sel_block)
    hi = torch.minimum(i * cmp_stride + cmp_block, (j + 1) * sel_block)
    return (hi - lo).clamp_min(0)


def cmp_block_overlap(
    num_cmp: int,
    num_sel: int,
    cmp_block: int,
    cmp_stride: int,
    sel_block: int,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """c [num_cmp, num_sel] = ``|[i*d, i*d+l) ∩ [j*l', (j+1)*l')| / d`` (paper Eq. 9 by overlap).

    For l=32, d=16, l'=64, selection block j takes compressed blocks 4j-1 .. 4j+3 with weights
    1, 2, 2, 2, 1.
    """
    i = torch.arange(num_cmp, device=device).unsqueeze(1)
    j = torch.arange(num_sel, device=device).unsqueeze(0)
    return _shared_tokens(i, j, cmp_block, cmp_stride, sel_block).to(dtype) / cmp_stride


def cmp_block_band(
    num_cmp: int,
    num_sel: int,
    cmp_block: int,
    cmp_stride: int,
    sel_block: int,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The nonzero band of :func:`cmp_block_overlap`, column by column.

    Returns index [num_sel, K] (long) and weight [num_sel, K] with K = (l + l') / d, or
    K = num_cmp where fewer blocks exist: selection block j overlaps compressed blocks
    ``index[j]`` with weights ``weight[j]``; padding entries point one past the last block
    (``num_cmp``, where callers keep a zero) with weight 0. Summing a fixed-width band in a fixed
    order gives equal scores to equal inputs, which a matrix product over the dense map does
    not guarantee.
    """
    width = (cmp_block + sel_block) // cmp_stride
    j = torch.arange(num_sel, device=device).unsqueeze(1)
    # First compressed block that can overlap [j*l', (j+1)*l'): i*d + l > j*l'.
    first = torch.div(j * sel_block - cmp_block, cmp_stride, rounding_mode="floor") + 1
    if width > num_cmp:
        # At most num_cmp blocks exist, so a band of num_cmp from the first existing block holds
        # every one: memory stays O(num_sel * num_cmp) where (l + l') / d is huge (l = 2^31 - 1,
        # d = 1 would ask for gigabytes on a 20-token sequence).
        width = num_cmp
        first = first.clamp_min(0)
    i = first + torch.arange(width, device=device).unsqueeze(0)  # [num_sel, K]
    inside = (i >= 0) & (i < num_cmp)
    shared = _shared_tokens(i, j, cmp_block, cmp_stride, sel_block)
    weight = torch.where(inside, shared, torch.zeros_like(i)).to(dtype) / cmp_stride
    return torch.where(inside, i, torch.full_like(i, num_cmp)), weight


def cmp_cu_seqlens(cu_seqlens: torch.Tensor, cmp_block: int, cmp_stride: int) -> torch.Tensor:
    """cu_seqlens [S+1] over tokens -> [S+1] over each sequence's compressed blocks, packed."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    counts = torch.where(
        lengths < cmp_block,
        torch.zeros_like(lengths),
        torch.div(lengths - cmp_block, cmp_stride, rounding_mode="floor") + 1,
    )
    out = torch.zeros_like(cu_seqlens)
    out[1:] = torch.cumsum(counts, 0).to(cu_seqlens.dtype)
    return out
