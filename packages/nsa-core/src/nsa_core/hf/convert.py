"""Start an NSA Llama model from a dense Llama checkpoint.

The key map, for every decoder layer i (prefix ``model.layers.{i}.self_attn.``):

- ``q_proj`` -> ``q_proj``, ``o_proj`` -> ``o_proj``;
- ``k_proj`` -> ``k_proj.cmp``, ``k_proj.sel`` and ``k_proj.win`` (one copy each), and the same
  for ``v_proj``: the three branches start from the dense projection and may drift apart in
  training;
- everything else (embeddings, MLPs, norms, ``lm_head``) as is.

NSA's own parameters, which a dense checkpoint lacks (:data:`NSA_ONLY`), are initialised here:

- the gate MLP ``gate.0`` keeps the model's initialisation; its output layer ``gate.2`` gets zero
  weights and the biases ``logit(initial_gates)``, so at the start every token's gates are
  exactly ``initial_gates`` (default 1/3 each: the output is the mean of the three branches,
  which for a context within the window and the selected blocks is the dense attention's, up
  to the compressed branch's approximation);
- ``phi_k``/``phi_v`` (``nsa_phi="mlp"``) keep the model's initialisation.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from nsa_core.attention import BRANCHES
from nsa_core.hf.config import NSALlamaConfig
from nsa_core.hf.modeling import NSALlamaForCausalLM

_ATTN = re.compile(
    r"^(model\.layers\.\d+\.self_attn\.)(q_proj|k_proj|v_proj|o_proj)\.(weight|bias)$"
)

# Patterns of the NSA-only keys (no dense counterpart), after "model.layers.{i}.self_attn.".
NSA_ONLY = (r"gate\.\d+\.(weight|bias)", r"phi_[kv]\..+")


def dense_to_nsa_keys(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A dense Llama causal-LM state dict, its attention keys mapped to NSA's (the module's map)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        m = _ATTN.match(key)
        if m is None or m[2] in ("q_proj", "o_proj"):
            out[key] = value
            continue
        prefix, proj, kind = m[1], m[2], m[3]
        for branch in BRANCHES:
            out[f"{prefix}{proj}.{branch}.{kind}"] = value.clone()
    return out


def is_nsa_only(key: str) -> bool:
    """Whether ``key`` is an NSA parameter that no dense checkpoint holds."""
    m = re.match(r"^model\.layers\.\d+\.self_attn\.(.+)$", key)
    return m is not None and any(re.fullmatch(p, m[1]) for p in NSA_ONLY)


def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))


def nsa_from_dense(
    dense: LlamaForCausalLM | Mapping[str, torch.Tensor],
    config: NSALlamaConfig | None = None,
    *,
    initial_gates: tuple[float, float, float] = (1 / 3, 1 / 3, 1 / 3),
    **nsa_fields: Any,
) -> NSALlamaForCausalLM:
    """An NSA Llama causal LM holding a dense Llama's weights (the key map of the module).

    Args:
        dense: a :class:`transformers.LlamaForCausalLM`, or its state dict (then ``config`` is
            required).
        config: the NSA model's config; default: the dense model's config with ``nsa_fields``
            (``nsa_cmp_block=..., nsa_window=...``; the rest keep their defaults).
        initial_gates: the (cmp, sel, win) gate every token starts with, each in (0, 1).

    Returns:
        The model in float32 (the checkpoint's values cast; ``.to(dtype)`` it after). Raises
        ValueError if the checkpoint misses a key the NSA model needs (other than
        :data:`NSA_ONLY`) or holds one it has no place for.
    """
    if len(initial_gates) != 3 or not all(0.0 < g < 1.0 for g in initial_gates):
        raise ValueError(f"initial_gates must be three numbers in (0, 1), got {initial_gates!r}")
    if isinstance(dense, LlamaForCausalLM):
        state = dense.state_dict()
        if config is None:
            config = nsa_config_from_llama(dense.config, **nsa_fields)
    elif isinstance(dense, Mapping):
        state = dict(dense)
    else:
        raise TypeError(
            f"dense must be a LlamaForCausalLM or a state dict, got {type(dense).__name__}"
        )
    if config is None:
        raise ValueError("config is required when dense is a state dict")
    if nsa_fields and not isinstance(dense, LlamaForCausalLM):
        raise ValueError("give the NSA fields in config when dense is a state dict")
    model = NSALlamaForCausalLM(config)
    mapped = dense_to_nsa_keys(state)
    result = model.load_state_dict(mapped, strict=False)
    missing = [k for k in result.missing_keys if not is_nsa_only(k)]
    # The tied LM head may be absent from a checkpoint that ties it to the embeddings.
    if config.tie_word_embeddings:
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"the dense checkpoint does not fit the NSA model: missing {missing}, "
            f"unexpected {result.unexpected_keys}"
        )
    logits = torch.tensor([_logit(g) for g in initial_gates])
    with torch.no_grad():
        for layer in model.model.layers:
            out_layer = layer.self_attn.gate[2]
            out_layer.weight.zero_()
            # The gate output is viewed [.., HQ, 3]: entry h*3 + branch.
            out_layer.bias.copy_(logits.repeat(config.num_attention_heads))
    return model


def nsa_config_from_llama(llama: LlamaConfig, **nsa_fields: Any) -> NSALlamaConfig:
    """An NSALlamaConfig with every Llama field of ``llama`` and the given NSA fields."""
    fields = llama.to_dict()
    for name in ("model_type", "architectures", "transformers_version"):
        fields.pop(name, None)
    return NSALlamaConfig(**{**fields, **nsa_fields})
