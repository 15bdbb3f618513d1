"""One NSA decode step on the GPU: a batch of sequences, one query token each.

- :class:`DecodeState`: preallocated caches of B sequences with device-side lengths, the
  selected-branch K/V dense or in pages (:class:`PageTable`).
- :func:`decode_step`: append, compress, score, top-n and the three branches with split-K, in
  five launches without host synchronisation (:class:`DecodePlan` holds tiles and workspace).
- :class:`DecodeGraph`: one step captured as a CUDA graph, replayed token after token.
- :class:`LayerDecoder`: the whole NSAAttention step (projections, fused step, output), with
  an optional CUDA graph over all of it.
"""

from nsa_kernels.decode.graph import DecodeGraph
from nsa_kernels.decode.layer import LayerDecoder
from nsa_kernels.decode.state import BlockPhi, DecodeState, PageTable, block_phi
from nsa_kernels.decode.step import (
    TOPN_REL_GAP,
    DecodeKernelConfig,
    DecodePlan,
    StepInputs,
    StepOutputs,
    decode_step,
)

__all__ = [
    "TOPN_REL_GAP",
    "BlockPhi",
    "DecodeGraph",
    "DecodeKernelConfig",
    "DecodePlan",
    "DecodeState",
    "LayerDecoder",
    "PageTable",
    "StepInputs",
    "StepOutputs",
    "block_phi",
    "decode_step",
]
