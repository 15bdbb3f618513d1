"""Inputs and comparisons shared by the Triton compressed-attention tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kernel_testlib import CompressedCase, positions

from nsa_core.blocks import cmp_cu_seqlens, num_cmp_blocks
from nsa_core.reference.compressed_attention import compressed_attention


@dataclass
class Case(CompressedCase):
    """One compressed-attention call (``config``: CmpConfig fields).

    ``extra_blocks``: compressed blocks in k_cmp beyond the last one any query sees (dense only;
    they must get zero gradient).
    """

    tq: int = 40
    dv: int = 16
    extra_blocks: int = 0

    @property
    def num_blocks(self) -> int:
        if self.seqlens is not None:
            return sum(num_cmp_blocks(n, self.cmp_block, self.cmp_stride) for n in self.seqlens)
        visible = num_cmp_blocks(self.q_start + self.tq, self.cmp_block, self.cmp_stride)
        return visible + self.extra_blocks


def cu_seqlens(case: Case, device: str) -> torch.Tensor | None:
    if case.seqlens is None:
        return None
    assert sum(case.seqlens) == case.tq, case
    assert case.batch == 1, case
    offsets = [0]
    for n in case.seqlens:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def backprop(out: torch.Tensor, grad: torch.Tensor) -> None:
    """out.backward(grad), typed."""
    torch.autograd.backward(out, grad)


def leaves(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh leaf copies of q, k, v (cast to ``dtype`` when given) that require grad."""
    out = [(t if dtype is None else t.to(dtype)).clone().requires_grad_() for t in (q, k, v)]
    return out[0], out[1], out[2]


def grads(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The .grad of each leaf (all must have one)."""
    out = []
    for t in tensors:
        assert t.grad is not None
        out.append(t.grad)
    return out


def make_inputs(
    case: Case, gen: torch.Generator, dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """q [B, Tq, HQ, dk], k_cmp [B, N, H, dk], v_cmp [B, N, H, dv] (drawn in float32, cast to
    dtype) and cu_seqlens."""
    q = torch.randn(case.batch, case.tq, case.hq, case.dk, generator=gen)
    k = torch.randn(case.batch, case.num_blocks, case.h, case.dk, generator=gen)
    v = torch.randn(case.batch, case.num_blocks, case.h, case.dv, generator=gen)
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), cu_seqlens(case, device)


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    case: Case,
    cu: torch.Tensor | None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """nsa_core's reference op on the same inputs, computed in ``dtype``."""
    return compressed_attention(
        q.to(dtype),
        k.to(dtype),
        v.to(dtype),
        case.cmp_block,
        case.cmp_stride,
        q_start=case.q_start,
        cu_seqlens=cu,
    )


def sequence_of_rows(case: Case) -> list[tuple[int, int, int, int]]:
    """[(row start, row end, block start, block end)] of each sequence (one for dense)."""
    if case.seqlens is None:
        return [(0, case.tq, 0, case.num_blocks)]
    cu = cu_seqlens(case, "cpu")
    assert cu is not None
    cmp_cu = cmp_cu_seqlens(cu, case.cmp_block, case.cmp_stride).tolist()
    rows = cu.tolist()
    return [(rows[s], rows[s + 1], cmp_cu[s], cmp_cu[s + 1]) for s in range(len(case.seqlens))]


def reference_lse(q: torch.Tensor, k: torch.Tensor, case: Case) -> torch.Tensor:
    """lse [B, Tq, HQ] float64: log-sum-exp of scale * q.k over the visible blocks (-inf: none).

    Brute force, independent of the reference op: block i is visible to position t iff
    ``i*d + l - 1 <= t`` (docs/spec.md).
    """
    q64, k64 = q.detach().double().cpu(), k.detach().double().cpu()
    scale = case.dk**-0.5
    pos = positions(case)
    out = torch.full(q.shape[:3], float("-inf"), dtype=torch.float64)
    for r0, r1, n0, n1 in sequence_of_rows(case):
        last = torch.arange(n1 - n0) * case.cmp_stride + case.cmp_block - 1
        visible = last[None, :] <= pos[r0:r1, None]  # [rows, blocks]
        for head in range(case.hq):
            keys = k64[:, n0:n1, head // case.group]
            scores = torch.einsum("btd,bnd->btn", q64[:, r0:r1, head], keys) * scale
            scores = scores.masked_fill(~visible, float("-inf"))
            out[:, r0:r1, head] = torch.logsumexp(scores, dim=-1)
    return out


def blind_rows(case: Case) -> torch.Tensor:
    """bool [Tq]: rows whose position sees no compressed block (t < l - 1)."""
    return positions(case) < case.cmp_block - 1


def unseen_blocks(case: Case) -> torch.Tensor:
    """bool [N]: blocks of k_cmp that no query sees (the dense case's extra blocks)."""
    out = torch.zeros(case.num_blocks, dtype=torch.bool)
    if case.seqlens is None:
        out[case.num_blocks - case.extra_blocks :] = True
    return out
