"""Selected branch: each query attends, in one softmax, to the tokens of its selected blocks."""

from __future__ import annotations

import torch

from nsa_core.blocks import num_sel_blocks
from nsa_core.ops._common import (
    check_attention_args,
    check_cu_seqlens,
    check_q_start,
    check_rank,
    compute_dtype,
    masked_softmax,
    query_chunk,
    shape,
    spans,
)


def check_block_indices(
    block_indices: torch.Tensor, batch: int, tq: int, h: int, num_blocks: int, device: torch.device
) -> None:
    """block_indices [B, Tq, H, n]: integers in [-1, num_blocks), -1 meaning "no block"."""
    check_rank("block_indices", block_indices, 4, "[B, T, H, n]")
    if block_indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"block_indices must be int32 or int64, got {block_indices.dtype}")
    if tuple(block_indices.shape[:3]) != (batch, tq, h):
        raise ValueError(
            f"block_indices {shape(block_indices)} must be [B={batch}, T={tq}, H={h}, n]"
        )
    if block_indices.device != device:
        raise ValueError(f"block_indices is on {block_indices.device} but q is on {device}")
    if block_indices.numel():
        lo, hi = int(block_indices.min()), int(block_indices.max())
        if lo < -1 or hi >= num_blocks:
            raise ValueError(
                f"block_indices must lie in [-1, {num_blocks}) (selection blocks of the keys), "
                f"got values in [{lo}, {hi}]"
            )


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
    batch, tq, hq, h, dk, dv = check_attention_args(q, k, v)
    if sel_block < 1:
        raise ValueError(f"sel_block must be >= 1, got {sel_block}")
    scale = dk**-0.5 if scale is None else scale
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, q.shape[1], batch, q.device)
        if q_start != 0 or k.shape[1] != tq:
            raise ValueError("varlen selected_attention needs q_start == 0 and k with q's tokens")
        check_block_indices(
            block_indices, batch, tq, h, num_sel_blocks(max(tq, 1), sel_block), q.device
        )
        outs = [
            _selected_dense(
                q[:, s:e], k[:, s:e], v[:, s:e], block_indices[:, s:e], sel_block, scale, 0
            )
            for s, e in spans(cu_seqlens)
        ]
        return torch.cat(outs, dim=1) if outs else q.new_zeros(batch, 0, hq, dv)
    check_q_start(q_start, tq, k.shape[1])
    check_block_indices(
        block_indices, batch, tq, h, num_sel_blocks(k.shape[1], sel_block), q.device
    )
    return _selected_dense(q, k, v, block_indices, sel_block, scale, q_start)


def _selected_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_indices: torch.Tensor,
    sel_block: int,
    scale: float,
    q_start: int,
) -> torch.Tensor:
    batch, tq, hq, dk = q.shape
    tk, h, dv = k.shape[1], k.shape[2], v.shape[3]
    g = hq // h
    n = block_indices.shape[-1]
    out = q.new_zeros(batch, tq, hq, dv)
    if tq == 0 or tk == 0 or n == 0:
        return out
    dtype = compute_dtype(q.dtype)
    num_blocks = num_sel_blocks(tk, sel_block)
    pad = num_blocks * sel_block - tk
    # [B, H, num_blocks, l', d]: keys grouped by selection block, so one gather fetches a block.
    kb = torch.nn.functional.pad(k.to(dtype), (0, 0, 0, 0, 0, pad))
    vb = torch.nn.functional.pad(v.to(dtype), (0, 0, 0, 0, 0, pad))
    kb = kb.view(batch, num_blocks, sel_block, h, dk).permute(0, 3, 1, 2, 4)
    vb = vb.view(batch, num_blocks, sel_block, h, dv).permute(0, 3, 1, 2, 4)
    offsets = torch.arange(sel_block, device=q.device)
    b_idx = torch.arange(batch, device=q.device).view(batch, 1, 1, 1)
    h_idx = torch.arange(h, device=q.device).view(1, h, 1, 1)

    chunk = query_chunk(hq * n * sel_block + h * n * sel_block * (dk + dv))
    outs = []
    for c0 in range(0, tq, chunk):
        c1 = min(tq, c0 + chunk)
        idx = block_indices[:, c0:c1].to(torch.int64).sort(dim=-1).values  # [B, C, H, n]
        repeated = torch.zeros_like(idx, dtype=torch.bool)
        repeated[..., 1:] = idx[..., 1:] == idx[..., :-1]
        live = (idx >= 0) & ~repeated
        idx = idx.clamp_min(0).permute(0, 2, 1, 3)  # [B, H, C, n]
        live = live.permute(0, 2, 1, 3)
        kg = kb[b_idx, h_idx, idx]  # [B, H, C, n, l', dk]
        vg = vb[b_idx, h_idx, idx]
        pos = idx.unsqueeze(-1) * sel_block + offsets  # [B, H, C, n, l']
        t = torch.arange(q_start + c0, q_start + c1, device=q.device).view(1, 1, -1, 1, 1)
        visible = (live.unsqueeze(-1) & (pos <= t)).flatten(3)  # [B, H, C, n*l']
        qc = q[:, c0:c1].to(dtype).view(batch, c1 - c0, h, g, dk).permute(0, 2, 1, 3, 4)
        scores = torch.einsum("bhcgd,bhckd->bhcgk", qc, kg.flatten(3, 4)) * scale
        probs = masked_softmax(scores, visible.unsqueeze(3))
        oc = torch.einsum("bhcgk,bhckd->bhcgd", probs, vg.flatten(3, 4))
        outs.append(oc.permute(0, 2, 1, 3, 4).reshape(batch, c1 - c0, hq, dv))
    return torch.cat(outs, dim=1).to(q.dtype)
