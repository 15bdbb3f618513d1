"""A float64 stand-in for flash_attn's two entry points, written from their documented semantics.

It lets the CPU tests run every FA-2 adapter path (padding, folding, packing, force toggles) end to
end against the reference. It checks what the real kernels check (one head dim for q/k/v, GQA head
counts, int32 cu_seqlens, max_seqlen bounds) so an adapter bug that FA-2 would reject fails here.

Semantics (flash_attn 2.8 docstrings): causal masks are aligned to the bottom-right corner, so query
row i of Sq keeps key j of Sk iff ``j <= i + Sk - Sq`` and, with ``window_size=(left, right)``,
``i + Sk - Sq - left <= j <= i + Sk - Sq + right`` (-1: unbounded). A row keeping nothing gives 0.
q head h uses kv head ``h // (HQ / H)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

calls: list[str] = []


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool,
    window_size: tuple[int, int],
) -> torch.Tensor:
    """q [Sq, HQ, D], k/v [Sk, H, D] -> [Sq, HQ, D] in float64."""
    sq, hq, _ = q.shape
    sk, h, _ = k.shape
    assert hq % h == 0, f"query heads {hq} not a multiple of kv heads {h}"
    g = hq // h
    if sk == 0:  # the real kernel writes zeros when a sequence has no keys
        return q.new_zeros(sq, hq, v.shape[-1], dtype=torch.float64)
    kk = k.double().repeat_interleave(g, dim=1)
    vv = v.double().repeat_interleave(g, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    i = torch.arange(sq).unsqueeze(1)
    j = torch.arange(sk).unsqueeze(0)
    diag = i + sk - sq
    keep = torch.ones(sq, sk, dtype=torch.bool)
    left, right = window_size
    if causal:
        right = 0
    if right >= 0:
        keep &= j <= diag + right
    if left >= 0:
        keep &= j >= diag - left
    scores = scores.masked_fill(~keep, float("-inf"))
    row_max = scores.amax(-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    denom = weights.sum(-1, keepdim=True)
    probs = weights / torch.where(denom > 0, denom, torch.ones_like(denom))
    return torch.einsum("hqk,khd->qhd", probs, vv)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    assert q.shape[-1] == k.shape[-1] == v.shape[-1], "FA-2 needs one head dim for q, k, v"
    assert q.shape[-1] <= 256, "FA-2 head dim <= 256"
    assert q.dtype == k.dtype == v.dtype
    assert k.shape[:-1] == v.shape[:-1]


# flash_attn's signatures, as written there: tensors, then its options.
def flash_attn_func(
    q: Tensor, k: Tensor, v: Tensor,
    dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
) -> Tensor:  # fmt: skip
    """q [B, Sq, HQ, D], k/v [B, Sk, H, D] -> o [B, Sq, HQ, D]."""
    _check(q, k, v)
    assert q.dim() == 4
    assert q.shape[0] == k.shape[0]
    calls.append("dense")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out = [_attend(q[b], k[b], v[b], scale, causal, window_size) for b in range(q.shape[0])]
    return torch.stack(out).to(q.dtype)


def flash_attn_varlen_func(
    q: Tensor, k: Tensor, v: Tensor,
    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
    dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
) -> Tensor:  # fmt: skip
    """q [Sq_total, HQ, D], k/v [Sk_total, H, D], cu_seqlens int32 [S+1] -> o [Sq_total, HQ, D]."""
    _check(q, k, v)
    assert q.dim() == 3
    assert cu_seqlens_q.dtype == torch.int32
    assert cu_seqlens_k.dtype == torch.int32
    assert cu_seqlens_q.numel() == cu_seqlens_k.numel()
    assert isinstance(max_seqlen_q, int)
    assert isinstance(max_seqlen_k, int)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    assert cq[0] == 0
    assert ck[0] == 0
    assert cq[-1] == q.shape[0]
    assert ck[-1] == k.shape[0]
    calls.append("varlen")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out = []
    for s in range(len(cq) - 1):
        q_len, k_len = cq[s + 1] - cq[s], ck[s + 1] - ck[s]
        assert 0 <= q_len <= max_seqlen_q
        assert 0 <= k_len <= max_seqlen_k
        out.append(
            _attend(
                q[cq[s] : cq[s + 1]],
                k[ck[s] : ck[s + 1]],
                v[ck[s] : ck[s + 1]],
                scale,
                causal,
                window_size,
            )
        )
    return torch.cat(out).to(q.dtype)
