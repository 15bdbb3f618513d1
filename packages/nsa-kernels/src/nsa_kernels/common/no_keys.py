"""The output of queries that see no key: zeros that stay in the autograd graph.

docs/spec.md: a query with no visible key gets o = 0 (never NaN), and the reference's
gradients through it are exact zeros. A fallback that returns ``q.new_zeros(...)`` instead cuts
the graph: when every query of a call sees nothing (T < l in the compressed branch, a varlen
batch of short sequences), ``backward()`` raises "does not require grad". ``0 * q`` would stay
in the graph but turn a NaN in q into NaN in rows that cannot see it (docs/spec.md,
"Non-finite values"), so the zeros come from an autograd Function whose backward is zero.
"""

from __future__ import annotations

from typing import Any

import torch


class _NoKeysOutput(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dv: int
    ) -> torch.Tensor:
        ctx.inputs = [(t.shape, t.dtype, t.device) for t in (q, k, v)]
        return q.new_zeros(q.shape[0], q.shape[1], q.shape[2], dv)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        zeros = [
            torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.inputs
        ]
        return zeros[0], zeros[1], zeros[2], None


def no_keys_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """o [B, Tq, HQ, dv] = 0 for q [B, Tq, HQ, dk], k [B, Tk, H, dk], v [B, Tk, H, dv] whose
    queries see no key; its gradients to q, k and v are zeros."""
    dv = v.shape[3]
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out: torch.Tensor = _NoKeysOutput.apply(q, k, v, dv)  # type: ignore[no-untyped-call]
        return out
    return q.new_zeros(q.shape[0], q.shape[1], q.shape[2], dv)
