"""The sliding branch (``sliding_attention``): its backends and their priorities, in one table.

Asked from the highest priority down, the first backend whose ``supports`` answers ``None``
serves the call; whatever all of them decline falls to nsa-core's reference (priority 0).

| priority | backend | serves when |
|---|---|---|
| 30 | ``fa2`` | NSA_WIN_FA2 (default on), flash_attn on CUDA sm80+, fp16/bf16, |
| | | head dims <= 256, at least NSA_WIN_FA2_MIN_LEN tokens |
| 25 | ``triton_win`` | CUDA and triton, fp16/bf16/fp32, head dims <= 256; not bf16 under |
| | | ``TRITON_INTERPRET=1`` (the interpreter's bf16 ``tl.dot`` is wrong) |
| 20 | ``flex`` | CUDA, G a power |
| | | of two, at least ``FLEX_MIN_LEN`` tokens |
| 10 | ``sdpa`` | CUDA, when none of the above accepted |

``triton_win`` sits above Flex as ``triton_cmp`` does in the compressed branch: it was faster
from 16k tokens on and within noise at 8k (docs/performance.md), serves any G, needs no compile
step, and its backward is deterministic. FA-2 stays above it where flash_attn is installed.
The fused core (:mod:`nsa_kernels.core`) has it hand the selected branch each row's softmax over
its forced blocks where the two branches share k and v.
"""

from __future__ import annotations

from nsa_core.registry import Backend, OpContext
from nsa_core.toggles import Toggles
from nsa_kernels.common import fa2_routing as routing
from nsa_kernels.common.flex import sliding_attention_flex
from nsa_kernels.common.sdpa import sliding_attention_sdpa
from nsa_kernels.common.triton_routing import triton_decline_reason, triton_fn
from nsa_kernels.sliding.fa2 import sliding_attention_fa2

OP = "sliding_attention"
# Above Flex, below FA-2 (the docstring's table says why).
TRITON_PRIORITY = 25
TRITON_NAME = "triton_win"


def triton_win_supports(ctx: OpContext, toggles: Toggles) -> str | None:
    """Why the Triton sliding kernels cannot serve ``ctx``, or None."""
    return triton_decline_reason(ctx)


def backends() -> list[Backend]:
    """The sliding branch's backends, highest priority first: the docstring's table, one row
    each as ``Backend(op, name, fn, supports, priority[, requested_by])``."""
    triton = triton_fn("nsa_kernels.sliding.triton_function", "sliding_attention_triton")
    flex, sdpa = sliding_attention_flex.unchecked, sliding_attention_sdpa.unchecked
    fa2_row = (routing.fa2_sliding_supports, routing.FA2_PRIORITY, routing.fa2_sliding_requested)
    return [
        Backend(OP, "fa2", sliding_attention_fa2.unchecked, *fa2_row),
        Backend(OP, "flex", flex, routing.flex_supports, routing.FLEX_PRIORITY),
        Backend(OP, "sdpa", sdpa, routing.sdpa_supports, routing.SDPA_PRIORITY),
        Backend(OP, TRITON_NAME, triton, triton_win_supports, TRITON_PRIORITY),
    ]
