"""Sliding branch on FlashAttention-2: causal with ``window_size=(w - 1, 0)``.

FA-2 aligns the causal mask to the bottom-right corner: with Sq queries and Sk keys, query row i
sits at key position ``i + Sk - Sq``. nsa-core puts q[:, 0] at position q_start and k[:, 0] at 0,
so passing the keys up to the last query (``Sk = q_start + Tq``) makes the two agree; decode
(Tq = 1) is the same call. Keys past the last query can never be seen and are not passed.

NSA_DEBUG_FA2_VARLEN sends dense inputs through ``flash_attn_varlen_func`` (one sequence per batch
row); NSA_DEBUG_FA2_DENSE sends packed inputs through ``flash_attn_func`` on a zero-padded
[S, L_max] batch (padding follows each sequence, so causal rows never reach it).
"""

from __future__ import annotations

import itertools

import torch

from nsa_kernels.common.flash import fa2_dense, fa2_dense_as_varlen, fa2_varlen
from nsa_kernels.common.op_calls import SlidingBackend, SlidingCall


def _sliding(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: SlidingCall) -> torch.Tensor:
    """Query t attends to keys [max(0, t - w + 1), t]; o [B, Tq, HQ, dv] in q's dtype."""
    batch, tq, hq, dv = q.shape[0], q.shape[1], q.shape[2], v.shape[3]
    window, scale, cu_seqlens = call.window, call.scale, call.cu_seqlens
    if tq == 0:
        return q.new_zeros(batch, 0, hq, dv)
    if cu_seqlens is not None:
        lengths = [int(x) for x in cu_seqlens.tolist()]
        max_len = max(b - a for a, b in itertools.pairwise(lengths))
        if call.toggles.debug_fa2_dense:
            return _varlen_as_dense(q, k, v, cu_seqlens, max_len, window, scale)
        return fa2_varlen(
            q[0], k[0], v[0], cu_seqlens, cu_seqlens, max_len, max_len, scale, window=window
        ).unsqueeze(0)

    tk = call.q_start + tq
    k, v = k[:, :tk], v[:, :tk]
    if call.toggles.debug_fa2_varlen:
        return fa2_dense_as_varlen(q, k, v, scale, window=window)
    return fa2_dense(q, k, v, scale, window=window)


# nsa_core's sliding_attention on FA-2, with its signature.
sliding_attention_fa2 = SlidingBackend(_sliding)


def padded_slots(cu_seqlens: torch.Tensor, capacity: int) -> torch.Tensor:
    """int64 [T]: token i of sequence s goes to row ``s * capacity + (i - cu_seqlens[s])``."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths)
    local = (
        torch.arange(seq.numel(), device=cu_seqlens.device) - cu_seqlens[:-1].to(torch.int64)[seq]
    )
    return seq * capacity + local


def _varlen_as_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int,
    window: int,
    scale: float,
) -> torch.Tensor:
    num_seq = cu_seqlens.numel() - 1
    slots = padded_slots(cu_seqlens, max_len)

    def pad(x: torch.Tensor) -> torch.Tensor:
        rows = x.new_zeros(num_seq * max_len, *x.shape[2:]).index_copy(0, slots, x[0])
        return rows.view(num_seq, max_len, *x.shape[2:])

    out = fa2_dense(pad(q), pad(k), pad(v), scale, window=window)
    return out.reshape(num_seq * max_len, *out.shape[2:]).index_select(0, slots).unsqueeze(0)
