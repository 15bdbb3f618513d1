"""A Llama-family causal LM whose attention layers are :class:`nsa_core.NSAAttention`.

Everything but attention is Llama's (embeddings, RMSNorms, MLPs, the LM head), under the same
parameter names, so a Llama checkpoint maps onto it key by key (:mod:`nsa_core.hf.convert`).
NSAAttention rotates its queries and keys by token position itself (``rope_theta`` from the
config): the model passes no cos/sin, and a padded batch's positions are each row's real-token
count, as Hugging Face's ``position_ids`` (cumsum of the mask - 1) are.

Padding (a 2-D ``attention_mask`` [B, T], 1 for real tokens) reaches attention only:

- without a cache, every row's real tokens are packed into one sequence set (``cu_seqlens``),
  attended in one call and scattered back; padded rows of the output are zeros;
- with a cache, :class:`nsa_core.hf.cache.NSALayerCache` keeps one NSA decode state per row where
  rows differ (see there).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    Cache,
    GenerationMixin,
    PreTrainedModel,
)
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from nsa_core.attention import NSAAttention
from nsa_core.checks import shape
from nsa_core.hf.cache import NSALayerCache, NSALlamaCache
from nsa_core.hf.config import NSALlamaConfig


def attend_without_cache(
    layer: NSAAttention, x: torch.Tensor, real: torch.Tensor | None
) -> torch.Tensor:
    """Causal NSA over a padded batch: x [B, T, hidden], real bool [B, T] or None (all real).

    The real tokens of each row, in order, become one packed sequence of a single
    :meth:`NSAAttention.forward` call (B == 1 with ``cu_seqlens``), whose positions restart at 0
    per sequence. -> y [B, T, hidden], zeros where ``real`` is False.
    """
    if real is None or bool(real.all()):
        y: torch.Tensor = layer(x)
        return y
    lengths = real.sum(dim=1)
    cu_seqlens = torch.zeros(x.shape[0] + 1, dtype=torch.int32, device=x.device)
    cu_seqlens[1:] = lengths.cumsum(0)
    packed = layer(x[real].unsqueeze(0), cu_seqlens=cu_seqlens)[0]  # [total, hidden]
    return x.new_zeros(x.shape).index_put((real,), packed)


def prefill_rows(
    layer: NSAAttention, x: torch.Tensor, real: torch.Tensor | None, state: NSALayerCache
) -> torch.Tensor:
    """Prefill x [B, T, hidden] into an empty ``state``; -> y [B, T, hidden], zeros at padding.

    Without padding the batch is one NSACache; with it, each row's real tokens are prefilled
    alone into a batch-1 NSACache (the reference route for ragged prompts).
    """
    if real is None or bool(real.all()):
        y, cache = layer.prefill(x)
        state.begin([cache], per_row=False, columns=x.shape[1])
        return y
    counts = real.sum(dim=1).tolist()
    if min(counts) == 0:
        raise ValueError(
            f"attention_mask must mark at least one real token in every row, got counts {counts}"
        )
    out = x.new_zeros(x.shape)
    caches = []
    for b in range(x.shape[0]):
        y_row, cache = layer.prefill(x[b, real[b]].unsqueeze(0))
        out[b, real[b]] = y_row[0]
        caches.append(cache)
    state.begin(caches, per_row=True, columns=x.shape[1])
    return out


def decode_steps(layer: NSAAttention, x: torch.Tensor, state: NSALayerCache) -> torch.Tensor:
    """x [B, T, hidden]: T new real tokens per row after the ``state``'s; -> y [B, T, hidden].

    One :meth:`NSAAttention.decode` step per token, per row where the rows' states are apart.
    """
    steps = []
    for t in range(x.shape[1]):
        x_t = x[:, t : t + 1]
        if state.per_row:
            rows = [layer.decode(x_t[b : b + 1], s)[0] for b, s in enumerate(state.states)]
            steps.append(torch.cat(rows, dim=0))
        else:
            steps.append(layer.decode(x_t, state.states[0])[0])
    state.columns += x.shape[1]
    return torch.cat(steps, dim=1)


class NSALlamaDecoderLayer(GradientCheckpointingLayer):
    """Llama's decoder layer with ``self_attn`` an :class:`NSAAttention`:
    ``h = x + attn(norm(x)); out = h + mlp(norm(h))``."""

    def __init__(self, config: NSALlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = NSAAttention(
            config.nsa_config(), config.hidden_size, bias=config.attention_bias
        )
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        real: torch.Tensor | None = None,
        cache: NSALlamaCache | None = None,
    ) -> torch.Tensor:
        """hidden_states [B, T, hidden]; real bool [B, T] for the new tokens (None: all real).

        With ``cache``, an empty layer state is prefilled and a filled one decodes the T tokens.
        """
        x = self.input_layernorm(hidden_states)
        if cache is None:
            attn = attend_without_cache(self.self_attn, x, real)
        else:
            state = cache.layer(self.layer_idx)
            if state.columns == 0:
                attn = prefill_rows(self.self_attn, x, real, state)
            else:
                attn = decode_steps(self.self_attn, x, state)
        h = hidden_states + attn
        out: torch.Tensor = h + self.mlp(self.post_attention_layernorm(h))
        return out


class NSALlamaPreTrainedModel(PreTrainedModel):
    """Weights initialisation and loading for the NSA Llama models.

    A fresh model takes Hugging Face's initialisation (normal weights of std
    ``initializer_range``, zero biases, unit norms): the gate MLP's output is then near 0 and every
    gate starts near 0.5. ``phi_k``/``phi_v`` (``nsa_phi="mlp"``) take it too, and keep their
    intra-block position embedding as NSAAttention draws it.
    """

    config_class = NSALlamaConfig
    config: NSALlamaConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    # device_map="auto" keeps each decoder layer on one device.
    _no_split_modules = {"NSALlamaDecoderLayer"}  # noqa: RUF012  (an attribute transformers reads)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # generate() must not build a DynamicCache: the model builds its NSALlamaCache itself.
        return False


def _check_kwargs(kwargs: dict[str, Any]) -> None:
    """Refuse what the model would otherwise ignore: attention weights, per-layer states,
    tuple outputs."""
    for name in ("output_attentions", "output_hidden_states"):
        if kwargs.get(name):
            raise ValueError(f"{name}=True is not supported by the NSA Llama models")
    if kwargs.get("return_dict") is False:
        raise ValueError("return_dict=False is not supported: the NSA Llama models return outputs")


class NSALlamaModel(NSALlamaPreTrainedModel):
    """Embeddings, NSA decoder layers, final norm: input_ids [B, T] -> hidden [B, T, hidden]."""

    def __init__(self, config: NSALlamaConfig) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(
            [NSALlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPast:
        """Hugging Face's call contract for a decoder.

        Args:
            input_ids: [B, T] token ids (or ``inputs_embeds`` [B, T, hidden]).
            attention_mask: [B, past + T] 1 for real tokens, 0 for padding (None: all real).
                Padding is allowed in a prompt (any column); once the cache holds tokens every
                new token must be real.
            position_ids: [B | 1, T] or None. NSA derives positions from the mask (each row's
                real tokens count from 0); given ones must equal those at every real token.
            cache: an :class:`NSALlamaCache` (a new one when ``use_cache`` and None).
            use_cache: default: ``config.use_cache`` outside training, False in training.

        Returns:
            last_hidden_state [B, T, hidden] (zeros before the final norm at padded tokens when
            there is no cache) and the cache.
        """
        _check_kwargs(kwargs)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        assert inputs_embeds is not None
        if use_cache is None:
            use_cache = bool(self.config.use_cache) and not self.training
        if cache is not None and not isinstance(cache, NSALlamaCache):
            raise TypeError(f"cache must be an NSALlamaCache, got {type(cache).__name__}")
        if use_cache and cache is None:
            cache = NSALlamaCache(self.config)
        if not use_cache:
            cache = None
        batch, t = inputs_embeds.shape[:2]
        past = cache.get_seq_length() if cache is not None else 0
        real = _real_tokens(attention_mask, batch, past, t, inputs_embeds.device)
        if position_ids is not None:
            _check_positions(position_ids, real, cache, batch, t)

        hidden = inputs_embeds
        for layer in self.layers:
            hidden = layer(hidden, real, cache)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden), cache=cache)


def _real_tokens(
    attention_mask: torch.Tensor | None, batch: int, past: int, t: int, device: torch.device
) -> torch.Tensor | None:
    """bool [B, T]: which of the T new tokens are real (None: all of them)."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch, past + t):
        raise ValueError(
            f"attention_mask {shape(attention_mask)} must be 2-D [B={batch}, past + T={past + t}]"
        )
    real = attention_mask[:, past:].to(device=device, dtype=torch.bool)
    if past > 0 and not bool(real.all()):
        raise ValueError(
            "attention_mask marks a new token as padding after the cache holds tokens: NSA "
            "decodes every new token, so pad only the prompt"
        )
    return real


