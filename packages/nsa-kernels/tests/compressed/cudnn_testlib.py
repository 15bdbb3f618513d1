"""A float64 model of what the cuDNN compressed backend asks of cuDNN, for its tests on CPU."""

from __future__ import annotations

import pytest
import torch

from nsa_core.blocks import num_cmp_blocks

BOUND = 1e-5
# (causal, with a bias, batch of q) of each call the model served.
CALLS: list[tuple[bool, bool, int]] = []


def model_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the backend asks of cuDNN, in float64: each of Hq query heads over kv head
    ``h // (Hq / Hk)``, the top-left causal mask if ``causal``, ``bias`` added to the scores."""
    CALLS.append((causal, bias is not None, q.shape[0]))
    s, _, vv = _scores(q, k, v, bias, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    o = torch.softmax(s, dim=-1) @ vv
    return o.to(q.dtype), lse.float().detach()


def _scores(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(s, k, v) in float64: the masked, biased scores [B, Hq, Tq, Tk] of :func:`model_attend`
    and its keys and values repeated to the query heads."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    s = (q.double() @ kk.transpose(-1, -2)) * scale
    if causal:
        tq, tk = s.shape[-2:]
        later = torch.ones(tq, tk, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(later, float("-inf"))
    if bias is not None:
        s = s + bias.double()
    return s, kk, vv


def reference_lse(
    q: torch.Tensor, k: torch.Tensor, cmp_block: int, d: int, q_start: int
) -> torch.Tensor:
    """lse [B, Tq, HQ] float64 of scale * q.k over each query's visible blocks (-inf: none)."""
    group = q.shape[2] // k.shape[2]
    kk = k.double().repeat_interleave(group, 2)
    s = torch.einsum("bthd,bnhd->bthn", q.double(), kk) * q.shape[3] ** -0.5
    seen = torch.tensor(
        [
            [num_cmp_blocks(q_start + t + 1, cmp_block, d) > n for n in range(k.shape[1])]
            for t in range(q.shape[1])
        ],
        device=q.device,
    )
    return torch.logsumexp(s.masked_fill(~seen[None, :, None, :], float("-inf")), dim=-1)


CASES = [
    # (batch, tq, q_start, h, group, l, d): the paper's l/d, l = d, T not a multiple of d,
    # q_start > 0 (a cut row before the first full one), every query blind, one query.
    pytest.param(2, 77, 0, 2, 3, 8, 4, id="G3"),
    pytest.param(1, 70, 0, 1, 16, 32, 16, id="paper_l_d_G16"),
    pytest.param(1, 45, 0, 3, 1, 4, 4, id="l_eq_d_G1"),
    pytest.param(2, 53, 13, 2, 2, 8, 4, id="q_start13"),
    pytest.param(1, 40, 100, 1, 3, 32, 16, id="q_start100"),
    pytest.param(1, 7, 0, 2, 2, 8, 4, id="all_blind"),
    pytest.param(1, 1, 64, 2, 4, 8, 4, id="one_query"),
]


def model_attend_backward(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
    lse: torch.Tensor, bias: torch.Tensor | None, causal: bool, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The gradients of one :func:`model_attend` call, written out in float64 as a fused
    attention backward computes them from o and lse (it runs inside a custom op, where autograd
    records nothing): p = exp(s - lse), dv = p^T do, ds = p (do v^T - rowsum(do o)),
    dq = scale ds k, dk = scale ds^T q; a kv head's gradients sum over its query heads."""
    group = q.shape[1] // k.shape[1]
    s, kk, vv = _scores(q, k, v, bias, causal, scale)
    p = torch.exp(s - lse.double()[..., None])
    do64 = do.double()
    delta = (do64 * o.double()).sum(-1, keepdim=True)
    ds = p * (do64 @ vv.transpose(-1, -2) - delta)
    dq = (ds @ kk) * scale
    dk = (ds.transpose(-1, -2) @ q.double()) * scale
    dv = p.transpose(-1, -2) @ do64

    def per_kv_head(x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(1, (k.shape[1], group)).sum(2)

    return dq.to(q.dtype), per_kv_head(dk).to(k.dtype), per_kv_head(dv).to(v.dtype)


def like_q_layout(x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """x in a new tensor whose dims are laid out in the order of q's strides (as torch's cuDNN
    attention allocates its output: ``alloc_with_matching_layout``)."""
    order = [*sorted(range(q.dim() - 1), key=lambda i: -q.stride(i)), q.dim() - 1]
    out = x.new_empty([x.shape[i] for i in order]).permute(
        *[order.index(i) for i in range(x.dim())]
    )
    return out.copy_(x)
