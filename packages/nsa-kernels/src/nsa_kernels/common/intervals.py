"""The keys each query sees in the sliding and compressed branches, as one interval per query.

Both masks are a contiguous run of keys per query: ``[lo[i], hi[i]]`` (inclusive; ``hi < lo`` means
nothing is visible). For packed sequences the interval is in packed key indices, so it never leaves
the query's own sequence. lo and hi are non-decreasing along the queries, which is what lets the
torch fallbacks cut the queries into chunks with short key spans and build FlexAttention's block
mask without an O(T^2) mask. Plain torch: runs on CPU.
"""

from __future__ import annotations

import torch


def _positions(tq: int, q_start: int, device: torch.device) -> torch.Tensor:
    return torch.arange(q_start, q_start + tq, device=device, dtype=torch.int64)


def _varlen_positions(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence of each packed token, its position within the sequence), both int64 [T]."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths)
    local = (
        torch.arange(seq.numel(), device=cu_seqlens.device) - cu_seqlens[:-1].to(torch.int64)[seq]
    )
    return seq, local


def num_visible_cmp(t: torch.Tensor, cmp_block: int, cmp_stride: int) -> torch.Tensor:
    """u(t) = N_cmp(t + 1): how many compressed blocks query position t sees."""
    return torch.where(
        t + 1 < cmp_block,
        torch.zeros_like(t),
        torch.div(t + 1 - cmp_block, cmp_stride, rounding_mode="floor") + 1,
    )


def sliding_intervals(
    tq: int, q_start: int, window: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """lo, hi [Tq]: query at t = q_start + i sees keys [max(0, t - w + 1), t]."""
    t = _positions(tq, q_start, device)
    return (t - window + 1).clamp_min(0), t


def sliding_intervals_varlen(
    cu_seqlens: torch.Tensor, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """lo, hi [T] in packed indices: token i of a sequence starting at c sees [max(c, i-w+1), i]."""
    seq, local = _varlen_positions(cu_seqlens)
    i = torch.arange(seq.numel(), device=cu_seqlens.device)
    start = i - local
    return torch.maximum(i - window + 1, start), i


def compressed_intervals(
    tq: int, q_start: int, cmp_block: int, cmp_stride: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """lo, hi [Tq]: query at t = q_start + i sees blocks [0, u(t) - 1]."""
    t = _positions(tq, q_start, device)
    return torch.zeros_like(t), num_visible_cmp(t, cmp_block, cmp_stride) - 1


def compressed_intervals_varlen(
    cu_seqlens: torch.Tensor, cmp_cu_seqlens: torch.Tensor, cmp_block: int, cmp_stride: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """lo, hi [T] in packed block indices: a token at position t of sequence s sees its own first
    u(t) blocks, ``[cmp_cu_seqlens[s], cmp_cu_seqlens[s] + u(t) - 1]``."""
    seq, local = _varlen_positions(cu_seqlens)
    first = cmp_cu_seqlens[:-1].to(torch.int64)[seq]
    return first, first + num_visible_cmp(local, cmp_block, cmp_stride) - 1
