"""Tiny NSA Llama models for the Hugging Face tests: CPU, float32, seconds per test."""

from __future__ import annotations

from typing import Any

import torch

from nsa_core.hf import NSALlamaConfig, NSALlamaForCausalLM

# hidden 32, 2 layers, 4 q heads over 1 kv head of dim 16; NSA l=8, d=4, l'=8, n=3, w=16.
TINY = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    # Wider than Llama's 0.02 so that a random model's greedy tokens vary from step to step.
    "initializer_range": 0.2,
    "pad_token_id": 0,
    "bos_token_id": None,
    "eos_token_id": None,
    "nsa_cmp_block": 8,
    "nsa_cmp_stride": 4,
    "nsa_sel_block": 8,
    "nsa_num_selected": 3,
    "nsa_window": 16,
}


def tiny_config(**overrides: Any) -> NSALlamaConfig:
    return NSALlamaConfig(**{**TINY, **overrides})


def tiny_model(seed: int, **overrides: Any) -> NSALlamaForCausalLM:
    """A randomly initialised tiny model in eval mode, the same for the same seed."""
    torch.manual_seed(seed)
    return NSALlamaForCausalLM(tiny_config(**overrides)).eval()


def left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts [n_i] -> input_ids [B, T] with pad id 0 on the left, attention_mask [B, T]."""
    width = max(p.numel() for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - prompt.numel() :] = prompt
        mask[row, width - prompt.numel() :] = 1
    return ids, mask


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| (docs/spec.md, "Tolerances")."""
    return float((out - ref).norm() / ref.norm())
