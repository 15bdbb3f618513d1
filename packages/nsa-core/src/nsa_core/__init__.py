"""nsa-core: the reference Native Sparse Attention (arXiv 2502.11089) in pure PyTorch.

NSA-SPEC.md fixes the semantics; every function here follows it to the index. Faster backends
(nsa-kernels) plug in through :mod:`nsa_core.registry`; the reference stays callable everywhere.
"""

from nsa_core.attention import BranchInputs, DecodeStats, NSAAttention
from nsa_core.blocks import cmp_block_overlap, cmp_cu_seqlens, num_cmp_blocks, num_sel_blocks
from nsa_core.cache import NSACache
from nsa_core.config import NSAConfig
from nsa_core.ops import (
    CompressMLP,
    block_scores,
    compress,
    compress_avg,
    compressed_attention,
    gated_combine,
    select_blocks,
    selected_attention,
    sliding_attention,
    split_blocks,
    topn_blocks,
)
from nsa_core.reads import expected_reads, selected_reads
from nsa_core.registry import register_reference_backends
from nsa_core.rope import apply_rope
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
    "Toggles",
    "apply_rope",
    "block_scores",
    "cmp_block_overlap",
    "cmp_cu_seqlens",
    "compress",
    "compress_avg",
    "compressed_attention",
    "expected_reads",
    "gated_combine",
    "get_toggles",
    "num_cmp_blocks",
    "num_sel_blocks",
    "select_blocks",
    "selected_attention",
    "selected_reads",
    "sliding_attention",
    "split_blocks",
    "topn_blocks",
]
