"""FlexAttention fallback of the sliding and compressed branches (CUDA, compiled).

Each query sees one interval of keys ``[lo[i], hi[i]]`` (:mod:`nsa_kernels.common.intervals`); the
mask_mod reads lo/hi and the block mask is built straight from them: a 128-query tile needs the key
tiles between its first query's lo and its last query's hi (both non-decreasing). Nothing O(T^2)
is materialised, and FlexAttention skips every key tile outside the band, so the sliding branch
costs O(T * w) and the compressed one about half the dense Tq x N work.

Building the block mask is host-bound work per call (the tables, the padded intervals,
``BlockMask.from_kv_blocks``): more than the attention itself below a few thousand tokens.
Dense calls depend only on their shape and NSA parameters, so their masks are kept in a small LRU
cache (:data:`BLOCK_MASK_CACHE_SIZE` entries) keyed by them; varlen masks depend on
``cu_seqlens`` values and are built per call.

Only the compiled FlexAttention is fast: uncompiled it falls back to a dense reference that ignores
the block sparsity and materialises all scores. :func:`interval_attention_flex` therefore compiles
on CUDA and runs eagerly elsewhere (CPU tests of the mask logic).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor

from nsa_kernels.common.no_keys import no_keys_output
from nsa_kernels.common.op_calls import (
    CompressedBackend,
    CompressedCall,
    SlidingBackend,
    SlidingCall,
)

FLEX_BLOCK = 128
BLOCK_MASK_CACHE_SIZE = 16

INT32_OFFSETS = 2**31  # a FlexAttention operand of this many elements needs 64-bit offsets

_compiled: Callable[..., Any] | None = None
_block_masks: OrderedDict[Hashable, Any] = OrderedDict()


def clear_block_mask_cache() -> None:
    """Drop every cached block mask (they hold device tensors)."""
    _block_masks.clear()


def block_mask_cache_keys() -> list[Hashable]:
    """The keys of the cached block masks, least recently used first."""
    return list(_block_masks)


def flex_missing_reason() -> str | None:
    """Why FlexAttention is not usable in this torch, or None."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError as exc:
        return f"torch {torch.__version__} has no FlexAttention ({exc})"
    return None


