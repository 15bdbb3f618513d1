"""A branch output as runs of rows (``RowRuns``): what the runs make up, and their gradients.
The fused core hands the cuDNN compressed branch's runs to the selected launch in place
(tests/test_default_routes_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from nsa_kernels.common.row_runs import RowRuns, as_tensor


def test_assemble_puts_zero_rows_then_the_runs_in_order() -> None:
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 3, 4, 5, generator=gen), torch.randn(2, 4, 4, 5, generator=gen)
    runs = RowRuns(start=2, runs=(a, b))
    assert runs.shape == (2, 9, 4, 5)
    whole = runs.assemble()
    assert whole.shape == (2, 9, 4, 5)
    assert torch.equal(whole[:, :2], torch.zeros(2, 2, 4, 5))
    assert torch.equal(whole[:, 2:5], a)
    assert torch.equal(whole[:, 5:], b)
    assert as_tensor(runs).shape == whole.shape


def test_one_run_from_row_0_is_the_tensor_itself() -> None:
    x = torch.randn(1, 6, 2, 3)
    assert RowRuns.whole(x).assemble() is x
    assert as_tensor(x) is x


@pytest.mark.parametrize(
    ("runs", "start", "match"),
    [
        ((), 0, "at least one run"),
        ((torch.zeros(1, 2, 3, 4),), -1, "start"),
        ((torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 2, 4)), 0, "differs"),
        ((torch.zeros(1, 2, 3, 4), torch.zeros(2, 2, 3, 4)), 0, "differs"),
        ((torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4, dtype=torch.float64)), 0, "dtype"),
        ((torch.zeros(1, 2, 4, 3).transpose(-1, -2),), 0, "unit stride"),
        ((torch.zeros(2, 3, 4),), 0, "runs\\[0\\]"),
    ],
)
def test_runs_are_checked(runs: tuple[torch.Tensor, ...], start: int, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        RowRuns(start=start, runs=runs)


def test_assembled_runs_give_each_run_its_rows_of_the_gradient() -> None:
    gen = torch.Generator().manual_seed(11)
    head = torch.randn(1, 4, 2, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    tail = torch.randn(1, 2, 2, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    whole = RowRuns(start=3, runs=(head, tail)).assemble()
    assert whole.shape == (1, 9, 2, 3)
    torch.testing.assert_close(whole[:, :3], torch.zeros(1, 3, 2, 3, dtype=torch.float64))
    torch.testing.assert_close(whole[:, 3:7], head, rtol=0, atol=0)
    torch.testing.assert_close(whole[:, 7:], tail, rtol=0, atol=0)
    up = torch.randn(1, 9, 2, 3, generator=gen, dtype=torch.float64)
    whole.backward(up)
    assert head.grad is not None
    assert tail.grad is not None
    torch.testing.assert_close(head.grad, up[:, 3:7], rtol=0, atol=0)
    torch.testing.assert_close(tail.grad, up[:, 7:], rtol=0, atol=0)
