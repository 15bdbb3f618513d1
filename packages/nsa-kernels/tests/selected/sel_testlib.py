"""Inputs and comparisons shared by the selection kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kernel_testlib import KernelCase, positions

from nsa_core.reference.selected_attention import selected_attention


@dataclass
class Case(KernelCase):
    """One selected-attention call: shapes, where the queries sit, and how indices are drawn.

    ``indices``: "random" (uniform in [-1, NB), NB the blocks of the keys, or of the row's own
    sequence when varlen: padding, future blocks and repeats appear),
    "nsa" (forced {0, jt-1, jt} plus random valid blocks, distinct, -1 padded at the end),
    "span" (one contiguous run ending at jt), "initial_span" (block 0, then a contiguous run
    ending at jt), "empty" (rows of only -1 or only future blocks
    mixed with nsa rows), "repeat" (nsa rows with some entries duplicated).
    """

    h: int = 2
    dv: int = 16
    sel_block: int = 16
    n: int = 3
    tk: int | None = None
    indices: str = "nsa"

    @property
    def keys(self) -> int:
        return self.tk if self.tk is not None else self.q_start + self.tq


def make_indices(case: Case, gen: torch.Generator) -> torch.Tensor:
    """block_indices [B, Tq, H, n] int32 following ``case.indices``."""
    pos = positions(case)
    num_blocks = -(-max(case.keys, 1) // case.sel_block)
    shape = (case.batch, case.tq, case.h, case.n)
    if case.indices == "random" and case.seqlens is not None:
        # Varlen indices count the blocks of their own sequence (docs/spec.md): sequence s
        # draws from [-1, ceil(L_s / l')).
        parts = [
            torch.randint(-1, -(-n // case.sel_block), (1, n, case.h, case.n), generator=gen)
            for n in case.seqlens
        ]
        return torch.cat(parts, dim=1).to(torch.int32)
    if case.indices == "random":
        return torch.randint(-1, num_blocks, shape, generator=gen, dtype=torch.int32)
    out = torch.full(shape, -1, dtype=torch.int32)
    for b in range(case.batch):
        for r in range(case.tq):
            jt = int(pos[r]) // case.sel_block
            for h in range(case.h):
                row = nsa_row(jt, case.n, gen, case.indices)
                out[b, r, h, : len(row)] = torch.tensor(row, dtype=torch.int32)
    if case.indices == "empty":
        # About 30% of rows select nothing, 20% only the block after their own (all future).
        draw = torch.rand(case.batch, case.tq, case.h, generator=gen)
        out[draw < 0.5] = -1
        jt = (pos // case.sel_block).view(1, -1, 1).expand(case.batch, -1, case.h)
        future = (draw >= 0.3) & (draw < 0.5) & (jt + 1 < num_blocks)
        out[..., 0] = torch.where(future, (jt + 1).to(torch.int32), out[..., 0])
    return out


def nsa_row(jt: int, n: int, gen: torch.Generator, kind: str) -> list[int]:
    if kind == "span":
        return list(range(max(0, jt - n + 1), jt + 1))
    if kind == "initial_span":
        return [0, *range(max(1, jt - n + 2), jt + 1)]
    forced = sorted({0, jt, max(jt - 1, 0)})
    rest = [j for j in range(jt + 1) if j not in forced]
    order = torch.randperm(len(rest), generator=gen).tolist()
    chosen = sorted(forced + [rest[i] for i in order[: max(0, n - len(forced))]])[:n]
    if kind == "repeat" and len(chosen) > 1 and len(chosen) < n:
        chosen.append(chosen[0])
    if kind == "repeat" and len(chosen) == n and n > 1:
        chosen[-1] = chosen[0]
    return chosen


def make_inputs(
    case: Case, gen: torch.Generator, dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """q, k, v (drawn in float32, cast to dtype), block_indices, cu_seqlens."""
    q = torch.randn(case.batch, case.tq, case.hq, case.dk, generator=gen)
    k = torch.randn(case.batch, case.keys, case.h, case.dk, generator=gen)
    v = torch.randn(case.batch, case.keys, case.h, case.dv, generator=gen)
    idx = make_indices(case, gen)
    cu = None
    if case.seqlens is not None:
        cu = torch.tensor(
            [0, *torch.cumsum(torch.tensor(case.seqlens), 0).tolist()],
            dtype=torch.int32,
            device=device,
        )
    return (q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), idx.to(device), cu)


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor,
    case: Case,
    cu: torch.Tensor | None,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """The nsa_core reference on the same inputs, computed in ``dtype``."""
    return selected_attention(
        q.to(dtype),
        k.to(dtype),
        v.to(dtype),
        idx,
        case.sel_block,
        q_start=case.q_start,
        cu_seqlens=cu,
    )


def reference_lse(q: torch.Tensor, k: torch.Tensor, idx: torch.Tensor, case: Case) -> torch.Tensor:
    """lse [B, Tq, HQ] float64 by brute force over the visible tokens (-inf when none)."""
    from nsa_core.reference.selected_attention import selected_visibility

    q64, k64 = q.double().cpu(), k.double().cpu()
    idx = idx.cpu()
    group = case.group
    scale = case.dk**-0.5
    out = torch.full(q.shape[:3], float("-inf"), dtype=torch.float64)
    seqs = [(0, case.tq)]
    if case.seqlens is not None:
        starts = torch.cumsum(torch.tensor([0, *case.seqlens[:-1]]), 0).tolist()
        seqs = [(s, s + n) for s, n in zip(starts, case.seqlens, strict=True)]
    for s, e in seqs:
        q_start = case.q_start if case.seqlens is None else 0
        keys = k64[:, s:e] if case.seqlens is not None else k64
        vis = selected_visibility(idx[:, s:e], case.sel_block, q_start, keys.shape[1])
        for hq in range(q.shape[2]):
            h = hq // group
            scores = torch.einsum("btd,bkd->btk", q64[:, s:e, hq], keys[:, :, h]) * scale
            scores = scores.masked_fill(~vis[:, :, h], float("-inf"))
            out[:, s:e, hq] = torch.logsumexp(scores, dim=-1)
    return out
