"""A float32 layer under torch.autocast: forward, prefill + decode and a training step.

docs/spec.md, "Decode", mixed precision: the layer's compute dtype is the autocast dtype of its
device type while autocast is on there; the learned parts run as autocast casts them, RoPE,
compression and the attention ops run in the compute dtype with autocast off, and the cache
holds keys and values in the compute dtype.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import pytest
import torch

from nsa_core import NSAAttention, NSACache, NSAConfig

LayerFactory = Callable[..., NSAAttention]

HALF = [torch.bfloat16, torch.float16]
PHIS = ["avg", "mlp"]
HIDDEN = 32
T = 41  # ten complete compressed blocks and a partial one; five selection blocks
PREFIX = 13  # decode then crosses the emission of blocks 2..8 and selection blocks 2..4

# docs/spec.md, "Tolerances": a computation in bf16 (fp16) against one in float32. Decode and
# prefill are both the half-precision computation, differing only in how the float32 sums
# inside the ops are grouped; each sits within the table's bound of the float32 math.
SPEC_TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3}

# n = 3 holds exactly the forced blocks (initial and two local), so no slot is chosen by score:
# the rounding that separates the compared computations cannot trade a selected block.
BASE = NSAConfig(
    num_q_heads=4, num_kv_heads=2, head_dim_qk=16, head_dim_v=8, cmp_block=8, cmp_stride=4,
    sel_block=8, num_selected=3, window=12,
)  # fmt: skip


def config(phi: str) -> NSAConfig:
    return dataclasses.replace(BASE, phi=phi)  # type: ignore[arg-type]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64."""
    diff = out.double() - ref.double()
    return float(diff.norm() / ref.double().norm())


def layer_and_x(
    make_layer: LayerFactory, gen: torch.Generator, phi: str
) -> tuple[NSAAttention, torch.Tensor]:
    """A float32 layer and x [2, T, hidden] float32, both drawn from ``gen``."""
    layer = make_layer(config(phi), HIDDEN, torch.float32)
    x = torch.randn(2, T, HIDDEN, generator=gen, dtype=torch.float64).float()
    return layer, x


# ------------------------------------------------------------------------------ compute dtype


def test_compute_dtype_follows_autocast_of_the_layer_device_type() -> None:
    layer = NSAAttention(config("avg"), HIDDEN)
    assert layer.compute_dtype() == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer.compute_dtype() == torch.bfloat16
        # Autocast leaves float64 alone, and so does the layer.
        assert copy.deepcopy(layer).double().compute_dtype() == torch.float64
    with torch.autocast("cpu", dtype=torch.float16):
        assert layer.compute_dtype() == torch.float16
    assert layer.compute_dtype() == torch.float32


# ------------------------------------------------------------------------------ forward


@pytest.mark.parametrize("phi", PHIS)
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_forward_equals_the_layer_cast_to_the_autocast_dtype(
    make_layer: LayerFactory, gen: torch.Generator, dtype: torch.dtype, phi: str
) -> None:
    """Bit for bit, whether x comes in float32 or in the autocast dtype.

    The bound is not the table's (a half-precision computation against a float32 one): here both
    sides are the same half-precision computation. Autocast rounds each float32 parameter to the
    dtype once, as ``.to(dtype)`` does, and runs the same linear ops on those values; after the
    projections the layer runs with autocast off in the same dtype, so every later op sees the
    same inputs. The expected difference is therefore zero.
    """
    layer, x = layer_and_x(make_layer, gen, phi)
    cast = copy.deepcopy(layer).to(dtype)
    expected = cast(x.to(dtype))
    with torch.autocast("cpu", dtype=dtype):
        from_float32 = layer(x)
        from_half = layer(x.to(dtype))
    assert from_float32.dtype == dtype
    assert torch.equal(from_float32, expected)
    assert torch.equal(from_half, expected)


@pytest.mark.parametrize("phi", PHIS)
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_every_step_after_the_projections_computes_in_the_autocast_dtype(
    make_layer: LayerFactory, gen: torch.Generator, dtype: torch.dtype, phi: str
) -> None:
    """Gates, RoPE'd q and keys, values, phi's compressed keys and values and the three branch
    outputs come out in the autocast dtype, equal to the cast layer's (reason as above)."""
    layer, x = layer_and_x(make_layer, gen, phi)
    cast = copy.deepcopy(layer).to(dtype)
    positions = torch.arange(T)
    want = cast.branch_inputs(x.to(dtype), positions)
    want_cmp = cast.compress_kv(want.k["cmp"], want.v["cmp"])
    want_out = cast.branch_outputs(
        want.q, *want_cmp, want.k["sel"], want.v["sel"], want.k["win"], want.v["win"]
    )
    with torch.autocast("cpu", dtype=dtype):
        got = layer.branch_inputs(x, positions)
        got_cmp = layer.compress_kv(got.k["cmp"], got.v["cmp"])
        got_out = layer.branch_outputs(
            got.q, *got_cmp, got.k["sel"], got.v["sel"], got.k["win"], got.v["win"]
        )
    pairs = [("q", got.q, want.q), ("gates", got.gates, want.gates)]
    for b in ("cmp", "sel", "win"):
        pairs += [(f"k[{b!r}]", got.k[b], want.k[b]), (f"v[{b!r}]", got.v[b], want.v[b])]
    pairs += [("k_cmp", got_cmp[0], want_cmp[0]), ("v_cmp", got_cmp[1], want_cmp[1])]
    pairs += [
        (f"o_{b}", g, w)
        for b, g, w in zip(("cmp", "sel", "win"), got_out[:3], want_out[:3], strict=True)
    ]
    for name, g, w in pairs:
        assert g.dtype == dtype, name
        assert torch.equal(g, w), name
    assert torch.equal(got_out[3], want_out[3])  # the same blocks selected


