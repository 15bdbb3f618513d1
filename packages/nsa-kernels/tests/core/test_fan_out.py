"""q's three views for the fused core's branches (nsa_kernels.core.fan_out): their gradients meet
in one three-way sum where all three arrive; everywhere else they cost nothing or add as torch
does."""

from __future__ import annotations

import torch

from nsa_kernels.core.fan_out import Sum3, fan_out


def _recording_sum3(calls: list[tuple[int, ...]]) -> Sum3:
    def sum3(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(a.shape))
        return a + b + c

    return sum3


def test_the_three_gradients_reach_the_sum_once_and_give_q_its_gradient() -> None:
    calls: list[tuple[int, ...]] = []
    q = torch.randn(1, 5, 2, 4, dtype=torch.float64, requires_grad=True)
    views = fan_out(q, _recording_sum3(calls))
    loss = (views[0] ** 2).sum() + (views[1] ** 3).sum() + views[2].sum()
    (dq,) = torch.autograd.grad(loss, q)
    assert calls == [(1, 5, 2, 4)]
    torch.testing.assert_close(dq, 2 * q + 3 * q**2 + 1, rtol=0, atol=1e-12)


def test_no_gradient_or_no_sum_costs_nothing_and_a_double_backward_adds_with_torch() -> None:
    """No gradient, or no sum handed in: q itself three times. A backward that builds a graph
    (create_graph) adds the three gradients with torch, so the sum stays differentiable."""
    calls: list[tuple[int, ...]] = []
    sum3 = _recording_sum3(calls)
    q = torch.randn(1, 5, 2, 4, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        assert all(x is q for x in fan_out(q, sum3))
    assert all(x is q for x in fan_out(q, None))
    views = fan_out(q, sum3)
    assert all(x is not q and x.data_ptr() == q.data_ptr() for x in views)
    loss = (views[0] ** 2).sum() + (views[1] ** 3).sum() + views[2].sum()
    (dq,) = torch.autograd.grad(loss, q, create_graph=True)
    assert calls == []
    torch.testing.assert_close(dq, 2 * q + 3 * q**2 + 1)
    (ddq,) = torch.autograd.grad(dq.sum(), q)
    torch.testing.assert_close(ddq, 2 + 6 * q)
