"""Prefill and decode of a padded batch through a RaggedNSACache.

Each row is its own sequence (docs/spec.md, "Padding and positions" and "Decode"): a masked
prefill followed by k decode steps equals that sequence's own prefill and k decode steps, and
equals ``forward`` over the longer padded input at the same positions, within the spec's float32
bound (1e-5). A step that fails in any row leaves every row as it was.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import pytest
import torch

from nsa_core import NSAAttention, NSACache, NSAConfig, RaggedNSACache

LayerFactory = Callable[..., NSAAttention]

# docs/spec.md, "Tolerances": a float32 path.
FLOAT32_TOL = 1e-5

CFG = NSAConfig(
    num_q_heads=4, num_kv_heads=1, head_dim_qk=16, head_dim_v=16,
    cmp_block=8, cmp_stride=4, sel_block=8, num_selected=3, window=16,
)  # fmt: skip
HIDDEN = 32
PROMPT = 40
STEPS = 6
# Rows: full, past the window, one token short of the first compressed block, empty.
LENGTHS = [PROMPT, 27, 7, 0]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64."""
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def left_padded(lengths: list[int], t: int) -> torch.Tensor:
    """[B, t] bool: row b's lengths[b] tokens at the right end."""
    return torch.stack([torch.arange(t) >= t - n for n in lengths])


def setup(
    make_layer: LayerFactory, gen: torch.Generator, phi: str = "avg"
) -> tuple[NSAAttention, torch.Tensor, torch.Tensor]:
    """A float32 layer, x [B, PROMPT + STEPS, hidden] and its left-padding mask (the prompt's
    padding, then every row's STEPS decoded tokens)."""
    cfg = dataclasses.replace(CFG, phi=phi)  # type: ignore[arg-type]
    layer = make_layer(cfg, HIDDEN, torch.float32)
    x = torch.randn(len(LENGTHS), PROMPT + STEPS, HIDDEN, generator=gen)
    mask = left_padded([n + STEPS for n in LENGTHS], PROMPT + STEPS)
    return layer, x, mask


@pytest.mark.parametrize("phi", ["avg", "mlp"])
def test_ragged_decode_equals_each_sequence_and_forward(
    make_layer: LayerFactory, gen: torch.Generator, phi: str
) -> None:
    layer, x, mask = setup(make_layer, gen, phi)
    with torch.no_grad():
        y_pre, cache = layer.prefill(x[:, :PROMPT], attention_mask=mask[:, :PROMPT])
        assert isinstance(cache, RaggedNSACache)
        assert cache.lengths == LENGTHS
        assert cache.starts == [PROMPT - n if n else 0 for n in LENGTHS]
        steps = []
        for s in range(STEPS):
            y, stats = layer.decode(x[:, PROMPT + s : PROMPT + s + 1], cache)
            assert [st.position for st in stats] == [n + s for n in LENGTHS]
            steps.append(y)
        y_ragged = torch.cat([y_pre, *steps], dim=1)
        assert cache.lengths == [n + STEPS for n in LENGTHS]

        # The longer padded input, at once.
        y_forward = layer(x, attention_mask=mask)
        assert rel_err(y_ragged, y_forward) <= FLOAT32_TOL
        assert torch.equal(y_ragged[~mask], torch.zeros_like(y_ragged[~mask]))

        # Each sequence alone: its own prefill (when it has a prompt), then its own steps.
        for b, n in enumerate(LENGTHS):
            seq = x[b : b + 1, PROMPT - n :]
            y_own, own = layer.prefill(seq[:, :n])
            outs = [y_own]
            for s in range(STEPS):
                outs.append(layer.decode(seq[:, n + s : n + s + 1], own)[0])
            y_seq = torch.cat(outs, dim=1)
            assert rel_err(y_ragged[b : b + 1, PROMPT - n :], y_seq) <= FLOAT32_TOL, f"row {b}"
            for name, value in own.state().items():
                row_value = cache.rows[b].state()[name]
                assert row_value.shape == value.shape, (b, name)
                if value.numel():
                    assert rel_err(row_value, value) <= FLOAT32_TOL, (b, name)


def test_masked_prefill_output_is_forward(make_layer: LayerFactory, gen: torch.Generator) -> None:
    """prefill's output is forward's; with ``capacity`` each row pre-allocates that many."""
    layer, x, mask = setup(make_layer, gen)
    with torch.no_grad():
        y, cache = layer.prefill(x, 64, attention_mask=mask)
        assert torch.equal(y, layer(x, attention_mask=mask))
    assert [row._k_sel.shape[1] for row in cache.rows] == [64] * len(LENGTHS)


def test_decode_position_ids_move_rope_like_forward(
    make_layer: LayerFactory, gen: torch.Generator
) -> None:
    """Decode at given RoPE positions equals forward over the padded input at those positions."""
    layer, x, mask = setup(make_layer, gen)
    offsets = torch.tensor([[3], [11], [0], [5]])
    position_ids = (mask.long().cumsum(dim=1) - 1).clamp_min(0) + offsets
    with torch.no_grad():
        ref = layer(x, attention_mask=mask, position_ids=position_ids)
        _, cache = layer.prefill(
            x[:, :PROMPT], attention_mask=mask[:, :PROMPT], position_ids=position_ids[:, :PROMPT]
        )
        for s in range(STEPS):
            col = PROMPT + s
            y, _ = layer.decode(
                x[:, col : col + 1], cache, position_ids=position_ids[:, col : col + 1]
            )
            assert rel_err(y, ref[:, col : col + 1]) <= FLOAT32_TOL, f"step {s}"
        # Positions that differ from the default rotate differently.
        y_default, _ = layer.decode(x[:, -1:], cache)
        y_given, _ = layer.decode(x[:, -1:], cache, position_ids=torch.tensor([7]))
    assert rel_err(y_given, y_default) > 1e-3


