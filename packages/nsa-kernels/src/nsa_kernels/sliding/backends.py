"""The backends of the sliding branch (``sliding_attention``) and their priorities.

The registry asks them from the highest priority down; the first whose ``supports`` returns
``None`` serves, and nsa-core's reference (priority 0) serves whatever they all decline.

| priority | backend | serves when |
|---|---|---|
| 30 | ``fa2`` | NSA_WIN_FA2 (default on), flash_attn on CUDA sm80+, fp16/bf16, |
| | | head dims <= 256, at least NSA_WIN_FA2_MIN_LEN tokens |
| 20 | ``flex`` | CUDA, G a power |
| | | of two, at least ``FLEX_MIN_LEN`` tokens |
| 10 | ``sdpa`` | CUDA, when none of the above accepted |
"""

from __future__ import annotations

from nsa_core.registry import Backend
from nsa_kernels.common.fa2_routing import (
    FA2_PRIORITY,
    FLEX_PRIORITY,
    SDPA_PRIORITY,
    fa2_sliding_requested,
    fa2_sliding_supports,
    flex_supports,
    sdpa_supports,
)
from nsa_kernels.common.flex import sliding_attention_flex
from nsa_kernels.common.sdpa import sliding_attention_sdpa
from nsa_kernels.sliding.fa2 import sliding_attention_fa2

OP = "sliding_attention"


def backends() -> list[Backend]:
    """The sliding branch's backends, highest priority first."""
    return [
        Backend(
            op=OP,
            name="fa2",
            fn=sliding_attention_fa2,
            supports=fa2_sliding_supports,
            priority=FA2_PRIORITY,
            requested_by=fa2_sliding_requested,
        ),
        Backend(
            op=OP,
            name="flex",
            fn=sliding_attention_flex,
            supports=flex_supports,
            priority=FLEX_PRIORITY,
        ),
        Backend(
            op=OP,
            name="sdpa",
            fn=sliding_attention_sdpa,
            supports=sdpa_supports,
            priority=SDPA_PRIORITY,
        ),
    ]
