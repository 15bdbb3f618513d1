"""The index-contract checker on hand-made rows: what it excuses and what it rejects.

One kv head, l' = 1 (block j is valid from t = j), n = 5: a row at t = 9 has jt = 9, forced
{0, 8, 9}, and two free slots among the candidates 1 .. 7.
"""

from __future__ import annotations

import pytest
import torch

from nsa_core.reference.selection import topn_blocks
from nsa_kernels.scoring.contract import (
    SCORE_REL_TOL,
    IndexContractReport,
    assert_index_contract,
    check_index_contract,
    row_positions,
)

N = 5
T = 9


def _scores(values: list[float]) -> torch.Tensor:
    """S [1, 1, 1, 10] for the row at t = 9 (blocks 0 .. 9)."""
    return torch.tensor(values, dtype=torch.float32).view(1, 1, 1, -1)


def _row(blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    padded = sorted(blocks) + [-1] * (N - len(blocks))
    return (
        torch.tensor(padded, dtype=torch.int32).view(1, 1, 1, N),
        torch.tensor([len(blocks)], dtype=torch.int32).view(1, 1, 1),
    )


def _ref(values: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    scores = _scores(values)
    return topn_blocks(scores, N, 1, q_start=T)[0], scores


def _check(
    scores: torch.Tensor, blocks: list[int], *, exact_ties: bool = False
) -> IndexContractReport:
    ref_idx, _ = topn_blocks(scores, N, 1, q_start=T)
    idx, cnt = _row(blocks)
    return check_index_contract(
        idx, cnt, ref_idx, scores, row_positions(1, T), 1, exact_ties=exact_ties
    )


# Candidates 1 .. 7; the reference keeps 3 and 6 (the two best), the next is 5.
CLEAR = [0.0, 0.1, 0.2, 0.9, 0.3, 0.5, 0.8, 0.4, 0.0, 0.0]


def test_equal_sets_pass() -> None:
    report = _check(_scores(CLEAR), [0, 3, 6, 8, 9])
    assert report == IndexContractReport(1, 0, 0, 0, "")


def test_a_clear_swap_breaks_the_row() -> None:
    report = _check(_scores(CLEAR), [0, 3, 5, 8, 9])
    assert report.broken_rows == 1
    assert "boundary gap" in report.first_broken
    with pytest.raises(AssertionError, match="break the index contract"):
        assert_index_contract(*_row([0, 3, 5, 8, 9]), *_ref(CLEAR), row_positions(1, T), 1)


def test_a_swap_within_tolerance_is_excused() -> None:
    near = list(CLEAR)
    near[5] = 0.8 * (1 - SCORE_REL_TOL / 2)  # block 5 just under block 6
    report = _check(_scores(near), [0, 3, 5, 8, 9])
    assert (report.tolerance_rows, report.swapped_rows, report.broken_rows) == (1, 1, 0)
    # The same row kept as the reference has it is a tolerance row too, not a swapped one.
    report = _check(_scores(near), [0, 3, 6, 8, 9])
    assert (report.tolerance_rows, report.swapped_rows, report.broken_rows) == (1, 0, 0)


def test_a_swap_beyond_the_near_pair_breaks_the_row() -> None:
    near = list(CLEAR)
    near[5] = 0.8 * (1 - SCORE_REL_TOL / 2)
    # The boundary is a near tie (5 vs 6), but block 7 (0.4) is far below it.
    assert _check(_scores(near), [0, 3, 7, 8, 9]).broken_rows == 1


def test_exact_ties() -> None:
    tied = list(CLEAR)
    tied[5] = 0.8  # blocks 5 and 6 tie: the reference keeps 5 (lower j)
    assert _check(_scores(tied), [0, 3, 5, 8, 9], exact_ties=True).broken_rows == 0
    assert _check(_scores(tied), [0, 3, 6, 8, 9], exact_ties=True).broken_rows == 1
    # Without exact_ties a zero gap is a tolerance row like any near tie.
    report = _check(_scores(tied), [0, 3, 6, 8, 9])
    assert (report.tolerance_rows, report.broken_rows) == (1, 0)


@pytest.mark.parametrize(
    ("row", "count"),
    [
        ([0, 3, 6, 8, 9], 4),  # the count disagrees with the entries
        ([0, 3, 6, 9, -1], 4),  # forced block 8 missing
        ([0, 3, 3, 8, 9], 5),  # a repeat
        ([3, 0, 6, 8, 9], 5),  # not ascending
        ([0, 3, 6, 8, 10], 5),  # a future block (jt = 9)
        ([0, -1, 3, 8, 9], 4),  # padding before an entry
    ],
)
def test_malformed_rows_break(row: list[int], count: int) -> None:
    ref_idx, scores = _ref(CLEAR)
    idx = torch.tensor(row, dtype=torch.int32).view(1, 1, 1, N)
    cnt = torch.tensor([count], dtype=torch.int32).view(1, 1, 1)
    report = check_index_contract(idx, cnt, ref_idx, scores, row_positions(1, T), 1)
    assert report.broken_rows == 1


def test_exact_ties_beside_a_near_tie() -> None:
    """Two tied classes (blocks 1, 4 and blocks 2, 5) within tol of each other: the kernel may
    take either class, but inside a class the lower j first."""
    scores = [0.0, 0.8, 0.8 * (1 - SCORE_REL_TOL / 2), 0.1, 0.8, 0.8 * (1 - SCORE_REL_TOL / 2)]
    scores += [0.2, 0.3, 0.0, 0.0]
    assert _check(_scores(scores), [0, 1, 4, 8, 9], exact_ties=True).broken_rows == 0
    assert _check(_scores(scores), [0, 2, 5, 8, 9], exact_ties=True).broken_rows == 0
    assert _check(_scores(scores), [0, 1, 5, 8, 9], exact_ties=True).broken_rows == 1
    assert _check(_scores(scores), [0, 1, 5, 8, 9]).broken_rows == 0
