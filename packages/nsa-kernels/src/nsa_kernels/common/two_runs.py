"""A tensor or its :class:`RowRuns` as a kernel reads it: at most two runs.

The folded cuDNN compressed branch leaves its output as the full rows' run and a short tail
(:mod:`nsa_kernels.compressed.cudnn`). The kernels that read o_cmp in place (the selected
branch's gated forward, the gated combine's backward) take two row pointers, the first run's
start and length, and a CMP_RUNS flag; one run from row 0 goes as a plain tensor (the kernel
without CMP_RUNS), and more than two runs are put in one tensor first.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from nsa_kernels.common.row_runs import RowRuns


@dataclass(frozen=True)
class TwoRuns:
    """x [B, T, HQ, D] for a kernel: rows ``[0, start)`` read 0, ``first`` [B, first_rows,
    HQ, D] holds the rows from ``start``, ``second`` the rest; ``runs`` False: ``first`` is x
    itself (``second`` is it again, start 0)."""

    first: Tensor
    second: Tensor
    start: int
    first_rows: int
    runs: bool


def two_runs(x: Tensor | RowRuns) -> TwoRuns:
    """x as :class:`TwoRuns`: one run from row 0 as the plain tensor, more than two assembled."""
    if isinstance(x, RowRuns) and ((x.start == 0 and len(x.runs) == 1) or len(x.runs) > 2):
        x = x.assemble()
    if isinstance(x, Tensor):
        return TwoRuns(first=x, second=x, start=0, first_rows=x.shape[1], runs=False)
    first, last = x.runs[0], x.runs[-1]
    return TwoRuns(first=first, second=last, start=x.start, first_rows=first.shape[1], runs=True)
