"""Pieces the reference ops share: varlen spans, the compute dtype, the masked softmax, chunking."""

from __future__ import annotations

import itertools

import torch

# Upper bound on the elements of the largest intermediate one query chunk may create; it keeps
# every op's memory O(T * n * l') (or O(T * w)) instead of O(T^2).
CHUNK_ELEMENTS = 1 << 24


def spans(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    """[(start, end)] of each packed sequence."""
    values = [int(x) for x in cu_seqlens.tolist()]
    return list(itertools.pairwise(values))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The reference computes half-precision inputs in float32 and keeps float32/float64."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim restricted to ``mask``; rows with nothing visible give zeros.

    The max is detached (softmax does not depend on it) and masked entries never reach exp as
    ``-inf - -inf``, so neither values nor gradients become NaN on empty rows.
    """
    if scores.shape[-1] == 0:
        return scores
    scores = scores.masked_fill(~mask, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    denom = weights.sum(dim=-1, keepdim=True)
    return weights / torch.where(denom > 0, denom, torch.ones_like(denom))


def query_chunk(per_query_elements: int) -> int:
    """How many queries one chunk may hold so that its largest intermediate stays bounded."""
    return max(1, CHUNK_ELEMENTS // max(1, per_query_elements))
