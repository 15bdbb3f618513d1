"""Compressed branch on FlashAttention-2: one causal call over the folded queries.

:mod:`nsa_kernels.compressed.cmp_fold` explains the mapping: queries shifted by one and folded
d to a row (the d slots of a row go into the head dimension) see a causal prefix of the
compressed keys, which is FA-2's bottom-right causal mask. Queries that see no block land on
rows FA-2 masks completely; FA-2 writes zeros for such rows (its softmax keeps a zero row sum
at scale 1, and the log-sum-exp it stores for them, +inf, makes their backward contribution
zero), so no NaN can appear.

NSA_DEBUG_FA2_VARLEN sends dense inputs through ``flash_attn_varlen_func``; NSA_DEBUG_FA2_DENSE
sends packed inputs through ``flash_attn_func`` on a zero-padded [S, rows] batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nsa_kernels.common.flash import fa2_dense, fa2_dense_as_varlen, fa2_varlen
from nsa_kernels.common.op_calls import CompressedBackend, CompressedCall
from nsa_kernels.compressed.cmp_fold import dense_fold, fold_heads, unfold_heads, varlen_fold


def _compressed(
    q: torch.Tensor, k_cmp: torch.Tensor, v_cmp: torch.Tensor, call: CompressedCall
) -> torch.Tensor:
    """Query t sees blocks i with ``i*d + l - 1 <= t``: q [B, Tq, HQ, dk], k_cmp [B, N, H, dk],
    v_cmp [B, N, H, dv] -> o [B, Tq, HQ, dv] (q's dtype), zero for rows that see no block."""
    batch, tq, hq, _ = q.shape
    h, dv = k_cmp.shape[2], v_cmp.shape[3]
    if tq == 0:
        return q.new_zeros(batch, 0, hq, dv)
    if call.cu_seqlens is not None:
        return _varlen(q, k_cmp, v_cmp, call.cu_seqlens, call)

    d = call.cmp_stride
    fold = dense_fold(tq, call.q_start, call.cmp_block, d)
    if fold.num_keys <= 0:
        return q.new_zeros(batch, tq, hq, dv)
    if fold.num_keys > k_cmp.shape[1]:
        raise ValueError(f"queries see {fold.num_keys} blocks, k_cmp holds {k_cmp.shape[1]}")
    qf = fold_heads(F.pad(q, (0, 0, 0, 0, fold.front, fold.back)), h, d)  # [B, R, H*d*G, dk]
    k_use, v_use = k_cmp[:, : fold.num_keys], v_cmp[:, : fold.num_keys]
    attend = fa2_dense_as_varlen if call.toggles.debug_fa2_varlen else fa2_dense
    o = attend(qf, k_use, v_use, call.scale)
    return unfold_heads(o, h, d)[:, fold.front : fold.front + tq]


# nsa_core's compressed_attention on FA-2, with its signature (varlen: B == 1, int32 cu_seqlens
# [S+1] over tokens, q_start == 0, k_cmp packed per sequence as
# ``nsa_core.blocks.cmp_cu_seqlens`` says).
compressed_attention_fa2 = CompressedBackend(_compressed)


def _varlen(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    cu_seqlens: torch.Tensor,
    call: CompressedCall,
) -> torch.Tensor:
    """:func:`_compressed` on packed sequences (``cu_seqlens`` is ``call.cu_seqlens``);
    NSA_DEBUG_FA2_DENSE runs them as a zero-padded [S, rows] batch."""
    _, tq, hq, dk = q.shape
    h, dv = k_cmp.shape[2], v_cmp.shape[3]
    d, scale, as_dense = call.cmp_stride, call.scale, call.toggles.debug_fa2_dense
    fold = varlen_fold(cu_seqlens, call.cmp_block, d, dense=as_dense)
    if int(fold.cu_keys[-1]) != k_cmp.shape[1]:
        raise ValueError(
            f"k_cmp holds {k_cmp.shape[1]} blocks, cu_seqlens implies {int(fold.cu_keys[-1])}"
        )
    if fold.max_keys == 0:
        return q.new_zeros(1, tq, hq, dv)
    slots = q.new_zeros(fold.total_rows * d, hq, dk).index_copy(0, fold.slot, q[0])
    qf = fold_heads(slots, h, d)  # [total_rows, H*d*G, dk]
    if as_dense:
        num_seq = cu_seqlens.numel() - 1

        def pad_keys(x: torch.Tensor) -> torch.Tensor:
            rows = x.new_zeros(fold.total_keys, h, x.shape[-1]).index_copy(0, fold.key_slot, x[0])
            return rows.view(num_seq, fold.max_keys, h, x.shape[-1])

        o = fa2_dense(
            qf.view(num_seq, fold.max_rows, *qf.shape[1:]), pad_keys(k_cmp), pad_keys(v_cmp), scale
        ).reshape(fold.total_rows, -1, dv)
    else:
        o = fa2_varlen(
            qf, k_cmp[0], v_cmp[0], fold.cu_rows, fold.cu_keys, fold.max_rows, fold.max_keys, scale
        )
    return unfold_heads(o, h, d).index_select(0, fold.slot).unsqueeze(0)
