"""NSALlamaConfig and the Auto* registration: NSA's geometry from Llama's fields; save, load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_lib import tiny_config, tiny_model
from huggingface_hub.errors import StrictDataclassClassValidationError
from transformers import AutoConfig, AutoModelForCausalLM

from nsa_core import NSAConfig
from nsa_core.hf import NSALlamaConfig, NSALlamaForCausalLM


def test_nsa_config_takes_heads_and_rope_from_llama_and_geometry_from_nsa_fields() -> None:
    config = tiny_config(rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    assert config.nsa_config() == NSAConfig(
        num_q_heads=4, num_kv_heads=1, head_dim_qk=16, head_dim_v=16, cmp_block=8,
        cmp_stride=4, sel_block=8, num_selected=3, window=16, phi="avg", rope_theta=500000.0,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"nsa_cmp_stride": 3}, "cmp_stride"),
        ({"nsa_num_selected": 2}, "num_selected"),
        ({"nsa_phi": "max"}, "nsa_phi"),
        ({"attention_dropout": 0.1}, "attention_dropout"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}, "rope"),
    ],
)
def test_invalid_nsa_settings_are_refused(overrides: dict[str, object], message: str) -> None:
    # transformers' strict configs wrap the ValueError of the validation in their own error.
    with pytest.raises(StrictDataclassClassValidationError, match=message) as err:
        tiny_config(**overrides)
    assert isinstance(err.value.__cause__, ValueError)


def test_auto_classes_build_and_reload_the_model(tmp_path: Path) -> None:
    model = tiny_model(seed=0)
    model.save_pretrained(tmp_path)
    assert isinstance(AutoConfig.from_pretrained(tmp_path), NSALlamaConfig)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, NSALlamaForCausalLM)
    ids = torch.randint(1, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    fresh = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("nsa_llama", hidden_size=32, num_attention_heads=4)
    )
    assert isinstance(fresh, NSALlamaForCausalLM)