def head_chunks(batch: int, tq: int, tk: int, hq: int, h: int, d: int) -> list[tuple[int, int]]:
    """Query-head ranges [start, end) whose FlexAttention operands each stay under 2^31 elements.

    FlexAttention's kernels address q, k, v, the output and their gradients with 32-bit offsets
    in some of their paths (torch 2.11: 256k tokens at HQ=64 and head dim 192, past 2^31
    elements, read out of bounds: an illegal memory access). A call that large runs per range
    of query heads, each range inside one kv head's group or a whole number of groups, on
    contiguous copies, so every offset fits. ``d``: the larger head dim. One range, all heads,
    when the call is small enough (the usual case: no copy).
    """
    group = hq // h
    per_head = batch * max(tq, tk) * d  # elements of one head of the largest operand
    fit = (INT32_OFFSETS - 1) // per_head
    if fit >= hq:
        return [(0, hq)]
    if fit == 0:
        raise ValueError(
            f"FlexAttention: one head of B={batch} x {max(tq, tk)} tokens x head dim {d} has "
            f"2^31 elements or more, past its 32-bit offsets"
        )
    if fit >= group:  # whole kv-head groups
        step = (fit // group) * group
    else:  # parts of one group, never straddling two kv heads
        step = max(i for i in range(1, group + 1) if group % i == 0 and i <= fit)
    return [(start, min(start + step, hq)) for start in range(0, hq, step)]


def _flex(device: torch.device) -> Callable[..., Any]:
    global _compiled
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if _compiled is None:
        _compiled = torch.compile(flex_attention)
    return _compiled


def interval_block_tables(
    lo: torch.Tensor, hi: torch.Tensor, kv_len: int, block: int = FLEX_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_num_blocks [Qb] and kv_indices [Qb, KVb] (int32) of the key tiles each query tile touches.

    lo, hi int64 [Tq], non-decreasing. Query tile b covers rows [b*block, (b+1)*block); every key it
    may see lies in [lo[first row], hi[last row]], i.e. key tiles first//block .. last//block, which
    are the first kv_num_blocks[b] entries of row b. BlockMask wants one column per key tile (it
    transposes the table for the backward pass), so the rest of a row repeats valid tile numbers
    that are never read.
    """
    tq = lo.numel()
    num_q_blocks = -(-tq // block)
    num_kv_blocks = max(1, -(-kv_len // block))
    tiles = torch.arange(num_q_blocks, device=lo.device)
    first = lo[tiles * block]
    last = hi[torch.clamp((tiles + 1) * block, max=tq) - 1]
    count = torch.where(last >= first, last // block - first // block + 1, torch.zeros_like(first))
    columns = torch.arange(num_kv_blocks, device=lo.device)
    indices = first.div(block, rounding_mode="floor").unsqueeze(1) + columns
    indices = indices.clamp(0, num_kv_blocks - 1)
    return count.to(torch.int32), indices.to(torch.int32)


def interval_block_mask(lo: torch.Tensor, hi: torch.Tensor, kv_len: int) -> Any:
    """The FlexAttention BlockMask of "query row i sees keys [lo[i], hi[i]]" over kv_len keys."""
    from torch.nn.attention.flex_attention import BlockMask

    tq = lo.numel()
    num_blocks, indices = interval_block_tables(lo, hi, kv_len)
    # mask_mod may be evaluated on the padding rows of the last query tile: give them an empty
    # interval instead of reading past the end of lo/hi.
    padded = num_blocks.numel() * FLEX_BLOCK
    lo_pad = torch.ones(padded, dtype=torch.int64, device=lo.device)
    hi_pad = torch.zeros(padded, dtype=torch.int64, device=lo.device)
    lo_pad[:tq], hi_pad[:tq] = lo, hi

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx >= lo_pad[q_idx]) & (kv_idx <= hi_pad[q_idx])

    return BlockMask.from_kv_blocks(
        num_blocks[None, None],
        indices[None, None],
        BLOCK_SIZE=FLEX_BLOCK,
        mask_mod=mask_mod,
        seq_lengths=(tq, kv_len),
    )


def _cached_block_mask(
    key: Hashable | None, intervals: Callable[[], tuple[torch.Tensor, torch.Tensor]], kv_len: int
) -> Any:
    if key is None:
        return interval_block_mask(*intervals(), kv_len)
    mask = _block_masks.get(key)
    if mask is None:
        mask = interval_block_mask(*intervals(), kv_len)
        _block_masks[key] = mask
        if len(_block_masks) > BLOCK_MASK_CACHE_SIZE:
            _block_masks.popitem(last=False)
    else:
        _block_masks.move_to_end(key)
    return mask


def interval_attention_flex(
    q: Tensor, k: Tensor, v: Tensor, lo: Tensor, hi: Tensor, scale: float
) -> Tensor:
    """Query row i attends to keys ``[lo[i], hi[i]]`` (inclusive; ``hi < lo``: output 0).

    q [B, Tq, HQ, dk], k [B, Tk, H, dk], v [B, Tk, H, dv]; lo, hi int64 [Tq], non-decreasing.
    Returns o [B, Tq, HQ, dv] in q's dtype.
    """
    return _attend(q, k, v, None, lambda: (lo, hi), scale)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key: Hashable | None,
    intervals: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    scale: float,
) -> torch.Tensor:
    tq, tk = q.shape[1], k.shape[1]
    if tq == 0 or tk == 0:
        return no_keys_output(q, k, v)
    block_mask = _cached_block_mask(key, intervals, tk)
    hq, h = q.shape[2], k.shape[2]
    chunks = head_chunks(q.shape[0], tq, tk, hq, h, max(q.shape[-1], v.shape[-1]))
    group = hq // h

    def heads(x: torch.Tensor, picked: slice) -> torch.Tensor:
        """x [B, T, heads, d] -> [B, heads, T, d]; a range of heads is copied so that its offsets
        start at 0 (:func:`head_chunks`), all heads stay a view."""
        x = x.transpose(1, 2)
        return x if len(chunks) == 1 else x[:, picked].contiguous()

    parts = []
    for start, end in chunks:
        kv = slice(start // group, (end - 1) // group + 1)
        part: torch.Tensor = _flex(q.device)(
            heads(q, slice(start, end)),
            heads(k, kv),
            heads(v, kv),
            block_mask=block_mask,
            scale=scale,
            enable_gqa=True,
        )
        parts.append(part)
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return out.transpose(1, 2)


def _sliding(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: SlidingCall) -> torch.Tensor:
    """Query t sees keys [max(0, t - w + 1), t] (its own sequence's, varlen)."""
    tq = q.shape[1]
    if call.cu_seqlens is not None:
        return interval_attention_flex(q, k, v, *call.intervals(tq, q.device), call.scale)
    # Keys past the last query are never seen; the cached mask is built for q_start + Tq keys.
    k, v = k[:, : call.q_start + tq], v[:, : call.q_start + tq]
    key = ("sliding", tq, call.q_start, call.window, q.device)
    return _attend(q, k, v, key, lambda: call.intervals(tq, q.device), call.scale)


def _compressed(
    q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, call: CompressedCall
) -> torch.Tensor:
    """Query t sees blocks i with i*d + l - 1 <= t; rows that see no block are 0."""
    tq = q.shape[1]
    if call.cu_seqlens is not None:
        return interval_attention_flex(q, k_cmp, v_cmp, *call.intervals(tq, q.device), call.scale)
    nk = k_cmp.shape[1]
    key = ("compressed", tq, call.q_start, call.cmp_block, call.cmp_stride, nk, q.device)
    return _attend(q, k_cmp, v_cmp, key, lambda: call.intervals(tq, q.device), call.scale)


# nsa_core's sliding_attention / compressed_attention on FlexAttention, with their signatures.
sliding_attention_flex = SlidingBackend(_sliding)
compressed_attention_flex = CompressedBackend(_compressed)
