"""Compressed branch: each query attends to the compressed blocks that end at or before it."""

from __future__ import annotations

import torch

from nsa_core.block_math import cmp_cu_seqlens
from nsa_core.checks import check_compressed_attention
from nsa_core.reference.common import (
    attend_in_query_chunks,
    attend_visible,
    compute_dtype,
    join_sequences,
    query_chunk,
    spans,
    validated_by,
    visible_probs,
)


def cmp_visible(
    positions: torch.Tensor, num_cmp: int, cmp_block: int, cmp_stride: int
) -> torch.Tensor:
    """[len(positions), num_cmp] bool: query at t sees block i iff ``i*d + l - 1 <= t``."""
    last = torch.arange(num_cmp, device=positions.device) * cmp_stride + cmp_block - 1
    return last.unsqueeze(0) <= positions.unsqueeze(1)


def cmp_probs(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    cmp_block: int,
    cmp_stride: int,
    scale: float,
    q_start: int,
) -> torch.Tensor:
    """p_cmp [B, H, Tq, G, N]: softmax over the visible compressed keys, in the compute dtype.

    Rows that see no block are all zero. Callers chunk over queries to bound memory.
    """
    positions = torch.arange(q_start, q_start + q.shape[1], device=q.device)
    visible = cmp_visible(positions, k_cmp.shape[1], cmp_block, cmp_stride)  # [Tq, N]
    return visible_probs(q, k_cmp, visible[None, None, :, None, :], scale)


@validated_by(check_compressed_attention)
def compressed_attention(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    cmp_block: int,
    cmp_stride: int,
    scale: float | None = None,
    *,
    q_start: int = 0,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """o_cmp = sum_i p_cmp[i] * v_cmp[i] over the blocks visible to each query.

    Args:
        q: [B, Tq, HQ, dk]; row r sits at position ``q_start + r``.
        k_cmp: [B, N, H, dk], v_cmp: [B, N, H, dv]; block i covers tokens [i*d, i*d + l).
        cmp_block, cmp_stride: l and d.
        scale: softmax scale, default dk ** -0.5.
        q_start: position of q[:, 0].
        cu_seqlens: int32 [S+1] over tokens for packed sequences (B == 1, q_start == 0);
            k_cmp/v_cmp are packed per sequence as ``nsa_core.blocks.cmp_cu_seqlens`` says.

    Returns:
        o [B, Tq, HQ, dv] in q's dtype; zero for rows that see no block.
    """
    scale = q.shape[3] ** -0.5 if scale is None else scale
    if cu_seqlens is not None:
        cmp_cu = cmp_cu_seqlens(cu_seqlens, cmp_block, cmp_stride)
        outs = [
            _compressed_dense(
                q[:, s:e], k_cmp[:, cs:ce], v_cmp[:, cs:ce], cmp_block, cmp_stride, scale, 0
            )
            for (s, e), (cs, ce) in zip(spans(cu_seqlens), spans(cmp_cu), strict=True)
        ]
        return join_sequences(outs, q, v_cmp.shape[3])
    return _compressed_dense(q, k_cmp, v_cmp, cmp_block, cmp_stride, scale, q_start)


# The body without the checks: the registry's reference backend (ValidatedOp).
compressed_attention_impl = compressed_attention.body


def _compressed_dense(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    cmp_block: int,
    cmp_stride: int,
    scale: float,
    q_start: int,
) -> torch.Tensor:
    n = k_cmp.shape[1]
    # n == 0 runs the general path: the einsums over an empty block axis give zeros that stay in
    # the autograd graph, so a loss on them back-propagates zero gradients instead of raising.
    vc = v_cmp.to(compute_dtype(q.dtype)).permute(0, 2, 1, 3)  # [B, H, N, dv]

    def attend_chunk(c0: int, c1: int) -> torch.Tensor:
        p = cmp_probs(q[:, c0:c1], k_cmp, cmp_block, cmp_stride, scale, q_start + c0)
        positions = torch.arange(q_start + c0, q_start + c1, device=q.device)
        visible = cmp_visible(positions, n, cmp_block, cmp_stride)[None, None, :, None, :]
        return attend_visible(p, visible, vc)

    return attend_in_query_chunks(q, v_cmp.shape[3], query_chunk(q.shape[2] * n), attend_chunk)
