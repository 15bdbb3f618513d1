"""The ops of one NSA layer, each a plain function with the shapes of NSA-SPEC.md."""

from nsa_core.ops.combine import gated_combine
from nsa_core.ops.compress import CompressMLP, compress, compress_avg, split_blocks
from nsa_core.ops.compressed_attention import compressed_attention
from nsa_core.ops.selected_attention import selected_attention
from nsa_core.ops.selection import block_scores, select_blocks, topn_blocks
from nsa_core.ops.sliding_attention import sliding_attention

__all__ = [
    "CompressMLP",
    "block_scores",
    "compress",
    "compress_avg",
    "compressed_attention",
    "gated_combine",
    "select_blocks",
    "selected_attention",
    "sliding_attention",
    "split_blocks",
    "topn_blocks",
]
