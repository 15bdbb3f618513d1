"""The attention core (``attention_core``): the fused backend and its priority.

The registry asks it first; nsa-core's reference core (priority 0: the step ops one by one)
serves whatever it declines.

| priority | backend | serves when |
|---|---|---|
| 20 | ``fused`` | CUDA and triton, fp16/bf16/fp32, head dims <= 256, no debug hook on; not |
| | | bf16 under ``TRITON_INTERPRET=1`` (the interpreter's bf16 ``tl.dot`` is wrong) |

Inside, each step still runs on the backend the registry picks for it (:mod:`.plan`), so every
step toggle keeps its meaning. The debug hooks observe the steps one by one, which the fused
core's hand-offs bypass: with a hook on, the reference core serves.
"""

from __future__ import annotations

from nsa_core.registry import CORE_OP, Backend, OpContext
from nsa_core.toggles import Toggles
from nsa_kernels.common.triton_routing import triton_decline_reason

NAME = "fused"
PRIORITY = 20


def fused_core_supports(ctx: OpContext, toggles: Toggles) -> str | None:
    """Why the fused core cannot serve ``ctx``, or None."""
    if toggles.debug_hooks:
        return "a debug hook is on (NSA_DEBUG_SHAPES/TIMING/COMPARE observe the steps one by one)"
    return triton_decline_reason(ctx)


def backends() -> list[Backend]:
    """The attention core's backends, highest priority first: the docstring's table."""
    from nsa_kernels.core.fused import FusedCore

    return [Backend(CORE_OP, NAME, FusedCore(), fused_core_supports, PRIORITY)]
