"""Sliding branch: each query attends to the last w tokens, itself included."""

from __future__ import annotations

import math

import torch

from nsa_core.checks import check_sliding_attention
from nsa_core.reference.common import (
    CHUNK_ELEMENTS,
    attend_in_query_chunks,
    attend_keys,
    join_sequences,
    spans,
    validated_by,
)


@validated_by(check_sliding_attention)
def sliding_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    scale: float | None = None,
    *,
    q_start: int = 0,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Query at t attends to tokens [max(0, t - w + 1), t].

    Args:
        q: [B, Tq, HQ, dk]; row r sits at position q_start + r.
        k: [B, Tk, H, dk], v: [B, Tk, H, dv], the sliding branch's keys and values.
        window: w >= 1.
        scale: softmax scale, default dk ** -0.5.
        cu_seqlens: int32 [S+1] for packed sequences (B == 1, q_start == 0).

    Returns:
        o [B, Tq, HQ, dv] in q's dtype.
    """
    scale = q.shape[3] ** -0.5 if scale is None else scale
    if cu_seqlens is not None:
        outs = [
            _sliding_dense(q[:, s:e], k[:, s:e], v[:, s:e], window, scale, 0)
            for s, e in spans(cu_seqlens)
        ]
        return join_sequences(outs, q, v.shape[3])
    return _sliding_dense(q, k, v, window, scale, q_start)


# The body without the checks: the registry's reference backend (ValidatedOp).
sliding_attention_impl = sliding_attention.body


def _sliding_dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, scale: float, q_start: int
) -> torch.Tensor:
    def attend_chunk(c0: int, c1: int) -> torch.Tensor:
        t0, t1 = q_start + c0, q_start + c1  # query positions [t0, t1)
        k0 = max(0, t0 - window + 1)  # keys [k0, t1) cover every window in the chunk
        t = torch.arange(t0, t1, device=q.device).unsqueeze(1)
        p = torch.arange(k0, t1, device=q.device).unsqueeze(0)
        visible = ((p <= t) & (p > t - window))[None, None, :, None, :]  # [1, 1, C, 1, K]
        return attend_keys(q[:, c0:c1], k[:, k0:t1], v[:, k0:t1], visible, scale)

    # A chunk of C queries reads C + w - 1 keys: pick the largest C with hq*C*(C+w) bounded.
    hq = q.shape[2]
    chunk = max(1, int((-window + math.sqrt(window * window + 4 * CHUNK_ELEMENTS / hq)) / 2))
    return attend_in_query_chunks(q, v.shape[3], chunk, attend_chunk)
