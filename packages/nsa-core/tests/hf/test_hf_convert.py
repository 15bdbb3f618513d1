"""nsa_from_dense: a Llama checkpoint's keys onto the NSA model, NSA's own parameters documented."""

from __future__ import annotations

import re

import pytest
import torch
from hf_lib import TINY, relative_error, tiny_config
from transformers import LlamaConfig, LlamaForCausalLM

from nsa_core.hf import NSALlamaForCausalLM, dense_to_nsa_keys, is_nsa_only, nsa_from_dense

NSA_FIELDS = {k: v for k, v in TINY.items() if k.startswith("nsa_")}
LLAMA_FIELDS = {k: v for k, v in TINY.items() if not k.startswith("nsa_")}


def tiny_llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(**LLAMA_FIELDS, attn_implementation="eager")
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("phi", ["avg", "mlp"])
def test_every_key_maps_but_the_documented_nsa_only_ones(phi: str) -> None:
    dense = tiny_llama(seed=0)
    model = nsa_from_dense(dense, **{**NSA_FIELDS, "nsa_phi": phi})
    mapped = set(dense_to_nsa_keys(dense.state_dict()))
    nsa_keys = set(model.state_dict())
    assert mapped <= nsa_keys
    only = {re.sub(r"^model\.layers\.\d+\.self_attn\.", "", k) for k in nsa_keys - mapped}
    expected = {"gate.0.weight", "gate.0.bias", "gate.2.weight", "gate.2.bias"}
    if phi == "mlp":
        expected |= {f"phi_{kv}.{p}" for kv in "kv" for p in ("pos", "fc1.weight", "fc1.bias")}
        expected |= {f"phi_{kv}.fc2.{p}" for kv in "kv" for p in ("weight", "bias")}
    assert only == expected
    assert all(is_nsa_only(k) for k in nsa_keys - mapped)
    assert not any(is_nsa_only(k) for k in mapped)


def test_weights_are_copied_to_every_branch() -> None:
    dense = tiny_llama(seed=1)
    model = nsa_from_dense(dense, **NSA_FIELDS)
    d, n = dense.state_dict(), model.state_dict()
    for i in range(TINY["num_hidden_layers"]):
        attn = f"model.layers.{i}.self_attn."
        for proj in ("q_proj", "o_proj"):
            assert torch.equal(n[f"{attn}{proj}.weight"], d[f"{attn}{proj}.weight"])
        for proj in ("k_proj", "v_proj"):
            for branch in ("cmp", "sel", "win"):
                assert torch.equal(n[f"{attn}{proj}.{branch}.weight"], d[f"{attn}{proj}.weight"])
        for name in ("mlp.gate_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"):
            assert torch.equal(n[f"model.layers.{i}.{name}"], d[f"model.layers.{i}.{name}"])
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert torch.equal(n[name], d[name])
    # The branches are copies: training one leaves the others as they were.
    branches = model.model.layers[0].self_attn.k_proj
    assert branches["cmp"].weight.data_ptr() != branches["sel"].weight.data_ptr()


def test_initial_gates_are_the_given_ones_for_every_token() -> None:
    model = nsa_from_dense(tiny_llama(seed=2), initial_gates=(0.2, 0.3, 0.9), **NSA_FIELDS)
    layer = model.model.layers[1].self_attn
    x = torch.randn(2, 7, TINY["hidden_size"])
    gates = torch.sigmoid(layer.gate(x)).view(2, 7, TINY["num_attention_heads"], 3)
    torch.testing.assert_close(gates, torch.tensor([0.2, 0.3, 0.9]).expand_as(gates))


def test_within_window_and_selection_it_is_the_dense_model() -> None:
    # 16 tokens: the window (w=16) and the selected blocks (n*l' = 24) hold every key, so the
    # selected and sliding branches are the dense attention; gates (~0, 1/2, 1/2) leave it alone.
    dense = tiny_llama(seed=3)
    model = nsa_from_dense(dense, initial_gates=(1e-7, 0.5, 0.5), **NSA_FIELDS)
    ids = torch.randint(1, 64, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = dense(ids).logits
        got = model(ids, use_cache=False).logits
    assert relative_error(got, want) <= 1e-5  # docs/spec.md: a float32 path


def test_a_state_dict_that_does_not_fit_is_refused() -> None:
    dense = tiny_llama(seed=5)
    config = tiny_config()
    state = dense.state_dict()
    assert isinstance(nsa_from_dense(state, config), NSALlamaForCausalLM)
    missing = {k: v for k, v in state.items() if "mlp.up_proj" not in k}
    with pytest.raises(ValueError, match="missing"):
        nsa_from_dense(missing, config)
    with pytest.raises(ValueError, match="unexpected"):
        nsa_from_dense({**state, "model.extra.weight": torch.zeros(1)}, config)
    with pytest.raises(ValueError, match="initial_gates"):
        nsa_from_dense(dense, initial_gates=(0.0, 0.5, 0.5), **NSA_FIELDS)
    with pytest.raises(TypeError, match="dense must be"):
        nsa_from_dense(object(), config)  # type: ignore[arg-type]
