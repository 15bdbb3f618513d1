"""The backends of the compressed branch (``compressed_attention``) and their priorities.

The registry asks them from the highest priority down; the first whose ``supports`` returns
``None`` serves, and nsa-core's reference (priority 0) serves whatever they all decline.

| priority | backend | serves when |
|---|---|---|
| 35 | ``cudnn`` | NSA_CMP_CUDNN (default on), CUDA sm90+, fp16/bf16, head dims multiples of 8 |
| | | up to 256, dense, q_start = 0, at least 16k tokens, no |
| | | ``torch.use_deterministic_algorithms`` with a gradient (also yields its lse) |
| 30 | ``fa2`` | NSA_CMP_FA2 (default on), flash_attn on CUDA sm80+, fp16/bf16, |
| | | head dims <= 256, at least NSA_CMP_FA2_MIN_LEN tokens |
| 25 | ``triton_cmp`` | CUDA and triton, fp16/bf16/fp32, head dims <= 256 (forward and backward) |
| | | (also yields its log-sum-exp, which block scoring reuses); not bf16 under |
| | | ``TRITON_INTERPRET=1`` (the interpreter's bf16 ``tl.dot`` is wrong) |
| 20 | ``flex`` | CUDA, G a power |
| | | of two, at least ``FLEX_MIN_LEN`` tokens |
| 10 | ``sdpa`` | CUDA, when none of the above accepted |
"""

from __future__ import annotations

from nsa_core.registry import Backend, OpContext
from nsa_core.toggles import Toggles
from nsa_kernels.common import fa2_routing as routing
from nsa_kernels.common.flex import compressed_attention_flex
from nsa_kernels.common.sdpa import compressed_attention_sdpa
from nsa_kernels.common.triton_routing import triton_decline_reason, triton_fn
from nsa_kernels.compressed.cudnn import (
    compressed_attention_cudnn,
    compressed_attention_cudnn_with_lse,
    cudnn_compressed_supports,
)
from nsa_kernels.compressed.fa2 import compressed_attention_fa2

OP = "compressed_attention"
TRITON_PRIORITY = 25
# Above FA-2: cuDNN's fused attention runs the folded compressed forward faster on sm90
# (docs/performance.md).
CUDNN_PRIORITY = 35
CUDNN_NAME = "cudnn"
_TRITON_MODULE = "nsa_kernels.compressed.function"


def triton_cmp_supports(ctx: OpContext, toggles: Toggles) -> str | None:
    return triton_decline_reason(ctx)


def backends() -> list[Backend]:
    """The compressed branch's backends, highest priority first: the docstring's table, one row
    each as ``Backend(op, name, fn, supports, priority, ...)``."""
    fa2, flex = compressed_attention_fa2.unchecked, compressed_attention_flex.unchecked
    sdpa = compressed_attention_sdpa.unchecked
    # The Triton row's fn_with_lse: the same kernels, and the lse their forward writes.
    triton = triton_fn(_TRITON_MODULE, "compressed_attention_triton")
    triton_with_lse = triton_fn(_TRITON_MODULE, "compressed_attention_triton_with_lse")
    return [
        Backend(OP, CUDNN_NAME, compressed_attention_cudnn.unchecked, cudnn_compressed_supports,
                CUDNN_PRIORITY, fn_with_lse=compressed_attention_cudnn_with_lse.unchecked),
        Backend(OP, "fa2", fa2, routing.fa2_compressed_supports, routing.FA2_PRIORITY,
                requested_by=routing.fa2_compressed_requested),
        Backend(OP, "triton_cmp", triton, triton_cmp_supports, TRITON_PRIORITY,
                fn_with_lse=triton_with_lse),
        Backend(OP, "flex", flex, routing.flex_supports, routing.FLEX_PRIORITY),
        Backend(OP, "sdpa", sdpa, routing.sdpa_compressed_supports, routing.SDPA_PRIORITY),
    ]  # fmt: skip
