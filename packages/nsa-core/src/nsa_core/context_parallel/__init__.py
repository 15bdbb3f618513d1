"""Context parallelism: the NSA attention core on a sequence sharded over several ranks.

- :mod:`~nsa_core.context_parallel.plan`: :class:`ShardPlan`, how T tokens are split
  (contiguous or zigzag chunks) and the ``shard``/``unshard`` helpers.
- :mod:`~nsa_core.context_parallel.work`: what each chunk computes and reads.
- :mod:`~nsa_core.context_parallel.exchange`: autograd-aware all-gather and range fetches over
  ``torch.distributed``, and :class:`CommTimer`.
- :mod:`~nsa_core.context_parallel.attention`: :func:`context_parallel_nsa_attention`.
- :mod:`~nsa_core.context_parallel.layer`: :func:`context_parallel_layer_forward`, a whole
  :class:`~nsa_core.NSAAttention` layer.

docs/context_parallel.md describes the design and the data each branch exchanges.
"""

from nsa_core.context_parallel.attention import (
    SEL_EXCHANGES,
    SelExchange,
    context_parallel_nsa_attention,
)
from nsa_core.context_parallel.exchange import CommTimer
from nsa_core.context_parallel.layer import context_parallel_layer_forward
from nsa_core.context_parallel.plan import LAYOUTS, Chunk, Layout, ShardPlan

__all__ = [
    "LAYOUTS",
    "SEL_EXCHANGES",
    "Chunk",
    "CommTimer",
    "Layout",
    "SelExchange",
    "ShardPlan",
    "context_parallel_layer_forward",
    "context_parallel_nsa_attention",
]