def _check_positions(
    position_ids: torch.Tensor, real: torch.Tensor | None, cache: NSALlamaCache | None,
    batch: int, t: int,
) -> None:  # fmt: skip
    """position_ids [B | 1, T] must be each token's count of real tokens before it in its row."""
    past = cache.layer(0).row_lengths() if cache is not None and cache.get_seq_length() else []
    start = torch.tensor(past or [0] * batch, device=position_ids.device).unsqueeze(1)
    if real is None:
        real = torch.ones(batch, t, dtype=torch.bool, device=position_ids.device)
    real = real.to(position_ids.device)
    expected = start + real.long().cumsum(1) - 1
    given = position_ids.expand(batch, t)
    if not bool((given == expected)[real].all()):
        raise ValueError(
            f"position_ids {given.tolist()} differ from NSA's positions {expected.tolist()} at a "
            "real token: NSA counts each row's real tokens from 0 (no other positions)"
        )


class NSALlamaForCausalLM(NSALlamaPreTrainedModel, GenerationMixin):
    """:class:`NSALlamaModel` and Llama's LM head: logits [B, T, vocab], loss with ``labels``."""

    # transformers declares this an instance attribute that subclasses set on the class.
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}  # noqa: RUF012

    def __init__(self, config: NSALlamaConfig) -> None:
        super().__init__(config)
        self.model = NSALlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """:meth:`NSALlamaModel.forward`'s arguments, plus ``labels`` [B, T] (-100: ignored;
        shifted inside the loss) and ``logits_to_keep`` (the last that many positions, 0: all).
        Other keyword arguments go to the loss (``num_items_in_batch`` from the Trainer)."""
        _check_kwargs(kwargs)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        hidden = out.last_hidden_state
        if isinstance(logits_to_keep, int):
            hidden = hidden[:, -logits_to_keep:] if logits_to_keep > 0 else hidden
        else:
            hidden = hidden[:, logits_to_keep]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            extra = {k: v for k, v in kwargs.items() if k == "num_items_in_batch"}
            loss = self.loss_function(
                logits=logits, labels=labels, vocab_size=self.config.vocab_size, **extra
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=out.cache)


def register() -> None:
    """Register the config and models with AutoConfig, AutoModel and AutoModelForCausalLM."""
    AutoConfig.register(NSALlamaConfig.model_type, NSALlamaConfig, exist_ok=True)
    AutoModel.register(NSALlamaConfig, NSALlamaModel, exist_ok=True)
    AutoModelForCausalLM.register(NSALlamaConfig, NSALlamaForCausalLM, exist_ok=True)
