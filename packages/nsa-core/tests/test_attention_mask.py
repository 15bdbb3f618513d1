"""NSAAttention over a padded batch: ``attention_mask`` and ``position_ids``.

docs/spec.md, "Padding and positions": each row's real tokens are one sequence of their own, the
padding's output rows are exactly 0, and position_ids move RoPE only (block geometry follows each
token's index within its own sequence). Outputs are compared with each sequence's own unpadded
run within the spec's float32 bound (1e-5; gradients 2e-5).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import pytest
import torch

import nsa_core.attention
from nsa_core import NSAAttention, NSAConfig, apply_rope
from nsa_core.core import run_attention_core

LayerFactory = Callable[..., NSAAttention]

# docs/spec.md, "Tolerances": a float32 path, its gradients twice that.
FLOAT32_TOL = 1e-5
GRAD_TOL = 2e-5
# Two float64 runs whose RoPE angles differ only by the rounding of large positions.
FLOAT64_TOL = 1e-10

CFG = NSAConfig(
    num_q_heads=4, num_kv_heads=1, head_dim_qk=16, head_dim_v=16,
    cmp_block=8, cmp_stride=4, sel_block=8, num_selected=3, window=16,
)  # fmt: skip
HIDDEN = 32
T = 48
# Rows: full, past the window and several blocks, shorter than one compressed block, empty.
LENGTHS = [T, 37, 5, 0]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64."""
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def padding_mask(lengths: list[int], t: int, side: str) -> torch.Tensor:
    """[B, t] bool: row b holds lengths[b] tokens at the right end ("left" padding) or the left."""
    columns = torch.arange(t)
    mask = torch.stack([columns >= t - n if side == "left" else columns < n for n in lengths])
    return mask


def run_of(mask: torch.Tensor, b: int) -> slice:
    """The columns of row b's tokens."""
    cols = mask[b].nonzero().flatten().tolist()
    return slice(cols[0], cols[-1] + 1) if cols else slice(0, 0)


def default_positions(mask: torch.Tensor) -> torch.Tensor:
    """[B, T]: 0, 1, 2, ... from each row's first token, 1 at the padding (as Hugging Face
    builds them)."""
    counts = mask.long().cumsum(dim=1) - 1
    return counts.masked_fill(~mask, 1)


def layer_and_input(
    make_layer: LayerFactory,
    gen: torch.Generator,
    phi: str = "avg",
    dtype: torch.dtype = torch.float32,
    batch: int = len(LENGTHS),
) -> tuple[NSAAttention, torch.Tensor]:
    layer = make_layer(dataclasses.replace(CFG, phi=phi), HIDDEN, dtype)  # type: ignore[arg-type]
    return layer, torch.randn(batch, T, HIDDEN, generator=gen, dtype=dtype)


