"""NSALlamaCache: the decode state of every NSA layer, in the shape ``generate()`` expects.

Hugging Face's generation loop reads a :class:`transformers.Cache` (its sequence length, for the
positions and the slicing of the inputs) and hands it back to the model at every step. Here each
layer's entry holds :class:`nsa_core.cache.NSACache` objects, filled by
:meth:`NSAAttention.prefill` and advanced by :meth:`NSAAttention.decode`, never keys and values
for Llama's attention.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from transformers import Cache, PreTrainedConfig
from transformers.cache_utils import CacheLayerMixin

from nsa_core.cache import NSACache


def select_rows(state: NSACache, rows: torch.Tensor) -> NSACache:
    """A new NSACache holding ``state``'s sequences ``rows`` [R] (int64), copied, in that order."""
    tensors = {
        f.name: getattr(state, f.name).index_select(0, rows.to(state.device))
        for f in dataclasses.fields(state)
        if isinstance(getattr(state, f.name), torch.Tensor)
    }
    return dataclasses.replace(state, **tensors)


class NSALayerCache(CacheLayerMixin):
    """One NSA layer's decode state for a batch of B rows.

    ``columns`` counts every column the layer has seen, padding included: what ``generate()``
    calls the sequence length. ``states`` holds the NSA decode caches:

    - one NSACache of batch B when no row had padding at prefill (every row holds ``columns``
      tokens);
    - otherwise one NSACache of batch 1 per row (``per_row``), each holding only its row's real
      tokens. NSACache keeps one length for its whole batch, so rows whose prompts have different
      lengths are prefilled and decoded one by one. This per-row loop is the reference route; a
      cache with one length per row will replace it.
    """

    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self) -> None:
        super().__init__()
        self.states: list[NSACache] = []
        self.per_row = False
        self.columns = 0

    def begin(self, states: list[NSACache], per_row: bool, columns: int) -> None:
        """Take the caches a prefill left, for ``columns`` columns of input."""
        self.states = states
        self.per_row = per_row
        self.columns = columns
        self.is_initialized = True

    def row_lengths(self) -> list[int]:
        """The real tokens each row holds (B entries)."""
        if self.per_row:
            return [s.length for s in self.states]
        return [self.states[0].length] * self.states[0].batch if self.states else []

    # --------------------------------------------------------------- transformers' layer contract

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise TypeError(
            "NSALayerCache holds NSA decode state, not keys and values: it is filled by the "
            "NSA model's own forward"
        )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise TypeError(
            "NSALayerCache holds NSA decode state, not keys and values: update() does not apply"
        )

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.columns + query_length, 0

    def get_seq_length(self) -> int:
        return self.columns

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.states = []
        self.per_row = False
        self.columns = 0
        self.is_initialized = False

    def offload(self) -> None:
        raise TypeError("NSALayerCache cannot be offloaded")

    def prefetch(self) -> None:
        raise TypeError("NSALayerCache cannot be offloaded")

    def crop(self, tokens_to_remove: int) -> None:
        raise TypeError(
            "NSALayerCache cannot be cropped: a decode step folds tokens into compressed blocks "
            "that cannot be taken back"
        )

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` [R] (int64), in that order."""
        if not self.states:
            return
        if self.per_row:
            one = torch.zeros(1, dtype=torch.int64)
            self.states = [select_rows(self.states[int(i)], one) for i in indices.tolist()]
        else:
            self.states = [select_rows(self.states[0], indices)]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row r takes the state of row ``beam_idx[r]``."""
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row repeated ``repeats`` times in place (row r becomes rows r*repeats + i)."""
        batch = len(self.row_lengths())
        self.batch_select_indices(torch.arange(batch).repeat_interleave(repeats))


class NSALlamaCache(Cache):
    """The decode state of every NSA layer of an NSA Llama model: one :class:`NSALayerCache`
    per decoder layer. ``generate()`` creates it by itself; pass one as ``cache=`` to continue a
    generation."""

    def __init__(self, config: PreTrainedConfig) -> None:
        num_layers = getattr(config, "num_hidden_layers", None)
        if not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"config.num_hidden_layers must be an int >= 1, got {num_layers!r}")
        super().__init__(layers=[NSALayerCache() for _ in range(num_layers)])

    def layer(self, index: int) -> NSALayerCache:
        """The cache of decoder layer ``index``."""
        entry = self.layers[index]
        if not isinstance(entry, NSALayerCache):
            raise TypeError(f"layer {index} of the cache is a {type(entry).__name__}")
        return entry
