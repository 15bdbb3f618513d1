"""q [B, T, HQ, dk] for the three branches, its three gradients summed in one pass.

Autograd adds the branches' gradients of q two at a time (two reads and a write of q's size per
add); the Triton combine's three-way sum reads each once and writes once. The price is memory:
the three gradients are alive together until the last arrives (NSA_COMBINE_GRAD_SUM=0 gives it
back).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Sum3 = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class _FanOut(torch.autograd.Function):
    """Three views of x; backward: their gradients summed by ``sum3`` where all three arrive
    (and no graph is built through them), else added by torch."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, sum3: Sum3
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ctx.sum3 = sum3
        return x.view_as(x), x.view_as(x), x.view_as(x)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, None]:
        present = [g for g in grads if g is not None]
        if not present:
            return None, None
        if len(present) == 3 and not torch.is_grad_enabled():
            return ctx.sum3(*present), None
        total = present[0]
        for g in present[1:]:
            total = total + g
        return total, None


def fan_out(q: torch.Tensor, sum3: Sum3 | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_cmp, q_sel, q_win): three views of q whose gradients ``sum3`` adds in one pass, where
    q takes a gradient and a ``sum3`` is given; else (q, q, q), at no cost."""
    if sum3 is None or not (torch.is_grad_enabled() and q.requires_grad):
        return q, q, q
    views: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = _FanOut.apply(q, sum3)  # type: ignore[no-untyped-call]
    return views
