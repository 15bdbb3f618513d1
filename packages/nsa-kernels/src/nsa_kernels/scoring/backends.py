"""The backends of block scoring and top-n (``select_blocks``) and their priorities.

The registry asks them from the highest priority down; the first whose ``supports`` returns
``None`` serves, and nsa-core's reference (priority 0, float64-accumulated logits) serves whatever
they all decline. A GPU backend keeps the index contract of docs/spec.md ("Block scoring on a
GPU"): its index sets equal the reference's except on rows whose n-th and (n+1)-th scores are
within the stated tolerance.

| priority | backend | serves when |
|---|---|---|
| 20 | ``triton_score`` | CUDA and triton, fp16/bf16/fp32, head dims <= 256; not bf16 under |
| | | ``TRITON_INTERPRET=1`` (the interpreter's bf16 ``tl.dot`` is wrong) |
"""

from __future__ import annotations

from nsa_core.registry import Backend, OpContext
from nsa_core.toggles import Toggles
from nsa_kernels.common.triton_routing import triton_decline_reason, triton_fn

OP = "select_blocks"
TRITON_PRIORITY = 20


def triton_score_supports(ctx: OpContext, toggles: Toggles) -> str | None:
    return triton_decline_reason(ctx)


def backends() -> list[Backend]:
    """Block scoring's backends, highest priority first: the docstring's table, one row each as
    ``Backend(op, name, fn, supports, priority)``."""
    triton = triton_fn("nsa_kernels.scoring.function", "select_blocks_triton")
    return [Backend(OP, "triton_score", triton, triton_score_supports, TRITON_PRIORITY)]
