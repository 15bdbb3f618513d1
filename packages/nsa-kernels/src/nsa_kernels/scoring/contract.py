"""The index contract of block scoring on a GPU (docs/spec.md, "Block scoring on a GPU: the
index contract"), as a checker that tests and benches share.

A kernel's selection equals the reference's on every (b, t, kv head) row, except rows whose
reference scores put the n-th and (n+1)-th best non-forced blocks within ``rel_tol * S_n +
abs_tol`` of each other ("tolerance rows"). There the kernel may swap blocks across that
boundary, but only blocks whose reference scores lie within the same tolerance of it. With
``exact_ties`` (inputs whose only exact ties come from equal compressed keys) a trade between
two blocks of exactly equal reference score is a violation: among equal scores the lower j is
kept first, bit for bit.

Pure torch; no Triton needed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import ParamSpec

import torch

from nsa_core.blocks import cmp_cu_seqlens, num_sel_blocks
from nsa_core.checks import check_int, check_rank, shape
from nsa_core.reference.common import spans
from nsa_core.reference.selection import block_scores
from nsa_kernels.common.entry_checks import check_bool

P = ParamSpec("P")

# Relative score tolerance: 2^-14 (about 6.1e-5, 512 float32 ulps). docs/spec.md says why.
SCORE_REL_TOL = 2.0**-14
# Scores below this count as 0: float32 exp flushes what falls under 2^-126 on GPUs.
SCORE_ABS_TOL = 2.0**-100


@dataclass(frozen=True)
class IndexContractReport:
    """Outcome of :func:`check_index_contract` over ``rows`` (b, t, kv head) rows.

    tolerance_rows: rows whose boundary gap is within the tolerance (excused from equality);
    swapped_rows: tolerance rows whose index set differs from the reference's (each swap
    within the tolerance); broken_rows: rows that break the contract; first_broken: what the
    first broken row looks like ("" when none).
    """

    rows: int
    tolerance_rows: int
    swapped_rows: int
    broken_rows: int
    first_broken: str

    @property
    def tolerance_fraction(self) -> float:
        return self.tolerance_rows / max(self.rows, 1)


def row_positions(
    tq: int, q_start: int = 0, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """int64 [Tq]: the position of each query row (local to its sequence when varlen)."""
    if cu_seqlens is None:
        return torch.arange(q_start, q_start + tq)
    parts = [torch.arange(e - s) for s, e in spans(cu_seqlens)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def reference_scores(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    cmp_block: int,
    cmp_stride: int,
    sel_block: int,
    scale: float | None = None,
    *,
    q_start: int = 0,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """S [B, Tq, H, Nsel] of the reference (``block_scores``), sequence by sequence when varlen.

    Varlen rows are padded with zeros to the longest sequence's Nsel (those blocks are invalid
    for the row and never read).
    """
    if cu_seqlens is None:
        return block_scores(q, k_cmp, cmp_block, cmp_stride, sel_block, scale, q_start=q_start)
    seqs = spans(cu_seqlens)
    cmp_seqs = spans(cmp_cu_seqlens(cu_seqlens, cmp_block, cmp_stride))
    n_sel = max([num_sel_blocks(e - s, sel_block) for s, e in seqs] + [1])
    out = torch.zeros(
        q.shape[0], q.shape[1], k_cmp.shape[2], n_sel, dtype=torch.float32, device=q.device
    )
    for (s, e), (cs, ce) in zip(seqs, cmp_seqs, strict=True):
        part = block_scores(q[:, s:e], k_cmp[:, cs:ce], cmp_block, cmp_stride, sel_block, scale)
        out[:, s:e, :, : part.shape[-1]] = part
    return out


def check_index_contract(
    indices: torch.Tensor,
    counts: torch.Tensor,
    ref_indices: torch.Tensor,
    ref_scores: torch.Tensor,
    positions: torch.Tensor,
    sel_block: int,
    *,
    rel_tol: float = SCORE_REL_TOL,
    abs_tol: float = SCORE_ABS_TOL,
    exact_ties: bool = False,
) -> IndexContractReport:
    """Compare a kernel's selection with the reference's under the index contract.

    Args:
        indices: [B, Tq, H, n] int32 of the kernel; counts: [B, Tq, H] int32 of the kernel.
        ref_indices: [B, Tq, H, n] of the reference (``select_blocks``).
        ref_scores: [B, Tq, H, Nsel] reference scores (:func:`reference_scores`).
        positions: [Tq] position of each row (:func:`row_positions`).
        sel_block: l'.
        exact_ties: blocks of exactly equal reference score must be kept lower j first (for
            inputs whose exact ties all come from equal keys).

    Every row must also be well formed: distinct valid blocks (j <= t // l') in ascending
    order, then -1, the forced blocks present, and ``counts`` equal to its entries.
    """
    _check_contract_args(
        indices, counts, ref_indices, ref_scores, positions, sel_block, rel_tol, abs_tol,
        exact_ties,
    )  # fmt: skip
    batch, tq, h, n = ref_indices.shape
    rows = batch * tq * h
    if rows == 0:
        return IndexContractReport(0, 0, 0, 0, "")
    n_sel = ref_scores.shape[-1]
    got = indices.detach().cpu().long().reshape(rows, n)
    want = ref_indices.detach().cpu().long().reshape(rows, n)
    got_count = counts.detach().cpu().long().reshape(rows)
    scores = ref_scores.detach().cpu().double().reshape(rows, n_sel)
    jt = row_blocks(positions, sel_block, batch, h)

    j = torch.arange(n_sel).unsqueeze(0)
    valid = j <= jt.unsqueeze(1)
    forced = valid & ((j == 0) | (j == jt.unsqueeze(1)) | (j == jt.unsqueeze(1) - 1))
    member, well_formed = _membership(got, got_count, jt, n_sel)
    ref_member, _ = _membership(want, None, jt, n_sel)
    # All forced blocks are in (when n holds them all; else the equality below decides).
    well_formed &= ~(forced & ~member).any(dim=1) | (forced.sum(dim=1) > n)
    same = (member == ref_member).all(dim=1)

    boundary = score_boundary(scores, jt, n)
    last_kept, first_left = boundary.last_kept, boundary.first_left
    gap = last_kept - first_left
    tol = rel_tol * last_kept.abs() + abs_tol
    tolerance = boundary.exists & (gap <= tol)

    # In a tolerance row a swap may only trade blocks that sit within tol of the boundary.
    swapped_in = member & ~ref_member
    swapped_out = ref_member & ~member
    in_ok = (~swapped_in | (scores >= (last_kept - tol).unsqueeze(1))).all(dim=1)
    out_ok = (~swapped_out | (scores <= (first_left + tol).unsqueeze(1))).all(dim=1)
    excused = tolerance & in_ok & out_ok & (member.sum(dim=1) == ref_member.sum(dim=1))
    if exact_ties:
        excused &= _lower_j_first(member, scores, ~same)
    broken = ~well_formed | (~same & ~excused)

    first = ""
    if broken.any():
        r = int(broken.nonzero()[0, 0])
        b, rest = divmod(r, tq * h)
        t, kv = divmod(rest, h)
        first = (
            f"row b={b} t={int(positions[t])} h={kv}: kernel {got[r].tolist()} "
            f"(count {int(got_count[r])}), reference {want[r].tolist()}, boundary gap "
            f"{float(gap[r]):.3e} vs tolerance {float(tol[r]):.3e}, well formed "
            f"{bool(well_formed[r])}"
        )
    return IndexContractReport(
        rows=rows,
        tolerance_rows=int(tolerance.sum()),
        swapped_rows=int((tolerance & ~same & excused).sum()),
        broken_rows=int(broken.sum()),
        first_broken=first,
    )


def _check_contract_args(
    indices: torch.Tensor, counts: torch.Tensor, ref_indices: torch.Tensor,
    ref_scores: torch.Tensor, positions: torch.Tensor, sel_block: object, rel_tol: object,
    abs_tol: object, exact_ties: object,
) -> None:  # fmt: skip
    """The rules of :func:`check_index_contract`'s arguments (docs/spec.md, "Argument rules");
    the tensors are checked to be tensors first, whatever their annotations say."""
    check_rank("ref_indices", ref_indices, 4, "[B, Tq, H, n]")
    check_rank("indices", indices, 4, "[B, Tq, H, n]")
    check_rank("counts", counts, 3, "[B, Tq, H]")
    check_rank("ref_scores", ref_scores, 4, "[B, Tq, H, Nsel]")
    check_rank("positions", positions, 1, "[Tq]")
    for name, t in (("indices", indices), ("counts", counts), ("ref_indices", ref_indices),
                    ("positions", positions)):  # fmt: skip
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got {t.dtype}")
    if not ref_scores.is_floating_point():
        raise TypeError(f"ref_scores must be a floating-point tensor, got {ref_scores.dtype}")
    batch, tq, h, n = ref_indices.shape
    if tuple(indices.shape) != (batch, tq, h, n) or tuple(counts.shape) != (batch, tq, h):
        raise ValueError(
            f"kernel outputs {shape(indices)}, {shape(counts)} do not match the reference's "
            f"{shape(ref_indices)}"
        )
    if tuple(ref_scores.shape[:3]) != (batch, tq, h):
        raise ValueError(
            f"ref_scores {shape(ref_scores)} must be [B={batch}, Tq={tq}, H={h}, Nsel]"
        )
    if positions.shape[0] != tq:
        raise ValueError(f"positions {shape(positions)} must hold one position per row, Tq={tq}")
    check_int("sel_block", sel_block, 1)
    for name, tol in (("rel_tol", rel_tol), ("abs_tol", abs_tol)):
        if isinstance(tol, bool) or not isinstance(tol, (int, float)):
            raise TypeError(f"{name} must be a float, got {type(tol).__name__} {tol!r}")
        if not math.isfinite(tol) or tol < 0:
            raise ValueError(f"{name} must be finite and >= 0, got {tol}")
    check_bool("exact_ties", exact_ties)


def _raising_on_broken_rows(
    check: Callable[P, IndexContractReport],
) -> Callable[P, IndexContractReport]:
    """``check`` that raises AssertionError when its report has a broken row."""

    def assert_index_contract(*args: P.args, **kwargs: P.kwargs) -> IndexContractReport:
        """:func:`check_index_contract` (the same arguments), raising AssertionError on any
        broken row."""
        report = check(*args, **kwargs)
        if report.broken_rows:
            raise AssertionError(
                f"{report.broken_rows} of {report.rows} rows break the index contract "
                f"({report.tolerance_rows} tolerance rows); first: {report.first_broken}"
            )
        return report

    return assert_index_contract


assert_index_contract = _raising_on_broken_rows(check_index_contract)


@dataclass(frozen=True)
class ScoreBoundary:
    """Per row: the n-th best non-forced score the reference keeps and the next one it leaves.

    exists: the row has a boundary (a free slot and more candidates than free slots);
    last_kept, first_left: float64 scores (-inf where there is no such block).
    """

    exists: torch.Tensor
    last_kept: torch.Tensor
    first_left: torch.Tensor


def row_blocks(positions: torch.Tensor, sel_block: int, batch: int, heads: int) -> torch.Tensor:
    """jt = t // l' [B * Tq * H] for rows flattened in (b, t, h) order."""
    jt = positions.cpu().long() // sel_block
    return jt.view(1, -1, 1).expand(batch, -1, heads).reshape(-1)


def score_boundary(scores: torch.Tensor, jt: torch.Tensor, num_selected: int) -> ScoreBoundary:
    """The top-n boundary of reference scores [rows, Nsel] for rows whose own block is jt [rows]."""
    rows, n_sel = scores.shape
    j = torch.arange(n_sel, device=scores.device).unsqueeze(0)
    valid = j <= jt.unsqueeze(1)
    forced = valid & ((j == 0) | (j == jt.unsqueeze(1)) | (j == jt.unsqueeze(1) - 1))
    free = (num_selected - forced.sum(dim=1)).clamp(min=0)
    candidates = (valid & ~forced).sum(dim=1)
    ranked = torch.where(valid & ~forced, scores.double(), -torch.inf)
    ranked = ranked.sort(dim=1, descending=True).values
    ranked = torch.cat([ranked, ranked.new_full((rows, 1), -torch.inf)], dim=1)
    return ScoreBoundary(
        exists=(free > 0) & (candidates > free),
        last_kept=ranked.gather(1, (free - 1).clamp(0, n_sel).unsqueeze(1)).squeeze(1),
        first_left=ranked.gather(1, free.clamp(max=n_sel).unsqueeze(1)).squeeze(1),
    )


def _lower_j_first(member: torch.Tensor, scores: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[rows] bool: no kept block has a left block of exactly its score and a lower j.

    Checked on the rows where ``rows`` is true (the others pass): [k, Nsel, Nsel] pairs.
    """
    ok = torch.ones(member.shape[0], dtype=torch.bool)
    picked = rows.nonzero().squeeze(1)
    if picked.numel() == 0:
        return ok
    kept = member[picked]
    s = scores[picked]
    n_sel = s.shape[1]
    lower = torch.arange(n_sel).unsqueeze(1) > torch.arange(n_sel).unsqueeze(0)  # [a, b]: b < a
    equal = s.unsqueeze(2) == s.unsqueeze(1)  # [k, a, b]
    skipped = kept.unsqueeze(2) & ~kept.unsqueeze(1) & equal & lower
    ok[picked] = ~skipped.flatten(1).any(dim=1)
    return ok


def _membership(
    idx: torch.Tensor, count: torch.Tensor | None, jt: torch.Tensor, n_sel: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(member [rows, Nsel] bool, well_formed [rows] bool) of index rows [rows, n]."""
    rows, n = idx.shape
    present = idx >= 0
    entries = present.sum(dim=1)
    # Entries first, then only -1; strictly ascending; each a valid block of its row.
    packed = (present.long().cumsum(dim=1) == torch.arange(1, n + 1)).sum(dim=1) == entries
    ascending = ((idx[:, 1:] > idx[:, :-1]) | ~present[:, 1:]).all(dim=1)
    in_range = (~present | (idx <= jt.unsqueeze(1))).all(dim=1)
    well_formed = packed & ascending & in_range & ((idx >= -1).all(dim=1))
    if count is not None:
        well_formed &= count == entries
    member = torch.zeros(rows, n_sel + 1, dtype=torch.bool)
    slot = torch.where(present & (idx < n_sel), idx, torch.full_like(idx, n_sel))
    member.scatter_(1, slot, True)
    return member[:, :n_sel], well_formed
