"""Argument checks, varlen splitting and the masked softmax shared by the attention ops."""

from __future__ import annotations

import itertools

import torch

# Upper bound on the elements of the largest intermediate one query chunk may create; it keeps
# every op's memory O(T * n * l') (or O(T * w)) instead of O(T^2).
CHUNK_ELEMENTS = 1 << 24


def shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def check_rank(name: str, t: torch.Tensor, rank: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name} must have rank {rank} {layout}, got shape {shape(t)}")


def check_attention_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    k_name: str = "k",
    v_name: str = "v",
) -> tuple[int, int, int, int, int, int]:
    """Check q [B, Tq, HQ, dk], k [B, Tk, H, dk], v [B, Tk, H, dv]; -> (B, Tq, HQ, H, dk, dv)."""
    check_rank("q", q, 4, "[B, T, HQ, dk]")
    check_rank(k_name, k, 4, "[B, T, H, dk]")
    check_rank(v_name, v, 4, "[B, T, H, dv]")
    batch, tq, hq, dk = q.shape
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(
            f"batch sizes differ: q {shape(q)}, {k_name} {shape(k)}, {v_name} {shape(v)}"
        )
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"{k_name} {shape(k)} and {v_name} {shape(v)} differ in tokens or heads")
    h = k.shape[2]
    if hq % h != 0:
        raise ValueError(
            f"query heads HQ={hq} (q {shape(q)}) must be a multiple of kv heads H={h} "
            f"({k_name} {shape(k)})"
        )
    if k.shape[3] != dk:
        raise ValueError(f"head dims differ: q {shape(q)} has dk={dk}, {k_name} {shape(k)}")
    for name, t in ((k_name, k), (v_name, v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} dtype {t.dtype} differs from q dtype {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if not q.is_floating_point():
        raise TypeError(f"q must be a floating-point tensor, got {q.dtype}")
    return batch, tq, hq, h, dk, v.shape[3]


def check_q_start(q_start: int, tq: int, tk: int, k_name: str = "k") -> None:
    if q_start < 0:
        raise ValueError(f"q_start must be >= 0, got {q_start}")
    if q_start + tq > tk:
        raise ValueError(
            f"queries at positions [{q_start}, {q_start + tq}) need keys up to {q_start + tq - 1}, "
            f"but {k_name} holds {tk} tokens"
        )


def check_cu_seqlens(
    cu_seqlens: torch.Tensor, total: int, batch: int, device: torch.device
) -> None:
    """cu_seqlens: int32 [S+1], starts at 0, non-decreasing, ends at ``total``; needs B == 1."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be an int32 tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries, got {shape(cu_seqlens)}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but q is on {device}")
    if batch != 1:
        raise ValueError(f"varlen inputs pack sequences along T with B == 1, got B={batch}")
    values = cu_seqlens.tolist()
    if values[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {values[0]}")
    if any(b < a for a, b in itertools.pairwise(values)):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {values}")
    if values[-1] != total:
        raise ValueError(f"cu_seqlens must end at T={total}, got {values[-1]}")


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
