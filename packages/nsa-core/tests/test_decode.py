"""Decode == prefill at every position, and a prefill leaves the cache that stepping would.

docs/spec.md, "Decode": a step at position t equals the prefill output at t for the same prefix,
block i is emitted when the token at ``i*d + l - 1`` arrives, and a prefill of P tokens leaves the
cache exactly as P single steps would.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import pytest
import torch
from geometry_lib import geometry

from nsa_core import NSAAttention, NSACache, NSAConfig, compress
from nsa_core.blocks import num_cmp_blocks

# float64 decode vs float64 forward (same math, different grouping of the sums).
DECODE_TOL = 1e-10
# docs/spec.md, "Tolerances": a float32 path vs float64.
FLOAT32_TOL = 1e-5
# Two float64 computations of the same projections that differ only in how the matmul is blocked.
ROUNDING_TOL = 1e-13

LayerFactory = Callable[..., NSAAttention]


def config(**kw: int | str) -> NSAConfig:
    return NSAConfig(**kw)  # type: ignore[arg-type]


# (id, config, T, hidden). Small dims; each geometry makes selection and the window matter.
Case = tuple[str, NSAConfig, int, int]
CASES: list[Case] = [
    # n = 3: the forced blocks fill every slot; w = 5 is shorter than l.
    (
        "l8-d4-ls8-n3-w5",
        config(**geometry(4, 2, 8, 6, 8, 4, 8, n=3, w=5)),
        45,
        16,
    ),
    # n = 4 with up to 8 valid blocks: one slot chosen by score; G = 3, dk != dv.
    (
        "l8-d4-ls8-n4-w5-g3",
        config(**geometry(6, 2, 8, 4, 8, 4, 8, n=4, w=5)),
        64,
        12,
    ),
    # l' != l, G = 1, d = l / 4.
    (
        "l8-d2-ls16-n3-w7-g1",
        config(**geometry(2, 2, 4, 8, 8, 2, 16, n=3, w=7)),
        70,
        8,
    ),
    # The paper's block geometry (l=32, d=16, l'=64) with n = 4: at t >= 256 a slot is chosen by
    # score among 2 or 3 candidates; w = 40 < T.
    (
        "l32-d16-ls64-n4-w40",
        config(**geometry(4, 2, 8, 8, 32, 16, 64, n=4, w=40)),
        330,
        16,
    ),
]  # fmt: skip
CASE_IDS = [c[0] for c in CASES]
PHIS = ["avg", "mlp"]


def with_phi(cfg: NSAConfig, phi: str) -> NSAConfig:
    return dataclasses.replace(cfg, phi=phi)  # type: ignore[arg-type]


def layer_and_input(
    make_layer: LayerFactory, gen: torch.Generator, case: Case, phi: str
) -> tuple[NSAConfig, NSAAttention, torch.Tensor]:
    """The case's config with ``phi``, its float64 layer and x [2, T, hidden] float64, all drawn
    from ``gen`` (layer first)."""
    _, cfg, t, hidden = case
    cfg = with_phi(cfg, phi)
    layer = make_layer(cfg, hidden)
    return cfg, layer, torch.randn(2, t, hidden, generator=gen, dtype=torch.float64)


def rel_err_per_position(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """[T]: ||out[:, t] - ref[:, t]|| / ||ref[:, t]|| over batch and features."""
    diff = (out - ref).transpose(0, 1).flatten(1).norm(dim=1)
    errs: torch.Tensor = diff / ref.transpose(0, 1).flatten(1).norm(dim=1)
    return errs


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).norm() / ref.norm())


def decode_all(
    layer: NSAAttention, x: torch.Tensor, cache: NSACache, start: int
) -> tuple[torch.Tensor, list[int]]:
    """Decode x[:, start:] token by token; -> outputs [B, T-start, hidden], num_cmp per step."""
    outs, num_cmp = [], []
    for t in range(start, x.shape[1]):
        assert cache.length == t
        y, stats = layer.decode(x[:, t : t + 1], cache)
        assert stats.position == t
        outs.append(y)
        num_cmp.append(cache.num_cmp)
    if not outs:
        return x[:, :0], num_cmp
    return torch.cat(outs, dim=1), num_cmp


def assert_same_cache(a: NSACache, b: NSACache) -> None:
    assert a.length == b.length
    assert a.num_cmp == b.num_cmp
    sa, sb = a.state(), b.state()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].shape == sb[name].shape, name
        assert sa[name].dtype == sb[name].dtype, name
        if sa[name].numel():
            scale = sb[name].abs().max()
            err = (sa[name] - sb[name]).abs().max()
            assert err <= ROUNDING_TOL * scale, (name, float(err), float(scale))


@pytest.mark.parametrize("phi", PHIS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_decode_equals_forward_at_every_position(
    make_layer: LayerFactory, gen: torch.Generator, phi: str, case: Case
) -> None:
    """Stepping from an empty cache reproduces forward (and prefill) at every position; the
    cache emits block i exactly when token i*d + l - 1 arrives."""
    cfg, layer, x = layer_and_input(make_layer, gen, case, phi)
    t = x.shape[1]
    with torch.no_grad():
        ref = layer(x)
        y_prefill, _ = layer.prefill(x)
        cache = NSACache.empty(cfg, 2, dtype=torch.float64)
        y_dec, num_cmp = decode_all(layer, x, cache, 0)
    assert rel_err(y_prefill, ref) <= DECODE_TOL
    errs = rel_err_per_position(y_dec, ref)
    worst = int(errs.argmax())
    assert errs.max() <= DECODE_TOL, f"position {worst}: relative error {float(errs[worst]):.3g}"

    lc, d = cfg.cmp_block, cfg.cmp_stride
    assert num_cmp == [num_cmp_blocks(p + 1, lc, d) for p in range(t)]
    emitted_at = [p for p in range(t) if num_cmp[p] > (num_cmp[p - 1] if p else 0)]
    assert emitted_at == [i * d + lc - 1 for i in range(num_cmp_blocks(t, lc, d))]


# Prefix lengths: 1, just before / at the first compressed block, just after a selection-block
# boundary, and all but the last token.
def prefixes(cfg: NSAConfig, t: int) -> list[int]:
    lc, ls = cfg.cmp_block, cfg.sel_block
    return sorted({1, lc - 1, lc, ls + 1, t - 1})


@pytest.mark.parametrize("phi", PHIS)
@pytest.mark.parametrize("case", CASES[:3], ids=CASE_IDS[:3])
def test_prefill_then_decode_equals_forward(
    make_layer: LayerFactory, gen: torch.Generator, phi: str, case: Case
) -> None:
    cfg, layer, x = layer_and_input(make_layer, gen, case, phi)
    t = x.shape[1]
    with torch.no_grad():
        ref = layer(x)
        for p in prefixes(cfg, t):
            y_pre, cache = layer.prefill(x[:, :p])
            y_dec, _ = decode_all(layer, x, cache, p)
            errs = rel_err_per_position(torch.cat([y_pre, y_dec], dim=1), ref)
            assert errs.max() <= DECODE_TOL, f"prefix {p}: worst position {int(errs.argmax())}"


def test_prefill_then_decode_paper_geometry(make_layer: LayerFactory, gen: torch.Generator) -> None:
    """l=32, d=16, l'=64: prefill a prompt that ends mid-block, then decode across the block
    boundaries at 255/256 and the emission of block 15 (token 271)."""
    _, cfg, t, hidden = CASES[3]
    cfg = with_phi(cfg, "mlp")
    layer = make_layer(cfg, hidden)
    x = torch.randn(1, t, hidden, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        ref = layer(x)
        y_pre, cache = layer.prefill(x[:, :250])
        y_dec, _ = decode_all(layer, x, cache, 250)
    errs = rel_err_per_position(torch.cat([y_pre, y_dec], dim=1), ref)
    assert errs.max() <= DECODE_TOL, f"worst position {int(errs.argmax())}"


@pytest.mark.parametrize("phi", PHIS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_prefill_cache_equals_stepped_cache(
    make_layer: LayerFactory, gen: torch.Generator, phi: str, case: Case
) -> None:
    """The cache after prefill(P) and after P single steps: identical lengths, block counts and
    shapes; values equal up to float64 rounding (projecting one row or P rows at once may differ
    in the last bits, because the matmul is blocked differently)."""
    cfg, layer, x = layer_and_input(make_layer, gen, case, phi)
    t = x.shape[1]
    with torch.no_grad():
        stepped = NSACache.empty(cfg, 2, dtype=torch.float64)
        done = 0
        for p in sorted({0, *prefixes(cfg, t), t}):
            _, prefilled = layer.prefill(x[:, :p], capacity=2 * p)
            decode_all(layer, x[:, :p], stepped, done)
            done = p
            assert prefilled.length == p
            assert prefilled.num_cmp == num_cmp_blocks(p, cfg.cmp_block, cfg.cmp_stride)
            assert prefilled.k_win.shape[1] == min(cfg.window, p)
            assert prefilled.k_raw.shape[1] == p - prefilled.num_cmp * cfg.cmp_stride
            assert_same_cache(prefilled, stepped)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunks", [[1], [3, 1, 7, 2], [50], [16, 16, 1]])
def test_cache_appends_are_bitwise_independent_of_chunking(
    gen: torch.Generator, dtype: torch.dtype, chunks: list[int]
) -> None:
    """Feeding the same K/V to NSACache all at once, or in chunks (1 token = decode), with phi avg
    gives bitwise the same state: the cache only stores and drops, it never recomputes."""
    cfg = config(**geometry(4, 2, 8, 6, 32, 16, 64, n=3, w=50))
    batch, t, h = 2, 203, cfg.num_kv_heads
    lc, d = cfg.cmp_block, cfg.cmp_stride
    kv = {
        name: torch.randn(batch, t, h, dim, generator=gen, dtype=torch.float64).to(dtype)
        for name, dim in [("k_sel", 8), ("v_sel", 6), ("k_win", 8), ("v_win", 6),
                          ("k_raw", 8), ("v_raw", 6)]
    }  # fmt: skip

    def tokens(lo: int, hi: int) -> list[torch.Tensor]:
        return [kv[n][:, lo:hi] for n in ("k_sel", "v_sel", "k_win", "v_win", "k_raw", "v_raw")]

    whole = NSACache.empty(cfg, batch, capacity=t, dtype=dtype)
    whole.append_tokens(*tokens(0, t))
    k_cmp, v_cmp = compress(kv["k_raw"], lc, d), compress(kv["v_raw"], lc, d)
    whole.append_blocks(k_cmp, v_cmp, consumed=k_cmp.shape[1] * d)

    parts = NSACache.empty(cfg, batch, dtype=dtype)  # no capacity: exercises growth
    pos, step = 0, 0
    while pos < t:
        end = min(t, pos + chunks[step % len(chunks)])
        step += 1
        parts.append_tokens(*tokens(pos, end))
        pos = end
        # Emit every block whose last token has arrived, each from the first l raw tokens.
        while num_cmp_blocks(pos, lc, d) > parts.num_cmp:
            kb = compress(parts.k_raw[:, :lc], lc, d)
            vb = compress(parts.v_raw[:, :lc], lc, d)
            assert kb.shape[1] == 1
            parts.append_blocks(kb, vb, consumed=d)

    assert whole.length == parts.length == t
    assert whole.num_cmp == parts.num_cmp == num_cmp_blocks(t, lc, d)
    for name, value in whole.state().items():
        assert torch.equal(value, parts.state()[name]), name
    assert torch.equal(whole.k_sel, kv["k_sel"])
    assert torch.equal(whole.k_win, kv["k_win"][:, -cfg.window :])
    assert torch.equal(whole.v_raw, kv["v_raw"][:, whole.num_cmp * d :])


def test_cache_state_while_filling(gen: torch.Generator) -> None:
    """Before the window is full it holds every token; raw K/V keep tokens [num_cmp*d, length)."""
    cfg = config(**geometry(2, 1, 4, 4, 8, 4, 8, n=3, w=6))
    cache = NSACache.empty(cfg, 1, dtype=torch.float64)
    k = torch.randn(1, 20, 1, 4, generator=gen, dtype=torch.float64)
    for t in range(20):
        kt = k[:, t : t + 1]
        cache.append_tokens(kt, kt, kt, kt, kt, kt)
        if num_cmp_blocks(t + 1, 8, 4) > cache.num_cmp:
            cache.append_blocks(compress(cache.k_raw[:, :8], 8, 4),
                                compress(cache.v_raw[:, :8], 8, 4), consumed=4)  # fmt: skip
        lo = max(0, t + 1 - 6)
        assert torch.equal(cache.k_win, k[:, lo : t + 1])
        assert torch.equal(cache.k_raw, k[:, cache.num_cmp * 4 : t + 1])
        assert torch.equal(cache.k_sel, k[:, : t + 1])
        assert cache.num_cmp == num_cmp_blocks(t + 1, 8, 4)
        if cache.num_cmp:
            expected = torch.stack(
                [k[:, i * 4 : i * 4 + 8].mean(1) for i in range(cache.num_cmp)], 1
            )
            assert torch.allclose(cache.k_cmp, expected, rtol=0, atol=1e-15)


@pytest.mark.parametrize("phi", PHIS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_float32_forward_matches_float64(
    make_layer: LayerFactory, gen: torch.Generator, phi: str, case: Case
) -> None:
    """The same layer and inputs in float32 and float64 agree to 1e-5 (docs/spec.md)."""
    _, layer64, x = layer_and_input(make_layer, gen, case, phi)
    layer32 = copy.deepcopy(layer64).float()
    with torch.no_grad():
        y64 = layer64(x)
        y32 = layer32(x.float())
    assert y32.dtype == torch.float32
    assert rel_err(y32.double(), y64) <= FLOAT32_TOL


def test_decode_float32_matches_float64(make_layer: LayerFactory, gen: torch.Generator) -> None:
    """A float32 decode run tracks the float64 forward within the float32 bound."""
    _, cfg, t, hidden = CASES[1]
    layer64 = make_layer(cfg, hidden)
    layer32 = copy.deepcopy(layer64).float()
    x = torch.randn(2, t, hidden, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        ref = layer64(x)
        y32, _ = decode_all(layer32, x.float(), NSACache.empty(cfg, 2), 0)
    assert rel_err(y32.double(), ref) <= FLOAT32_TOL