def test_unmasked_decode_at_position_ids_equals_forward(
    make_layer: LayerFactory, gen: torch.Generator
) -> None:
    """Without a mask, prefill and decode at given position_ids ([B, T] then [B, 1]) equal
    forward at those positions: one NSACache, RoPE moved, blocks and window by cache length."""
    layer, x, _ = setup(make_layer, gen)
    position_ids = torch.arange(PROMPT + STEPS) + torch.tensor([[0], [9], [2], [30]])
    with torch.no_grad():
        ref = layer(x, position_ids=position_ids)
        y_pre, cache = layer.prefill(x[:, :PROMPT], position_ids=position_ids[:, :PROMPT])
        assert isinstance(cache, NSACache)
        steps = [
            layer.decode(x[:, c : c + 1], cache, position_ids=position_ids[:, c : c + 1])[0]
            for c in range(PROMPT, PROMPT + STEPS)
        ]
    assert rel_err(torch.cat([y_pre, *steps], dim=1), ref) <= FLOAT32_TOL
    assert cache.length == PROMPT + STEPS


def assert_rows_unchanged(cache: RaggedNSACache, before: list[dict[str, torch.Tensor]]) -> None:
    for b, (row, old) in enumerate(zip(cache.rows, before, strict=True)):
        new = row.state()
        assert new.keys() == old.keys()
        for name in old:
            assert torch.equal(new[name], old[name]), (b, name)


def clone_states(cache: RaggedNSACache) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in row.state().items()} for row in cache.rows]


def test_failure_in_one_row_restores_every_row(
    make_layer: LayerFactory, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error while stepping row 2 puts rows 0 and 1 (already stepped) back as well."""
    layer, x, mask = setup(make_layer, gen)
    with torch.no_grad():
        _, cache = layer.prefill(x[:, :PROMPT], attention_mask=mask[:, :PROMPT])
    before = clone_states(cache)
    lengths = cache.lengths
    step = layer._decode_step
    stepped: list[int] = []

    def fail_at_row_2(x: torch.Tensor, row: NSACache, positions: torch.Tensor | None) -> object:
        if len(stepped) == 2:
            raise RuntimeError("row 2 fails")
        stepped.append(1)
        return step(x, row, positions)

    monkeypatch.setattr(layer, "_decode_step", fail_at_row_2)
    with torch.no_grad(), pytest.raises(RuntimeError, match="row 2 fails"):
        layer.decode(x[:, PROMPT : PROMPT + 1], cache)
    assert stepped == [1, 1]
    assert cache.lengths == lengths
    assert_rows_unchanged(cache, before)


BAD_DECODES = [
    ("batch", lambda x: x[:3], {}, ValueError, "cache holds 4 rows but x has batch 3"),
    ("two-tokens", lambda x: x.expand(-1, 2, -1), {}, ValueError, "one token per sequence"),
    ("dtype", lambda x: x.double(), {}, TypeError, "x dtype torch.float64 differs"),
    ("pos-float", lambda x: x, {"position_ids": torch.zeros(4, 1)}, TypeError, "integers"),
    ("pos-rows", lambda x: x, {"position_ids": torch.zeros(2, 1, dtype=torch.long)}, ValueError,
     "position_ids [2, 1] must be [B, T], [1, T] or [T]"),
    ("pos-negative", lambda x: x, {"position_ids": torch.tensor([-1])}, ValueError,
     "position_ids must lie in [0,"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("change", "kwargs", "error", "fragment"),
    [c[1:] for c in BAD_DECODES],
    ids=[c[0] for c in BAD_DECODES],
)
def test_bad_decode_is_refused_and_changes_nothing(
    make_layer: LayerFactory,
    gen: torch.Generator,
    change: Callable[[torch.Tensor], torch.Tensor],
    kwargs: dict[str, object],
    error: type[Exception],
    fragment: str,
) -> None:
    layer, x, mask = setup(make_layer, gen)
    with torch.no_grad():
        _, cache = layer.prefill(x[:, :PROMPT], attention_mask=mask[:, :PROMPT])
    before = clone_states(cache)
    with pytest.raises(error, match=re.escape(fragment)):
        layer.decode(change(x[:, PROMPT : PROMPT + 1]), cache, **kwargs)  # type: ignore[call-overload]
    assert_rows_unchanged(cache, before)


def test_ragged_cache_of_another_layer_config_is_refused(
    make_layer: LayerFactory, gen: torch.Generator
) -> None:
    layer, x, mask = setup(make_layer, gen)
    other = make_layer(dataclasses.replace(CFG, window=8), HIDDEN, torch.float32)
    with torch.no_grad():
        _, cache = other.prefill(x[:, :PROMPT], attention_mask=mask[:, :PROMPT])
    with pytest.raises(ValueError, match="another layer config"):
        layer.decode(x[:, PROMPT : PROMPT + 1], cache)
    assert cache.lengths == LENGTHS


def test_ragged_cache_checks_its_parts() -> None:
    row = NSACache.empty(CFG, 1)
    with pytest.raises(TypeError, match="rows must be a list of NSACache"):
        RaggedNSACache([row, "row"], [0, 0])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"rows\[0\] must hold one sequence, got batch 2"):
        RaggedNSACache([NSACache.empty(CFG, 2)], [0])
    with pytest.raises(ValueError, match="one column per row"):
        RaggedNSACache([row], [0, 3])
    with pytest.raises(TypeError, match="starts must be a list"):
        RaggedNSACache([row], (0,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"starts\[0\] must be >= 0"):
        RaggedNSACache([row], [-1])
    assert RaggedNSACache([row, row], [0, 2]).batch == 2
