"""Argument checks shared by the FA-2 adapters and their torch fallbacks (nsa-core's rules)."""

from __future__ import annotations

import itertools

import torch


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def check_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, names: tuple[str, str] = ("k", "v")
) -> tuple[int, int, int, int, int, int]:
    """q [B, Tq, HQ, dk], k [B, Tk, H, dk], v [B, Tk, H, dv] -> (B, Tq, HQ, H, dk, dv)."""
    for name, t in (("q", q), (names[0], k), (names[1], v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be [B, T, heads, dim], got {_shape(t)}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} is {t.dtype} on {t.device}, q is {q.dtype} on {q.device}")
    batch, tq, hq, dk = q.shape
    tk, h = k.shape[1], k.shape[2]
    if k.shape[0] != batch or v.shape[0] != batch or k.shape[3] != dk:
        raise ValueError(f"q {_shape(q)} and {names[0]} {_shape(k)} disagree in batch or head dim")
    if tuple(v.shape[:3]) != (batch, tk, h):
        raise ValueError(f"{names[0]} {_shape(k)} and {names[1]} {_shape(v)} disagree")
    if h == 0 or hq % h != 0:
        raise ValueError(f"query heads {hq} must be a multiple of kv heads {h}")
    return batch, tq, hq, h, dk, v.shape[3]


def check_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, total: int) -> list[int]:
    """int32 [S+1] from 0 to ``total``, non-decreasing, with B == 1; returns it as a list."""
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be int32 [S+1], got {cu_seqlens.dtype} {_shape(cu_seqlens)}"
        )
    if batch != 1:
        raise ValueError(f"varlen inputs pack sequences along T with B == 1, got B={batch}")
    values = [int(x) for x in cu_seqlens.tolist()]
    if values[0] != 0 or values[-1] != total or any(b < a for a, b in itertools.pairwise(values)):
        raise ValueError(f"cu_seqlens must rise from 0 to {total}, got {values}")
    return values
