"""generate() and the forward of the NSA Llama model: cached decoding, padding, positions."""

from __future__ import annotations

import pytest
import torch
from hf_lib import left_padded, relative_error, tiny_model

from nsa_core.hf import NSALlamaCache

# docs/spec.md, "Tolerances": a float32 path against its reference.
FLOAT32_BOUND = 1e-5


def prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(1, 64, (n,), generator=torch.Generator().manual_seed(seed))


def test_greedy_generate_with_cache_equals_without_cache() -> None:
    # 20 prompt tokens and 40 new ones cross seven compression blocks (l=8, d=4) and the window.
    model = tiny_model(seed=0)
    ids = prompt(20, seed=1)[None]
    cached = model.generate(
        ids, max_new_tokens=40, do_sample=False, use_cache=True, return_dict_in_generate=True
    )
    uncached = model.generate(ids, max_new_tokens=40, do_sample=False, use_cache=False)
    assert torch.equal(cached.sequences, uncached)
    assert isinstance(cached.cache, NSALlamaCache)
    # The cache holds every token but the last one generated, which was never fed back.
    assert cached.cache.get_seq_length() == 59
    assert cached.cache.layer(0).states[0].num_cmp == (59 - 8) // 4 + 1
    # A random model that repeats one token would make the comparison weak.
    assert len(set(cached.sequences[0, 20:].tolist())) > 5


def test_left_padded_batch_generates_each_sequence_as_alone() -> None:
    model = tiny_model(seed=2)
    prompts = [prompt(20, seed=3), prompt(13, seed=4), prompt(17, seed=5)]
    ids, mask = left_padded(prompts)
    batch = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    for row, p in enumerate(prompts):
        alone = model.generate(p[None], max_new_tokens=40, do_sample=False)
        assert torch.equal(batch[row, ids.shape[1] :], alone[0, p.numel() :]), f"row {row}"


@pytest.mark.parametrize("use_cache", [False, True])
def test_padded_forward_last_logits_equal_unpadded(use_cache: bool) -> None:
    model = tiny_model(seed=6)
    prompts = [prompt(19, seed=7), prompt(6, seed=8), prompt(11, seed=9)]
    ids, mask = left_padded(prompts)
    with torch.no_grad():
        padded = model(ids, attention_mask=mask, use_cache=use_cache).logits
        for row, p in enumerate(prompts):
            alone = model(p[None], use_cache=use_cache).logits
            assert relative_error(padded[row, -1], alone[0, -1]) <= FLOAT32_BOUND
            # Every real token, not only the last, sees exactly its own row's prefix.
            real = mask[row].bool()
            assert relative_error(padded[row, real], alone[0]) <= FLOAT32_BOUND


def test_beam_search_with_cache_equals_without_cache() -> None:
    model = tiny_model(seed=10)
    ids, mask = left_padded([prompt(14, seed=11), prompt(9, seed=12)])
    kwargs = {"attention_mask": mask, "max_new_tokens": 12, "num_beams": 3, "do_sample": False}
    assert torch.equal(
        model.generate(ids, **kwargs, use_cache=True),
        model.generate(ids, **kwargs, use_cache=False),
    )


def test_decoding_several_tokens_at_once_equals_one_at_a_time() -> None:
    model = tiny_model(seed=13)
    ids = prompt(30, seed=14)[None]
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = NSALlamaCache(model.config)
        head = model(ids[:, :10], cache=cache, use_cache=True).logits
        tail = model(ids[:, 10:], cache=cache, use_cache=True).logits
    assert cache.get_seq_length() == 30
    assert relative_error(torch.cat([head, tail], dim=1), full) <= FLOAT32_BOUND


def test_refusals_name_the_argument() -> None:
    model = tiny_model(seed=15)
    ids = prompt(10, seed=16)[None]
    with pytest.raises(TypeError, match="cache must be an NSALlamaCache"):
        model(ids, cache=object(), use_cache=True)
    with pytest.raises(ValueError, match="position_ids"):
        model(ids, position_ids=torch.arange(1, 11)[None], use_cache=False)
    with pytest.raises(ValueError, match="output_attentions"):
        model(ids, output_attentions=True)
    with pytest.raises(ValueError, match="return_dict"):
        model(ids, return_dict=False)
    with pytest.raises(ValueError, match="attention_mask"):
        model(ids, attention_mask=torch.ones(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="at least one real token"):
        model(ids, attention_mask=torch.zeros(1, 10, dtype=torch.long), use_cache=True)
    cache = NSALlamaCache(model.config)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    mask = torch.ones(1, 11, dtype=torch.long)
    mask[0, -1] = 0
    with pytest.raises(ValueError, match="padding after the cache holds tokens"):
        model(prompt(1, seed=17)[None], attention_mask=mask, cache=cache, use_cache=True)
    with pytest.raises(TypeError, match="cannot be cropped"):
        cache.crop(1)
