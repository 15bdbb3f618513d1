"""nsa-core: Native Sparse Attention (arXiv 2502.11089), its reference in pure PyTorch and its ops.

docs/spec.md fixes the semantics. The public ops (:mod:`nsa_core.ops`: the six steps, and the
attention core that runs them all, :mod:`nsa_core.core`) validate their arguments once and run
the backend the registry (:mod:`nsa_core.registry`) picks: faster ones plug in from nsa-kernels,
and the reference bodies (:mod:`nsa_core.reference`) serve everything else and stay callable by
name. :mod:`nsa_core.functional` offers the attention in flash-attn's layouts (docs/integration.md).
"""

from nsa_core.attention import BranchInputs, DecodeStats, NSAAttention, nsa_attention
from nsa_core.blocks import cmp_block_overlap, cmp_cu_seqlens, num_cmp_blocks, num_sel_blocks
from nsa_core.cache import NSACache
from nsa_core.config import NSAConfig
from nsa_core.core import attention_core
from nsa_core.functional import nsa_func, nsa_varlen_func
from nsa_core.kvcache import nsa_with_kvcache
from nsa_core.ops import (
    apply_rope,
    compressed_attention,
    compressed_attention_with_lse,
    gated_combine,
    select_blocks,
    selected_attention,
    sliding_attention,
)
from nsa_core.ragged_cache import RaggedNSACache
from nsa_core.reads import expected_reads, selected_reads
from nsa_core.reference import (
    CompressMLP,
    block_scores,
    compress,
    compress_avg,
    split_blocks,
    topn_blocks,
)
from nsa_core.reference_backends import register_reference_backends
from nsa_core.toggles import Toggles, get_toggles

register_reference_backends()

__version__ = "0.1.0"

__all__ = [
    "BranchInputs",
    "CompressMLP",
    "DecodeStats",
    "NSAAttention",
    "NSACache",
    "NSAConfig",
    "RaggedNSACache",
    "Toggles",
    "apply_rope",
    "attention_core",
    "block_scores",
    "cmp_block_overlap",
    "cmp_cu_seqlens",
    "compress",
    "compress_avg",
    "compressed_attention",
    "compressed_attention_with_lse",
    "expected_reads",
    "gated_combine",
    "get_toggles",
    "nsa_attention",
    "nsa_func",
    "nsa_varlen_func",
    "nsa_with_kvcache",
    "num_cmp_blocks",
    "num_sel_blocks",
    "select_blocks",
    "selected_attention",
    "selected_reads",
    "sliding_attention",
    "split_blocks",
    "topn_blocks",
]
