"""The reference NSA: every op as plain PyTorch with the shapes of docs/spec.md.

These bodies are the parity target of every kernel and what CPU users run. Each public function
here validates its arguments (:mod:`nsa_core.checks`) and computes. The attention ops,
select_blocks, gated_combine and apply_rope are
:class:`~nsa_core.reference.common.ValidatedOp` objects: their ``body`` (exported by the op
modules as ``<op>_impl``) skips the checks and is what the registry runs after
:mod:`nsa_core.ops` has validated a call.
"""

from nsa_core.reference.combine import gated_combine
from nsa_core.reference.compress import CompressMLP, compress, compress_avg, split_blocks
from nsa_core.reference.compressed_attention import compressed_attention
from nsa_core.reference.rope import apply_rope, rope_angles
from nsa_core.reference.selected_attention import selected_attention
from nsa_core.reference.selection import block_scores, select_blocks, topn_blocks
from nsa_core.reference.sliding_attention import sliding_attention

__all__ = [
    "CompressMLP",
    "apply_rope",
    "block_scores",
    "compress",
    "compress_avg",
    "compressed_attention",
    "gated_combine",
    "rope_angles",
    "select_blocks",
    "selected_attention",
    "sliding_attention",
    "split_blocks",
    "topn_blocks",
]
