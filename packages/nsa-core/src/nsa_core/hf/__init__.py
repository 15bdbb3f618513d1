"""Native Sparse Attention inside Hugging Face transformers (the ``nsa-core[hf]`` extra).

Importing this package checks the installed transformers against the tested range
(:mod:`nsa_core.hf.versions`, ImportError outside it) and registers ``nsa_llama`` with
AutoConfig, AutoModel and AutoModelForCausalLM.

- :class:`NSALlamaConfig`: Llama's config plus the NSA geometry (``nsa_cmp_block``, ...).
- :class:`NSALlamaForCausalLM`, :class:`NSALlamaModel`: Llama with NSAAttention layers.
- :class:`NSALlamaCache`: the decode state ``generate()`` carries between steps.
- :func:`nsa_from_dense`: an NSA model from a dense Llama checkpoint.
"""

from nsa_core.hf.versions import check_transformers

check_transformers()

from nsa_core.hf.cache import NSALayerCache, NSALlamaCache  # noqa: E402
from nsa_core.hf.config import NSALlamaConfig  # noqa: E402
from nsa_core.hf.convert import (  # noqa: E402
    NSA_ONLY,
    dense_to_nsa_keys,
    is_nsa_only,
    nsa_config_from_llama,
    nsa_from_dense,
)
from nsa_core.hf.modeling import (  # noqa: E402
    NSALlamaDecoderLayer,
    NSALlamaForCausalLM,
    NSALlamaModel,
    NSALlamaPreTrainedModel,
    register,
)

register()

__all__ = [
    "NSA_ONLY",
    "NSALayerCache",
    "NSALlamaCache",
    "NSALlamaConfig",
    "NSALlamaDecoderLayer",
    "NSALlamaForCausalLM",
    "NSALlamaModel",
    "NSALlamaPreTrainedModel",
    "dense_to_nsa_keys",
    "is_nsa_only",
    "nsa_config_from_llama",
    "nsa_from_dense",
    "register",
]
