"""Torch SDPA fallback of the sliding and compressed branches: one masked SDPA call per query chunk.

Each query sees one interval of keys (:mod:`nsa_kernels.common.intervals`), and the intervals move
forward with the queries, so a chunk of C queries needs only the keys between its first query's lo
and its last query's hi. The mask of a chunk is [C, span]: memory stays O(T * w) for the sliding
branch and O(C * N) per chunk for the compressed one, never O(T^2).

GQA without copying K/V: the G query heads of a kv head are folded into the query rows
(q [B, C, H, G, dk] -> [B, H, C*G, dk]), so SDPA sees H heads and every mask row is repeated G
times. A query that sees no key (compressed branch, t < l - 1) is given one dummy key so SDPA never
normalises an empty row (NaN) and its output is then set to exactly zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from nsa_kernels.common.no_keys import no_keys_output
from nsa_kernels.common.op_calls import (
    CompressedBackend,
    CompressedCall,
    SlidingBackend,
    SlidingCall,
)

# Largest element count of one chunk's biggest intermediate: the [rows, span] mask on CUDA (the
# fused SDPA kernels never hold scores), the [B, HQ, rows, span] scores on CPU (math kernel).
CUDA_CHUNK_ELEMENTS = 1 << 26
CPU_CHUNK_ELEMENTS = 1 << 24


def _chunks(lo: list[int], hi: list[int], row_cost: int, budget: int) -> list[tuple[int, int]]:
    """Cut queries into [c0, c1) whose ``(c1 - c0) * row_cost * span`` stays within budget.

    span = hi[c1 - 1] - lo[c0] + 1 grows with c1 because lo and hi are non-decreasing, so the
    largest c1 that fits is found by bisection; a chunk always holds at least one query.
    """
    out = []
    c0, total = 0, len(lo)
    while c0 < total:
        good, bad = c0 + 1, total + 1
        while bad - good > 1:
            mid = (good + bad) // 2
            if (mid - c0) * row_cost * max(1, hi[mid - 1] - lo[c0] + 1) <= budget:
                good = mid
            else:
                bad = mid
        out.append((c0, good))
        c0 = good
    return out


def interval_attention_sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lo: Tensor,
    hi: Tensor,
    scale: float,
    *,
    budget: int | None = None,
) -> Tensor:
    """Query row i attends to keys ``[lo[i], hi[i]]`` (inclusive; ``hi < lo``: output 0).

    q [B, Tq, HQ, dk], k [B, Tk, H, dk], v [B, Tk, H, dv]; lo, hi int64 [Tq], non-decreasing.
    Returns o [B, Tq, HQ, dv] in q's dtype.
    """
    batch, tq, hq, dk = q.shape
    h, dv = k.shape[2], v.shape[3]
    g = hq // h
    if tq == 0:
        return no_keys_output(q, k, v)
    on_cuda = q.device.type == "cuda"
    row_cost = g if on_cuda else batch * hq
    if budget is None:
        budget = CUDA_CHUNK_ELEMENTS if on_cuda else CPU_CHUNK_ELEMENTS
    lo_list, hi_list = lo.tolist(), hi.tolist()
    outs = []
    for c0, c1 in _chunks(lo_list, hi_list, row_cost, budget):
        rows = c1 - c0
        first, last = lo_list[c0], hi_list[c1 - 1]
        if last < first:  # every query of the chunk sees nothing
            outs.append(no_keys_output(q[:, c0:c1], k, v))
            continue
        keys = torch.arange(first, last + 1, device=q.device)
        lo_c, hi_c = lo[c0:c1].unsqueeze(1), hi[c0:c1].unsqueeze(1)
        empty = hi_c < lo_c  # [C, 1]
        visible = ((keys >= lo_c) & (keys <= hi_c)) | (empty & (keys == first))
        mask = visible.unsqueeze(1).expand(rows, g, keys.numel()).reshape(rows * g, -1)
        qf = q[:, c0:c1].reshape(batch, rows, h, g, dk).permute(0, 2, 1, 3, 4)
        o = F.scaled_dot_product_attention(
            qf.reshape(batch, h, rows * g, dk),
            k[:, first : last + 1].transpose(1, 2),
            v[:, first : last + 1].transpose(1, 2),
            attn_mask=mask,
            scale=scale,
        )
        o = o.reshape(batch, h, rows, g, dv).permute(0, 2, 1, 3, 4).reshape(batch, rows, hq, dv)
        outs.append(torch.where(empty.view(1, rows, 1, 1), torch.zeros_like(o), o))
    return torch.cat(outs, dim=1)


def _sliding(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: SlidingCall) -> torch.Tensor:
    """Query t sees keys [max(0, t - w + 1), t] (its own sequence's, varlen)."""
    lo, hi = call.intervals(q.shape[1], q.device)
    return interval_attention_sdpa(q, k, v, lo, hi, call.scale)


def _compressed(
    q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, call: CompressedCall
) -> torch.Tensor:
    """Query t sees blocks i with i*d + l - 1 <= t; rows that see no block are 0."""
    lo, hi = call.intervals(q.shape[1], q.device)
    return interval_attention_sdpa(q, k_cmp, v_cmp, lo, hi, call.scale)


# nsa_core's sliding_attention / compressed_attention on torch SDPA, with their signatures.
sliding_attention_sdpa = SlidingBackend(_sliding)
compressed_attention_sdpa = CompressedBackend(_compressed)