# ------------------------------------------------------------------------------ decode


@pytest.mark.parametrize("phi", PHIS)
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_prefill_and_decode_steps_equal_the_forward_rows(
    make_layer: LayerFactory, gen: torch.Generator, dtype: torch.dtype, phi: str
) -> None:
    layer, x = layer_and_x(make_layer, gen, phi)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        full = layer(x)
        y_prefix, cache = layer.prefill(x[:, :PREFIX])
        assert cache.dtype == dtype
        steps = [layer.decode(x[:, t : t + 1], cache)[0] for t in range(PREFIX, T)]
    assert cache.length == T
    assert torch.equal(y_prefix, full[:, :PREFIX])
    decoded = torch.cat(steps, dim=1)
    assert decoded.dtype == dtype
    assert rel_err(decoded, full[:, PREFIX:]) <= SPEC_TOL[dtype]


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_prefill_leaves_the_cache_that_steps_under_autocast_leave(
    make_layer: LayerFactory, gen: torch.Generator, dtype: torch.dtype
) -> None:
    layer, x = layer_and_x(make_layer, gen, "mlp")
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        _, prefilled = layer.prefill(x)
        stepped = NSACache.empty(layer.config, 2, dtype=dtype)
        for t in range(T):
            layer.decode(x[:, t : t + 1], stepped)
    for name, tensor in prefilled.state().items():
        assert tensor.dtype == dtype, name
        assert torch.equal(tensor, stepped.state()[name]), name


# ------------------------------------------------------------------------------ training


@pytest.mark.parametrize("phi", PHIS)
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_a_training_step_gives_finite_float32_gradients(
    make_layer: LayerFactory, gen: torch.Generator, dtype: torch.dtype, phi: str
) -> None:
    layer, x = layer_and_x(make_layer, gen, phi)
    x.requires_grad_(True)
    with torch.autocast("cpu", dtype=dtype):
        y = layer(x)
    y.float().square().mean().backward()
    assert x.grad is not None
    assert x.grad.dtype == torch.float32
    assert bool(x.grad.isfinite().all())
    for name, p in layer.named_parameters():
        assert p.grad is not None, name
        assert p.grad.dtype == torch.float32, name
        assert bool(p.grad.isfinite().all()), name
        assert bool(p.grad.ne(0).any()), name


# ------------------------------------------------------------------------------ refusals


def test_a_cache_built_under_autocast_is_refused_without_it(make_layer: LayerFactory) -> None:
    layer = make_layer(config("avg"), HIDDEN, torch.float32)
    x = torch.randn(2, 9, HIDDEN)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, cache = layer.prefill(x)
    before = {k: v.clone() for k, v in cache.state().items()}
    with pytest.raises(
        TypeError,
        match=r"cache dtype torch.bfloat16 differs from torch.float32, the dtype this step "
        r"computes keys and values in .*decode under the autocast setting the cache was built",
    ):
        layer.decode(x[:, :1], cache)
    assert cache.length == 9
    for name, tensor in cache.state().items():
        assert torch.equal(tensor, before[name]), name


def test_a_cache_built_without_autocast_is_refused_under_it(make_layer: LayerFactory) -> None:
    layer = make_layer(config("avg"), HIDDEN, torch.float32)
    x = torch.randn(2, 9, HIDDEN)
    _, cache = layer.prefill(x)
    with (
        torch.autocast("cpu", dtype=torch.float16),
        pytest.raises(TypeError, match=r"cache dtype torch.float32 differs from torch.float16"),
    ):
        layer.decode(x[:, :1], cache)


def test_a_half_x_without_autocast_says_how_to_run_it() -> None:
    layer = NSAAttention(config("avg"), HIDDEN)
    with pytest.raises(
        TypeError,
        match=r"x dtype torch.bfloat16 differs from the layer's torch.float32: cast the layer "
        r"\(layer.to\(torch.bfloat16\)\) or x, or run the layer under "
        r"torch.autocast\('cpu', torch.bfloat16\)",
    ):
        layer(torch.randn(1, 8, HIDDEN, dtype=torch.bfloat16))


def test_under_autocast_x_is_in_the_layer_dtype_or_the_autocast_dtype() -> None:
    layer = NSAAttention(config("avg"), HIDDEN)
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        pytest.raises(
            TypeError,
            match=r"x dtype torch.float16 is neither the layer's torch.float32 nor the autocast "
            r"dtype torch.bfloat16",
        ),
    ):
        layer(torch.randn(1, 8, HIDDEN, dtype=torch.float16))
