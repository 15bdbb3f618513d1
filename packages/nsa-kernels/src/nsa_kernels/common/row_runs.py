"""A branch output held as runs of consecutive rows, for a consumer that reads it in place.

A backend that computes its rows in several calls (the folded cuDNN compressed branch:
:mod:`nsa_kernels.compressed.cudnn`) has each call's rows in a buffer of its own. Putting them
in one tensor is a copy of the whole output; a consumer that can read the runs where they lie
(the selected branch's gated launch, which the fused core, :mod:`nsa_kernels.core`, hands them
to) skips it, and every other consumer calls :meth:`RowRuns.assemble`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from nsa_core.checks import check_gated_combine, check_rank, check_same_place, shape
from nsa_core.op_context import OpContext


@dataclass(frozen=True)
class RowRuns:
    """x [B, T, HQ, D] as runs: rows ``[0, start)`` are 0, then ``runs[0]`` [B, n_0, HQ, D],
    ``runs[1]`` [B, n_1, HQ, D], ... in row order, ending at row T. Each run has unit stride
    in D; the runs share dtype and device."""

    start: int
    runs: tuple[torch.Tensor, ...]

    def __post_init__(self) -> None:
        if self.start < 0:
            raise ValueError(f"start must be >= 0, got {self.start}")
        if not self.runs:
            raise ValueError("RowRuns needs at least one run (a run may hold 0 rows)")
        first = self.runs[0]
        for i, run in enumerate(self.runs):
            check_rank(f"runs[{i}]", run, 4, "[B, n, HQ, D]")
            if run.shape[0] != first.shape[0] or run.shape[2:] != first.shape[2:]:
                raise ValueError(f"runs[{i}] {shape(run)} differs from runs[0] {shape(first)}")
            check_same_place(f"runs[{i}]", run, "runs[0]", first)
            if run.shape[3] > 1 and run.stride(3) != 1:
                raise ValueError(f"runs[{i}] needs unit stride in D, has strides {run.stride()}")

    @classmethod
    def whole(cls, x: torch.Tensor) -> RowRuns:
        """x [B, T, HQ, D] as one run from row 0 (no copy)."""
        return cls(start=0, runs=(x,))

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(B, T, HQ, D) of the tensor the runs make up."""
        batch, _, heads, dim = self.runs[0].shape
        return batch, self.rows, heads, dim

    @property
    def rows(self) -> int:
        """T: the zero rows and every run's."""
        return self.start + sum(run.shape[1] for run in self.runs)

    @property
    def dtype(self) -> torch.dtype:
        return self.runs[0].dtype

    @property
    def device(self) -> torch.device:
        return self.runs[0].device

    def assemble(self) -> torch.Tensor:
        """The tensor [B, T, HQ, D]: a run from row 0 alone is returned as it is, else the
        zero rows and the runs are copied into a new tensor (differentiable in each run: its
        gradient is its rows of the upstream gradient, a view)."""
        if self.start == 0 and len(self.runs) == 1:
            return self.runs[0]
        if torch.is_grad_enabled() and any(run.requires_grad for run in self.runs):
            out = _Assemble.apply(self.start, *self.runs)  # type: ignore[no-untyped-call]
            assert isinstance(out, torch.Tensor)
            return out
        return _assembled(self.start, self.runs)


def _assembled(start: int, runs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The zero rows [0, start) and the runs after them, copied into one new tensor."""
    batch, _, heads, dim = runs[0].shape
    rows = start + sum(run.shape[1] for run in runs)
    out = runs[0].new_empty(batch, rows, heads, dim)
    out[:, :start] = 0
    row = start
    for run in runs:
        out[:, row : row + run.shape[1]] = run
        row += run.shape[1]
    return out


class _Assemble(torch.autograd.Function):
    """:meth:`RowRuns.assemble` with a gradient: each run's gradient is a view of its rows of
    the upstream one (autograd's slice assignments would copy the whole gradient per run)."""

    @staticmethod
    def forward(ctx: Any, start: int, *runs: torch.Tensor) -> torch.Tensor:
        ctx.spans = [(start + sum(r.shape[1] for r in runs[:i]), run.shape[1])
                     for i, run in enumerate(runs)]  # fmt: skip
        return _assembled(start, runs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (None, *(grad[:, row : row + n] for row, n in ctx.spans))


def check_gated_combine_runs(
    o_cmp: torch.Tensor | RowRuns, o_win: torch.Tensor, gates: torch.Tensor
) -> OpContext:
    """:func:`nsa_core.checks.check_gated_combine` of (o_cmp, o_sel, o_win, gates) for the
    one-step gated sum, o_sel not yet computed: o_cmp may be a :class:`RowRuns` (its own checks
    hold the runs alike; the tensor they make up must match o_win). The context needs a
    gradient where a run needs one, as where o_cmp is one tensor."""
    if not isinstance(o_cmp, RowRuns):
        return check_gated_combine(o_cmp, o_cmp, o_win, gates)
    if o_cmp.shape != tuple(o_win.shape):
        raise ValueError(f"o_cmp's runs make {list(o_cmp.shape)}, o_win is {shape(o_win)}")
    check_same_place("o_cmp", o_cmp.runs[0], "o_win", o_win)
    ctx = check_gated_combine(o_win, o_win, o_win, gates)
    runs_grad = torch.is_grad_enabled() and any(run.requires_grad for run in o_cmp.runs)
    return dataclasses.replace(ctx, requires_grad=ctx.requires_grad or runs_grad)


def as_tensor(x: torch.Tensor | RowRuns) -> torch.Tensor:
    """x itself, or the tensor its runs make up (:meth:`RowRuns.assemble`)."""
    return x.assemble() if isinstance(x, RowRuns) else x
