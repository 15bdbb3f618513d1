"""The whole NSAAttention layer against the brute force built from its parameters (tests/brute.py).

The brute force reads q_proj, k_proj[c], v_proj[c] (c in cmp, sel, win), the gate MLP, phi_k/phi_v
and o_proj from the module, rotates q and every key by its position, and runs the three branches
token by token in float64. A float32 layer may choose other blocks where two scores are within
rounding of each other (top-n is discontinuous); the float32 cases check that the inputs have no
such near-tie, so that the comparison is of the same choice.
"""

from __future__ import annotations

from collections.abc import Callable

import brute
import pytest
import torch
from geometry_lib import geometry

import nsa_core as nc

LayerFactory = Callable[..., nc.NSAAttention]

F64 = torch.float64


# name -> (config fields, hidden size)
CONFIGS: dict[str, tuple[dict[str, int], int]] = {
    "G2-dk!=dv-l8d4s8": (geometry(4, 2, 8, 6, 8, 4, 8, n=3, w=8), 16),
    "G3-l4d2s8": (geometry(3, 1, 8, 4, 4, 2, 8, n=4, w=5), 12),
    "G1-l=s=d=4": (geometry(2, 2, 4, 6, 4, 4, 4, n=3, w=6), 8),
    "G4-l8d4s8": (geometry(4, 1, 6, 6, 8, 4, 8, n=5, w=3), 12),
    "G16-l8d4s8": (geometry(16, 1, 4, 2, 8, 4, 8, n=3, w=4), 16),
}
PAPER = (geometry(2, 1, 16, 8, 32, 16, 64, n=4, w=64), 16)  # l=32, d=16, l'=64
DTYPES = [F64, torch.float32]
VARLEN_CUTS = [[0, 1, 1, 20, 29, 46], [0, 0, 13, 14, 30]]


def make_config(fields: dict[str, int], phi: str) -> nc.NSAConfig:
    return nc.NSAConfig(**fields, phi=phi)  # type: ignore[arg-type]


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=F64).to(dtype)


def assert_no_near_tie(layer: nc.NSAAttention, x: torch.Tensor, dtype: torch.dtype) -> None:
    """In float32, the choice is comparable only where the brute-force margin exceeds rounding."""
    if dtype == F64:
        return
    for b in range(x.shape[0]):
        margin = brute.layer_selection_margin(layer, brute._f64(x[b]))
        assert margin > 1e-5, f"inputs have a near-tie (margin {margin:.2e}); pick other inputs"


