"""FlashAttention-2 adapters for the sliding and compressed branches, and their torch fallbacks.

Every function here has the signature of the nsa-core reference op it replaces:

* ``sliding_attention_{fa2,flex,sdpa}(q, k, v, window, scale=None, *, q_start=0, cu_seqlens=None)``
* ``compressed_attention_{fa2,flex,sdpa}(q, k_cmp, v_cmp, cmp_block, cmp_stride, scale=None, *,
  q_start=0, cu_seqlens=None)``

:func:`backends` lists them as registry backends; :mod:`nsa_kernels.fa2.routing` says when each
serves.
"""

from __future__ import annotations

from nsa_core.registry import Backend
from nsa_kernels.fa2.compressed import compressed_attention_fa2
from nsa_kernels.fa2.flex import compressed_attention_flex, sliding_attention_flex
from nsa_kernels.fa2.routing import (
    FA2_PRIORITY,
    FLEX_PRIORITY,
    SDPA_PRIORITY,
    fa2_compressed_supports,
    fa2_requested,
    fa2_sliding_supports,
    flex_supports,
    sdpa_supports,
)
from nsa_kernels.fa2.sdpa import compressed_attention_sdpa, sliding_attention_sdpa
from nsa_kernels.fa2.sliding import sliding_attention_fa2


def backends() -> list[Backend]:
    """The FA-2 backends of both branches and the torch fallbacks that stand in for them."""
    return [
        Backend(
            op="sliding_attention",
            name="fa2",
            fn=sliding_attention_fa2,
            supports=fa2_sliding_supports,
            priority=FA2_PRIORITY,
            requested_by=fa2_requested,
        ),
        Backend(
            op="compressed_attention",
            name="fa2",
            fn=compressed_attention_fa2,
            supports=fa2_compressed_supports,
            priority=FA2_PRIORITY,
            requested_by=fa2_requested,
        ),
        Backend(
            op="sliding_attention",
            name="flex",
            fn=sliding_attention_flex,
            supports=flex_supports,
            priority=FLEX_PRIORITY,
        ),
        Backend(
            op="compressed_attention",
            name="flex",
            fn=compressed_attention_flex,
            supports=flex_supports,
            priority=FLEX_PRIORITY,
        ),
        Backend(
            op="sliding_attention",
            name="sdpa",
            fn=sliding_attention_sdpa,
            supports=sdpa_supports,
            priority=SDPA_PRIORITY,
        ),
        Backend(
            op="compressed_attention",
            name="sdpa",
            fn=compressed_attention_sdpa,
            supports=sdpa_supports,
            priority=SDPA_PRIORITY,
        ),
    ]


__all__ = [
    "backends",
    "compressed_attention_fa2",
    "compressed_attention_flex",
    "compressed_attention_sdpa",
    "sliding_attention_fa2",
    "sliding_attention_flex",
    "sliding_attention_sdpa",
]