@pytest.mark.parametrize("phi", ["avg", "mlp"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_each_row_equals_its_own_run(
    make_layer: LayerFactory, gen: torch.Generator, side: str, phi: str
) -> None:
    """Row b's tokens give what the sequence gives alone (B = 1, no mask); padding gives 0."""
    layer, x = layer_and_input(make_layer, gen, phi)
    mask = padding_mask(LENGTHS, T, side)
    with torch.no_grad():
        y = layer(x, attention_mask=mask)
        for b in range(len(LENGTHS)):
            run = run_of(mask, b)
            assert torch.equal(y[b][~mask[b]], torch.zeros_like(y[b][~mask[b]])), f"row {b}"
            if LENGTHS[b]:
                ref = layer(x[b : b + 1, run])
                assert rel_err(y[b : b + 1, run], ref) <= FLOAT32_TOL, f"row {b}"


def test_integer_mask_equals_bool_mask(make_layer: LayerFactory, gen: torch.Generator) -> None:
    layer, x = layer_and_input(make_layer, gen)
    mask = padding_mask(LENGTHS, T, "left")
    with torch.no_grad():
        by_bool = layer(x, attention_mask=mask)
        for dtype in (torch.int64, torch.int32, torch.uint8):
            assert torch.equal(layer(x, attention_mask=mask.to(dtype)), by_bool), dtype


def test_a_mask_of_ones_equals_no_mask(make_layer: LayerFactory, gen: torch.Generator) -> None:
    layer, x = layer_and_input(make_layer, gen, batch=2)
    with torch.no_grad():
        plain = layer(x)
        masked = layer(x, attention_mask=torch.ones(2, T, dtype=torch.bool))
    assert rel_err(masked, plain) <= FLOAT32_TOL


def test_single_padded_row(make_layer: LayerFactory, gen: torch.Generator) -> None:
    """B = 1 with left padding: the tokens run as the sequence alone would."""
    layer, x = layer_and_input(make_layer, gen, batch=1)
    mask = padding_mask([29], T, "left")
    with torch.no_grad():
        y = layer(x, attention_mask=mask)
        ref = layer(x[:, T - 29 :])
    assert torch.equal(y[:, : T - 29], torch.zeros_like(y[:, : T - 29]))
    assert rel_err(y[:, T - 29 :], ref) <= FLOAT32_TOL


def test_rows_without_tokens_give_zeros(make_layer: LayerFactory, gen: torch.Generator) -> None:
    """An all-zero mask is allowed: every output row is 0 and x takes a zero gradient."""
    layer, x = layer_and_input(make_layer, gen, batch=2)
    x.requires_grad_(True)
    y = layer(x, attention_mask=torch.zeros(2, T, dtype=torch.int64))
    assert y.shape == x.shape
    assert torch.equal(y, torch.zeros_like(y))
    y.sum().backward()
    assert x.grad is not None
    assert torch.equal(x.grad, torch.zeros_like(x))


@pytest.mark.parametrize("side", ["left", "right"])
def test_gradients_follow_each_row(
    make_layer: LayerFactory, gen: torch.Generator, side: str
) -> None:
    """The padding's inputs take a gradient of exactly 0; each row's tokens take the gradient of
    the sequence run alone, under the same output weights."""
    layer, x = layer_and_input(make_layer, gen, phi="mlp")
    mask = padding_mask(LENGTHS, T, side)
    weights = torch.randn(x.shape, generator=gen)
    x.requires_grad_(True)
    (layer(x, attention_mask=mask) * weights).sum().backward()
    assert x.grad is not None
    assert torch.equal(x.grad[~mask], torch.zeros_like(x.grad[~mask]))
    for b in range(len(LENGTHS)):
        if not LENGTHS[b]:
            continue
        run = run_of(mask, b)
        x_b = x.detach()[b : b + 1, run].clone().requires_grad_(True)
        (layer(x_b) * weights[b : b + 1, run]).sum().backward()
        assert x_b.grad is not None
        assert rel_err(x.grad[b : b + 1, run], x_b.grad) <= GRAD_TOL, f"row {b}"


def test_default_position_ids_change_nothing(
    make_layer: LayerFactory, gen: torch.Generator
) -> None:
    """position_ids equal to the positions the layer would use give bit-identical outputs."""
    layer, x = layer_and_input(make_layer, gen)
    mask = padding_mask(LENGTHS, T, "left")
    arange = torch.arange(T)
    with torch.no_grad():
        assert torch.equal(
            layer(x, attention_mask=mask, position_ids=default_positions(mask)),
            layer(x, attention_mask=mask),
        )
        plain = layer(x)
        for ids in (arange, arange[None], arange.expand(len(LENGTHS), T).to(torch.int32)):
            assert torch.equal(layer(x, position_ids=ids), plain), list(ids.shape)
        cu_seqlens = torch.tensor([0, 20, T], dtype=torch.int32)
        packed = torch.cat([torch.arange(20), torch.arange(T - 20)])
        assert torch.equal(layer(x[:1], cu_seqlens, position_ids=packed), layer(x[:1], cu_seqlens))


def test_position_ids_rotate_q_and_k(
    make_layer: LayerFactory, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attention core receives q and every key rotated by apply_rope at the given
    position_ids of each real token (the padding's are not used)."""
    layer, x = layer_and_input(make_layer, gen)
    mask = padding_mask(LENGTHS, T, "left")
    position_ids = default_positions(mask) + torch.tensor([[3], [100], [7], [0]])
    position_ids[~mask] = -5
    seen: list[tuple[torch.Tensor, ...]] = []

    def spy(*args: torch.Tensor, **kwargs: object) -> torch.Tensor:
        seen.append(args)
        return run_attention_core(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(nsa_core.attention, "run_attention_core", spy)
    with torch.no_grad():
        layer(x, attention_mask=mask, position_ids=position_ids)
    (q, _, _, k_sel, _, k_win, *_) = seen[0]
    tokens = x[mask][None]  # [1, N, hidden], row by row
    positions = position_ids[mask][None]
    cfg = layer.config

    def rotated(proj: torch.nn.Module, heads: int) -> torch.Tensor:
        raw = proj(tokens).view(1, tokens.shape[1], heads, cfg.head_dim_qk)
        out: torch.Tensor = apply_rope(raw, positions, cfg.rope_theta)
        return out

    assert torch.equal(q, rotated(layer.q_proj, cfg.num_q_heads))
    assert torch.equal(k_sel, rotated(layer.k_proj["sel"], cfg.num_kv_heads))
    assert torch.equal(k_win, rotated(layer.k_proj["win"], cfg.num_kv_heads))


def test_position_ids_move_rope_only(make_layer: LayerFactory, gen: torch.Generator) -> None:
    """Shifting a sequence's positions by a constant leaves its output as it was (RoPE logits
    depend on position differences), whatever the shift does to block boundaries: the
    compression blocks, selection blocks and window follow each token's index in its sequence.
    A shift that differs between tokens changes the output."""
    layer, x = layer_and_input(make_layer, gen, dtype=torch.float64)
    mask = padding_mask(LENGTHS, T, "right")
    positions = default_positions(mask)
    with torch.no_grad():
        ref = layer(x, attention_mask=mask)
        shifted = layer(x, attention_mask=mask, position_ids=positions + 5)
        stretched = layer(x, attention_mask=mask, position_ids=2 * positions)
    assert rel_err(shifted, ref) <= FLOAT64_TOL
    assert rel_err(stretched, ref) > 1e-3


def test_checks_run_before_any_work(make_layer: LayerFactory, gen: torch.Generator) -> None:
    """A refused argument leaves the projections uncalled."""
    layer, x = layer_and_input(make_layer, gen)
    calls: list[int] = []
    layer.q_proj.register_forward_hook(lambda *_: calls.append(1))
    mask = padding_mask(LENGTHS, T, "left")
    with pytest.raises(ValueError, match="position_ids must lie in"):
        layer(x, attention_mask=mask, position_ids=default_positions(mask) - 1)
    with pytest.raises(ValueError, match="one contiguous run"):
        layer.prefill(x, attention_mask=mask.flip(1) | mask)
    assert calls == []


def test_a_masked_batch_without_rows_is_refused(make_layer: LayerFactory) -> None:
    """B == 0 holds no sequence to pack: refused by name rather than run."""
    layer = make_layer(CFG, HIDDEN, torch.float32)
    with pytest.raises(ValueError, match=re.escape("attention_mask [0, T] holds no rows")):
        layer(torch.zeros(0, T, HIDDEN), attention_mask=torch.zeros(0, T, dtype=torch.bool))


TE, VE = TypeError, ValueError
MASK = padding_mask(LENGTHS, T, "left")
GAP = MASK.clone()
GAP[1, T - 10] = False
CU = torch.tensor([0, T], dtype=torch.int32)
POS_SHAPE = "must be [B, T], [1, T] or [T] with B=4, T=48"


def bad_calls() -> list[tuple[str, dict[str, object], type[Exception], str]]:
    """(id, forward's keyword arguments, error type, message fragment)."""
    positions = default_positions(MASK)
    return [
        ("mask-list", {"attention_mask": MASK.tolist()}, TE, "attention_mask must be a torch"),
        ("mask-float", {"attention_mask": MASK.float()}, TE, "attention_mask must be bool"),
        ("mask-shape", {"attention_mask": MASK[:, 1:]}, VE, "attention_mask [4, 47] must be"),
        ("mask-1d", {"attention_mask": MASK[0]}, VE, "attention_mask [48] must be"),
        ("mask-device", {"attention_mask": MASK.to("meta")}, VE, "attention_mask is on meta"),
        ("mask-values", {"attention_mask": MASK.long() * 2}, VE, "attention_mask must hold only 0"),
        ("mask-negative", {"attention_mask": -MASK.long()}, VE, "attention_mask must hold only 0"),
        ("mask-gap", {"attention_mask": GAP}, VE, "attention_mask row 1 splits its tokens into 2"),
        ("mask-and-cu", {"attention_mask": MASK, "cu_seqlens": CU},
         VE, "attention_mask and cu_seqlens both mark sequences"),
        ("pos-list", {"position_ids": list(range(T))}, TE, "position_ids must be a torch.Tensor"),
        ("pos-float", {"position_ids": positions.float()}, TE, "position_ids must hold integers"),
        ("pos-bool", {"position_ids": MASK}, TE, "position_ids must hold integers"),
        ("pos-length", {"position_ids": positions[:, 1:]}, VE, POS_SHAPE),
        ("pos-rows", {"position_ids": positions[:2]}, VE, POS_SHAPE),
        ("pos-rank", {"position_ids": positions[None]}, VE, POS_SHAPE),
        ("pos-device", {"position_ids": positions.to("meta")}, VE, "position_ids is on meta"),
        ("pos-negative", {"position_ids": positions - 1}, VE, "position_ids must lie in [0,"),
        ("pos-negative-masked", {"attention_mask": MASK, "position_ids": positions - 1}, VE,
         "got values in [-1,"),
        ("pos-int32-range", {"position_ids": positions + 2**31}, VE, "(int32 positions)"),
    ]  # fmt: skip


BAD = bad_calls()


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"), [c[1:] for c in BAD], ids=[c[0] for c in BAD]
)
def test_bad_arguments_are_refused(
    make_layer: LayerFactory,
    gen: torch.Generator,
    kwargs: dict[str, object],
    error: type[Exception],
    fragment: str,
) -> None:
    """forward and prefill refuse the argument with the error type and a message naming it."""
    layer, x = layer_and_input(make_layer, gen)
    with pytest.raises(error, match=re.escape(fragment)):
        layer(x, **kwargs)
    if "cu_seqlens" not in kwargs:
        with pytest.raises(error, match=re.escape(fragment)):
            layer.prefill(x, **kwargs)  # type: ignore[call-overload]
