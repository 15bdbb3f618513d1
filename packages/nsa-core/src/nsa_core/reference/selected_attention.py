"""Selected branch: each query attends, in one softmax, to the tokens of its selected blocks."""

from __future__ import annotations

import functools

import torch

from nsa_core.block_math import num_sel_blocks
from nsa_core.checks import check_selected_attention
from nsa_core.reference.common import (
    attend_in_query_chunks,
    attend_keys,
    join_sequences,
    query_chunk,
    spans,
    validated_by,
)


# Called by name, the reference reads the indices' range on every device (out-of-range values
# would index past k); the public op reads it on CUDA only where asked (the kernels mask them).
@validated_by(functools.partial(check_selected_attention, check_range=True))
def selected_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_indices: torch.Tensor,
    sel_block: int,
    scale: float | None = None,
    *,
    q_start: int = 0,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each query over the union of its selected blocks, causally truncated.

    Query row r sits at position ``t = q_start + r``; its head h (group ``h // G``) attends to every
    token p with ``p // sel_block`` in ``block_indices[b, r, h // G]`` and ``p <= t``. Index -1 is
    padding; repeated indices count once (a union of blocks). A row with no visible token gives 0.

    Args:
        q: [B, Tq, HQ, dk].
        k: [B, Tk, H, dk], v: [B, Tk, H, dv], the selected branch's keys and values.
        block_indices: [B, Tq, H, n] int32/int64 in [-1, ceil(Tk / sel_block)).
        sel_block: l', the selection block length.
        scale: softmax scale, default dk ** -0.5.
        q_start: position of q[:, 0] (decode passes the step's position).
        cu_seqlens: int32 [S+1] for packed sequences (B == 1, q_start == 0); positions and block
            indices restart at 0 in each sequence.

    Returns:
        o [B, Tq, HQ, dv] in q's dtype.
    """
    scale = q.shape[3] ** -0.5 if scale is None else scale
    if cu_seqlens is not None:
        outs = [
            _selected_dense(
                q[:, s:e], k[:, s:e], v[:, s:e], block_indices[:, s:e], sel_block, scale, 0
            )
            for s, e in spans(cu_seqlens)
        ]
        return join_sequences(outs, q, v.shape[3])
    return _selected_dense(q, k, v, block_indices, sel_block, scale, q_start)


# The body without the checks: the registry's reference backend (ValidatedOp).
selected_attention_impl = selected_attention.body


def selected_visibility(
    block_indices: torch.Tensor, sel_block: int, q_start: int, num_keys: int
) -> torch.Tensor:
    """visible [B, Tq, H, num_keys] bool: token p is visible to the query at ``q_start + r``.

    p is visible iff its block ``p // sel_block`` is among the row's indices and ``p <= t``; -1
    entries select nothing and repeated entries change nothing (a union of blocks). Blocks at or
    past ``ceil(num_keys / sel_block)`` hold no key below num_keys: they select nothing here.
    """
    batch, tq, h, _ = block_indices.shape
    num_blocks = num_sel_blocks(num_keys, sel_block)
    idx = block_indices.to(torch.int64)
    # Scatter into one spare column so -1 lands somewhere harmless, and so do blocks past the
    # keys: a valid later block (the keys of a chunk of queries end before it) sees no key here.
    outside = (idx < 0) | (idx >= num_blocks)
    member = torch.zeros(batch, tq, h, num_blocks + 1, dtype=torch.bool, device=idx.device)
    member.scatter_(-1, torch.where(outside, num_blocks, idx), True)
    p = torch.arange(num_keys, device=idx.device)
    # Gathered by each key's block: memory O(num_keys), whatever sel_block is.
    token_member = member[..., torch.div(p, sel_block, rounding_mode="floor")]
    t = torch.arange(q_start, q_start + tq, device=idx.device).view(1, tq, 1, 1)
    return token_member & (p.view(1, 1, 1, num_keys) <= t)


def _selected_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_indices: torch.Tensor,
    sel_block: int,
    scale: float,
    q_start: int,
) -> torch.Tensor:
    # Dense scores against the causal prefix, masked to the selected blocks: no gather copies,
    # memory O(chunk * T) per chunk, and the union of blocks falls out of the mask.
    def attend_chunk(c0: int, c1: int) -> torch.Tensor:
        keys = q_start + c1  # the chunk's queries see no token past its last position
        visible = selected_visibility(block_indices[:, c0:c1], sel_block, q_start + c0, keys)
        visible_heads = visible.permute(0, 2, 1, 3).unsqueeze(3)  # [B, H, C, 1, K]
        return attend_keys(q[:, c0:c1], k[:, :keys], v[:, :keys], visible_heads, scale)

    chunk = query_chunk(q.shape[2] * (q_start + q.shape[1]))
    return attend_in_query_chunks(q, v.shape[3], chunk, attend_chunk)
