"""The backends of rotary embedding (``apply_rope``) and their priorities.

The registry asks them from the highest priority down; the first whose ``supports`` returns
``None`` serves, and nsa-core's reference (priority 0) serves whatever they all decline: CPU,
float64, ``NSA_ROPE_BACKEND=reference``.

| priority | backend | serves when |
|---|---|---|
| 20 | ``triton_rope`` | CUDA and triton, fp16/bf16/fp32 (forward and backward, any even D); |
| | | not bf16 under ``TRITON_INTERPRET=1`` (its rounding breaks the bit-for-bit contract) |
"""

from __future__ import annotations

from nsa_core.registry import Backend, OpContext
from nsa_core.toggles import Toggles
from nsa_kernels.common.triton_inputs import BF16_ROUNDING
from nsa_kernels.common.triton_routing import triton_decline_reason, triton_fn

OP = "apply_rope"
TRITON_PRIORITY = 20


def triton_rope_supports(ctx: OpContext, toggles: Toggles) -> str | None:
    """Why the Triton rotary embedding cannot serve ``ctx``, or None (no head-dim cap)."""
    return triton_decline_reason(ctx, max_head_dim=None, fault=BF16_ROUNDING)


def backends() -> list[Backend]:
    """Rotary embedding's backends, highest priority first: the docstring's table, one row each
    as ``Backend(op, name, fn, supports, priority)``."""
    triton = triton_fn("nsa_kernels.rope.function", "apply_rope_triton")
    return [Backend(OP, "triton_rope", triton, triton_rope_supports, TRITON_PRIORITY)]
