"""The backends of the gated combine (``gated_combine``) and their priorities.

The registry asks them from the highest priority down; the first whose ``supports`` returns
``None`` serves, and nsa-core's reference (priority 0: the combine in plain torch, in the
inputs' dtype) serves whatever they all decline: CPU, float64, ``NSA_COMBINE_BACKEND=reference``.

| priority | backend | serves when |
|---|---|---|
| 20 | ``triton_combine`` | CUDA and triton, fp16/bf16/fp32 (forward and backward, any dv) |

It multiplies in float32 without ``tl.dot``, so Triton's interpreter computes it in bfloat16 too,
within the spec's bound (its float32 to bfloat16 rounding goes toward zero:
:data:`~nsa_kernels.common.triton_inputs.BF16_ROUNDING`).

The fused core (:mod:`nsa_kernels.core`) also sums the branches' three gradients of q in one
pass with this backend's kernels where it serves.
"""

from __future__ import annotations

from nsa_core.registry import Backend, OpContext
from nsa_core.toggles import Toggles
from nsa_kernels.common.triton_routing import triton_decline_reason, triton_fn

OP = "gated_combine"
TRITON_PRIORITY = 20
TRITON_NAME = "triton_combine"


def triton_combine_supports(ctx: OpContext, toggles: Toggles) -> str | None:
    """Why the Triton combine cannot serve ``ctx``, or None (it loops over dv: no head-dim cap)."""
    return triton_decline_reason(ctx, max_head_dim=None, fault=None)


def backends() -> list[Backend]:
    """The gated combine's backends, highest priority first: the docstring's table, one row each
    as ``Backend(op, name, fn, supports, priority)``."""
    triton = triton_fn("nsa_kernels.combine.function", "gated_combine_triton")
    return [Backend(OP, TRITON_NAME, triton, triton_combine_supports, TRITON_PRIORITY)]
