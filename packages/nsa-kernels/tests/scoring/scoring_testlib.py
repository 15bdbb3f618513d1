"""Inputs, references and checks shared by the block-scoring kernel tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from kernel_testlib import CompressedCase

from nsa_core.blocks import cmp_cu_seqlens, num_cmp_blocks
from nsa_core.reference.common import spans
from nsa_core.reference.selection import select_blocks
from nsa_kernels.scoring.contract import (
    IndexContractReport,
    assert_index_contract,
    reference_scores,
    row_positions,
)

if TYPE_CHECKING:
    from nsa_kernels.scoring.function import ScoreConfig


@dataclass
class Case(CompressedCase):
    """One select_blocks call: shapes, block geometry, where the queries sit, how keys are drawn.

    ``keys``: "randn" (independent N(0, 1) compressed keys), "palette" (N(0, 1) keys that
    repeat with a period of 3 selection blocks, so bands of equal keys give exactly tied
    scores) or "palette_grid" (the same, with q and the keys on the grid {-1, -1/2, 0, 1/2, 1}:
    every q.k is then exact in float32 whatever the order of its sum, which the interpreter's
    numpy matmul needs for equal keys to give equal logits; a GPU's tensor cores give equal
    columns equal bits for any values).
    ``extra_cmp``: compressed blocks k_cmp holds beyond what the queries see (dense only).
    """

    tq: int = 64
    sel_block: int = 16
    n: int = 4
    extra_cmp: int = 0
    keys: str = "randn"


def make_inputs(
    case: Case, gen: torch.Generator, dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """q [B, Tq, HQ, dk], k_cmp [B, N, H, dk] (drawn in float32, cast to dtype), cu_seqlens."""
    q = torch.randn(case.batch, case.tq, case.hq, case.dk, generator=gen)
    if case.keys == "palette_grid":
        q = _grid(q.shape, gen)
    cu = None
    if case.seqlens is not None:
        cu = torch.tensor([0, *torch.tensor(case.seqlens).cumsum(0).tolist()], dtype=torch.int32)
        num = int(cmp_cu_seqlens(cu, case.cmp_block, case.cmp_stride)[-1])
    else:
        num = num_cmp_blocks(case.q_start + case.tq, case.cmp_block, case.cmp_stride)
        num += case.extra_cmp
    if case.keys.startswith("palette"):
        k = palette_keys(case, num, gen)
    else:
        k = torch.randn(case.batch, num, case.h, case.dk, generator=gen)
    cu_dev = cu.to(device) if cu is not None else None
    return q.to(device, dtype), k.to(device, dtype), cu_dev


def palette_keys(case: Case, num: int, gen: torch.Generator) -> torch.Tensor:
    """k_cmp [B, num, H, dk] whose block i repeats ``palette[(i // r) % 3][i % r]``.

    Selection block j's band (blocks j*r - L + 1 .. j*r + r - 1) then depends on j mod 3 only
    (away from block 0): the scores of all j in one class are exactly tied, wherever they sit,
    and the classes differ by O(1).
    """
    ratio = case.sel_block // case.cmp_stride
    shape = (3, ratio, case.batch, case.h, case.dk)
    palette = (
        _grid(shape, gen) if case.keys == "palette_grid" else torch.randn(shape, generator=gen)
    )
    i = torch.arange(num)
    return palette[(i // ratio) % 3, i % ratio].permute(1, 0, 2, 3).contiguous()


def _grid(shape: tuple[int, ...] | torch.Size, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(-2, 3, tuple(shape), generator=gen).float() / 2


def positions(case: Case, cu: torch.Tensor | None) -> torch.Tensor:
    return row_positions(case.tq, case.q_start, cu.cpu() if cu is not None else None)


def reference_selection(
    case: Case, q: torch.Tensor, k: torch.Tensor, cu: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(indices, counts, scores) of the nsa_core reference on the same inputs."""
    args = (case.cmp_block, case.cmp_stride, case.sel_block)
    idx, cnt = select_blocks(q, k, *args, case.n, q_start=case.q_start, cu_seqlens=cu)
    scores = reference_scores(q, k, *args, q_start=case.q_start, cu_seqlens=cu)
    return idx, cnt, scores


def reference_lse(
    case: Case, q: torch.Tensor, k: torch.Tensor, cu: torch.Tensor | None
) -> torch.Tensor:
    """float32 [B, Tq, HQ]: log sum_i exp(scale q.k_cmp[i]) over visible blocks, in float64.

    -inf on rows that see no block. Computed on q's device, 256 rows at a time.
    """
    scale = case.dk**-0.5
    pos = positions(case, cu).to(q.device)
    out = torch.full(q.shape[:3], float("-inf"), dtype=torch.float64, device=q.device)
    if cu is None:
        seqs, cmp_seqs = [(0, case.tq)], [(0, k.shape[1])]
    else:
        seqs = spans(cu.cpu())
        cmp_seqs = spans(cmp_cu_seqlens(cu.cpu(), case.cmp_block, case.cmp_stride))
    for (s, e), (cs, ce) in zip(seqs, cmp_seqs, strict=True):
        keys = k[:, cs:ce].double().repeat_interleave(case.group, dim=2)  # [B, N, HQ, dk]
        blocks = torch.arange(ce - cs, device=q.device)
        for r0 in range(s, e, 256):
            r1 = min(e, r0 + 256)
            visible = blocks[None, :] * case.cmp_stride + case.cmp_block - 1 <= pos[r0:r1, None]
            logits = torch.einsum("bthd,bnhd->bthn", q[:, r0:r1].double(), keys) * scale
            logits = logits.masked_fill(~visible[None, :, None, :], float("-inf"))
            out[:, r0:r1] = torch.logsumexp(logits, dim=-1)
    return out.float()


def check(
    case: Case,
    got: tuple[torch.Tensor, torch.Tensor],
    ref: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    cu: torch.Tensor | None,
    *,
    exact_ties: bool = False,
) -> IndexContractReport:
    """Assert the index contract of docs/spec.md; the report says how many rows it excused."""
    indices, counts = got
    assert indices.dtype == torch.int32
    assert counts.dtype == torch.int32
    ref_idx, _, scores = ref
    return assert_index_contract(
        indices, counts, ref_idx, scores, positions(case, cu), case.sel_block, exact_ties=exact_ties
    )


def run_select_blocks_triton(
    case: Case,
    q: torch.Tensor,
    k: torch.Tensor,
    cu: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    config: ScoreConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton select_blocks on q [B, Tq, HQ, dk], k_cmp [B, N, H, dk] with ``case``'s
    geometry and q_start: indices [B, Tq, H, n] int32 and counts [B, Tq, H] int32."""
    # Imported on use: the test modules import this testlib before importorskip("triton").
    from nsa_kernels.scoring.function import select_blocks_triton

    return select_blocks_triton(
        q,
        k,
        case.cmp_block,
        case.cmp_stride,
        case.sel_block,
        case.n,
        q_start=case.q_start,
        cu_seqlens=cu,
        lse=lse,
        config=config,
    )