def check_layer_forward(
    gen: torch.Generator,
    make_layer: LayerFactory,
    case: tuple[dict[str, int], int],
    phi: str,
    dtype: torch.dtype,
    *,
    batch: int,
    length: int,
) -> None:
    """The layer of ``case`` (config fields, hidden size) on x [batch, length, hidden] equals the
    brute force built from its parameters."""
    fields, hidden = case
    layer = make_layer(make_config(fields, phi), hidden, dtype)
    x = randn(gen, batch, length, hidden, dtype=dtype)
    assert_no_near_tie(layer, x, dtype)
    with torch.no_grad():
        got = layer(x)
    brute.assert_matches(got, brute.nsa_forward(layer, x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("phi", ["avg", "mlp"])
@pytest.mark.parametrize("length", [1, 5, 37])
def test_layer_forward_equals_brute_force_from_its_parameters(
    gen: torch.Generator,
    make_layer: LayerFactory,
    dtype: torch.dtype,
    name: str,
    phi: str,
    length: int,
) -> None:
    check_layer_forward(gen, make_layer, CONFIGS[name], phi, dtype, batch=2, length=length)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("phi", ["avg", "mlp"])
@pytest.mark.parametrize("length", [31, 150, 300])
def test_layer_forward_in_the_paper_block_geometry(
    gen: torch.Generator, make_layer: LayerFactory, dtype: torch.dtype, phi: str, length: int
) -> None:
    check_layer_forward(gen, make_layer, PAPER, phi, dtype, batch=1, length=length)


@pytest.mark.parametrize("name", list(CONFIGS)[:3])
@pytest.mark.parametrize("phi", ["avg", "mlp"])
def test_branch_inputs_are_projected_rotated_keys_plain_values_and_sigmoid_gates(
    gen: torch.Generator, make_layer: LayerFactory, name: str, phi: str
) -> None:
    fields, hidden = CONFIGS[name]
    layer = make_layer(make_config(fields, phi), hidden)
    x = randn(gen, 2, 11, hidden)
    with torch.no_grad():
        got = layer.branch_inputs(x, torch.arange(11))
    for b in range(2):
        ref = brute.layer_inputs(layer, x[b])
        brute.assert_matches(got.q[b], ref["q"], F64, "q")
        brute.assert_matches(got.gates[b], ref["gates"], F64, "gates")
        for c in brute.BRANCHES:
            brute.assert_matches(got.k[c][b], ref[f"k_{c}"], F64, f"k[{c}]")
            brute.assert_matches(got.v[c][b], ref[f"v_{c}"], F64, f"v[{c}]")


@pytest.mark.parametrize("phi", ["avg", "mlp"])
def test_compress_kv_applies_separate_phi_to_keys_and_values(
    gen: torch.Generator, make_layer: LayerFactory, phi: str
) -> None:
    fields, hidden = CONFIGS["G2-dk!=dv-l8d4s8"]
    layer = make_layer(make_config(fields, phi), hidden)
    k_raw, v_raw = randn(gen, 2, 30, 2, 8), randn(gen, 2, 30, 2, 6)
    with torch.no_grad():
        k_cmp, v_cmp = layer.compress_kv(k_raw, v_raw)
    phi_k, phi_v = brute.layer_phis(layer)
    brute.assert_matches(k_cmp, brute.compress(k_raw, 8, 4, phi_k), F64, "k_cmp")
    brute.assert_matches(v_cmp, brute.compress(v_raw, 8, 4, phi_v), F64, "v_cmp")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["G2-dk!=dv-l8d4s8", "G3-l4d2s8"])
@pytest.mark.parametrize("phi", ["avg", "mlp"])
@pytest.mark.parametrize("cuts", VARLEN_CUTS)
def test_layer_varlen_runs_each_sequence_from_position_zero(
    gen: torch.Generator,
    make_layer: LayerFactory,
    dtype: torch.dtype,
    name: str,
    phi: str,
    cuts: list[int],
) -> None:
    fields, hidden = CONFIGS[name]
    layer = make_layer(make_config(fields, phi), hidden, dtype)
    cu = torch.tensor(cuts, dtype=torch.int32)
    x = randn(gen, 1, cuts[-1], hidden, dtype=dtype)
    for s in range(len(cuts) - 1):
        assert_no_near_tie(layer, x[:, cuts[s] : cuts[s + 1]], dtype)
    with torch.no_grad():
        got = layer(x, cu_seqlens=cu)
    brute.assert_matches(got, brute.nsa_forward(layer, x, cu_seqlens=cu), dtype)


@pytest.mark.parametrize("phi", ["avg", "mlp"])
@pytest.mark.parametrize("cuts", [*VARLEN_CUTS, [0, 1, 150, 151, 233]])
def test_layer_varlen_equals_running_each_sequence_separately(
    gen: torch.Generator, make_layer: LayerFactory, phi: str, cuts: list[int]
) -> None:
    fields, hidden = PAPER if cuts[-1] > 100 else CONFIGS["G2-dk!=dv-l8d4s8"]
    layer = make_layer(make_config(fields, phi), hidden)
    cu = torch.tensor(cuts, dtype=torch.int32)
    x = randn(gen, 1, cuts[-1], hidden)
    with torch.no_grad():
        packed = layer(x, cu_seqlens=cu)
        for s in range(len(cuts) - 1):
            start, end = cuts[s], cuts[s + 1]
            if end > start:
                alone = layer(x[:, start:end])
                err = brute.rel_err(packed[:, start:end], alone)
                assert err <= 1e-10, f"sequence {s}: relative error {err:.3e}"
