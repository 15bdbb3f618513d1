"""No future leakage: changing anything at positions > t changes no output at positions <= t.

Each check draws inputs, replaces every position after a cut t with fresh random values, and
requires the outputs (and selected indices) of rows 0 .. t to stay bit-identical. Cuts sit just
before and at the first complete compression block, at selection-block edges and mid-sequence.
"""

from __future__ import annotations

from collections.abc import Callable

import brute
import pytest
import torch
from geometry_lib import geometry

import nsa_core as nc

F64 = torch.float64
GEOMETRIES = [(32, 16, 64, 150), (8, 4, 8, 37), (4, 2, 8, 29), (4, 4, 4, 23)]  # (l, d, l', T)
DTYPES = [F64, torch.float32]


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=F64).to(dtype)


def cuts(l_cmp: int, l_sel: int, length: int) -> list[int]:
    return sorted({0, l_cmp - 2, l_cmp - 1, l_sel - 1, l_sel, length // 2, length - 2} - {-1})


def change_after(gen: torch.Generator, x: torch.Tensor, t: int) -> torch.Tensor:
    """x [B, T, ...] with every position > t redrawn."""
    y = x.clone()
    y[:, t + 1 :] = randn(gen, *y[:, t + 1 :].shape, dtype=x.dtype) * 3.0
    return y


def assert_rows_unchanged(a: torch.Tensor, b: torch.Tensor, t: int, what: str) -> None:
    assert torch.equal(a[:, : t + 1], b[:, : t + 1]), f"{what}: a row <= {t} changed"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("l_cmp", "d", "l_sel", "length"), GEOMETRIES)
@pytest.mark.parametrize("phi", ["avg", "mlp"])
def test_compressed_branch_and_selection_ignore_tokens_after_t(
    gen: torch.Generator, dtype: torch.dtype, l_cmp: int, d: int, l_sel: int, length: int, phi: str
) -> None:
    mlp_k = nc.CompressMLP(8, l_cmp).to(dtype) if phi == "mlp" else None
    mlp_v = nc.CompressMLP(6, l_cmp).to(dtype) if phi == "mlp" else None
    q, k, v = (
        randn(gen, 2, length, 4, 8, dtype=dtype),
        randn(gen, 2, length, 2, 8, dtype=dtype),
        randn(gen, 2, length, 2, 6, dtype=dtype),
    )

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            k_cmp, v_cmp = nc.compress(k, l_cmp, d, mlp_k), nc.compress(v, l_cmp, d, mlp_v)
            indices, counts = nc.select_blocks(q, k_cmp, l_cmp, d, l_sel, 3)
            return {
                "o_cmp": nc.compressed_attention(q, k_cmp, v_cmp, l_cmp, d),
                "scores": nc.block_scores(q, k_cmp, l_cmp, d, l_sel),
                "indices": indices,
                "counts": counts,
            }

    before = run(q, k, v)
    for t in cuts(l_cmp, l_sel, length):
        after = run(change_after(gen, q, t), change_after(gen, k, t), change_after(gen, v, t))
        for name in before:
            assert_rows_unchanged(before[name], after[name], t, name)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("l_cmp", "d", "l_sel", "length"), GEOMETRIES)
def test_selected_branch_reads_no_token_after_t_even_from_a_selected_future_block(
    gen: torch.Generator, dtype: torch.dtype, l_cmp: int, d: int, l_sel: int, length: int
) -> None:
    q, k, v = (
        randn(gen, 2, length, 4, 8, dtype=dtype),
        randn(gen, 2, length, 2, 8, dtype=dtype),
        randn(gen, 2, length, 2, 6, dtype=dtype),
    )
    # Every row lists every block, future ones included: only p <= t may be read.
    num_sel = brute.n_sel(length, l_sel)
    every_block = torch.arange(num_sel, dtype=torch.int32).expand(2, length, 2, num_sel)
    with torch.no_grad():
        before = nc.selected_attention(q, k, v, every_block, l_sel)
        for t in cuts(l_cmp, l_sel, length):
            after = nc.selected_attention(
                change_after(gen, q, t),
                change_after(gen, k, t),
                change_after(gen, v, t),
                every_block,
                l_sel,
            )
            assert_rows_unchanged(before, after, t, "o_sel")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("l_cmp", "d", "l_sel", "length"), GEOMETRIES)
@pytest.mark.parametrize("window", [1, 4, 512])
def test_sliding_branch_reads_no_token_after_t(
    gen: torch.Generator,
    dtype: torch.dtype,
    l_cmp: int,
    d: int,
    l_sel: int,
    length: int,
    window: int,
) -> None:
    q, k, v = (
        randn(gen, 2, length, 4, 8, dtype=dtype),
        randn(gen, 2, length, 2, 8, dtype=dtype),
        randn(gen, 2, length, 2, 6, dtype=dtype),
    )
    with torch.no_grad():
        before = nc.sliding_attention(q, k, v, window)
        for t in cuts(l_cmp, l_sel, length):
            after = nc.sliding_attention(
                change_after(gen, q, t), change_after(gen, k, t), change_after(gen, v, t), window
            )
            assert_rows_unchanged(before, after, t, "o_win")


def test_a_sequence_of_a_packed_batch_is_untouched_by_the_other_sequences(
    gen: torch.Generator,
) -> None:
    l_cmp, d, l_sel = 4, 2, 8
    cu = torch.tensor([0, 1, 1, 20, 29, 46], dtype=torch.int32)
    q, k, v = randn(gen, 1, 46, 4, 8), randn(gen, 1, 46, 2, 8), randn(gen, 1, 46, 2, 6)

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
        k_cmp = nc.compress(k, l_cmp, d, cu_seqlens=cu)
        v_cmp = nc.compress(v, l_cmp, d, cu_seqlens=cu)
        indices, _ = nc.select_blocks(q, k_cmp, l_cmp, d, l_sel, 3, cu_seqlens=cu)
        return [
            nc.compressed_attention(q, k_cmp, v_cmp, l_cmp, d, cu_seqlens=cu),
            indices,
            nc.selected_attention(q, k, v, indices, l_sel, cu_seqlens=cu),
            nc.sliding_attention(q, k, v, 6, cu_seqlens=cu),
        ]

    with torch.no_grad():
        before = run(q, k, v)
        # Redraw the sequence [20, 29): everything outside it must stay bit-identical.
        q2, k2, v2 = q.clone(), k.clone(), v.clone()
        for x in (q2, k2, v2):
            x[:, 20:29] = randn(gen, *x[:, 20:29].shape)
        after = run(q2, k2, v2)
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a[:, :20], b[:, :20])
        assert torch.equal(a[:, 29:], b[:, 29:])


LAYERS = {
    "l8d4s8": geometry(4, 2, 8, 6, 8, 4, 8, n=3, w=5),
    "l32d16s64": geometry(2, 1, 8, 8, 32, 16, 64, n=4, w=40),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("phi", ["avg", "mlp"])
def test_layer_output_at_t_ignores_inputs_after_t(
    gen: torch.Generator,
    make_layer: Callable[..., nc.NSAAttention],
    dtype: torch.dtype,
    name: str,
    phi: str,
) -> None:
    cfg = nc.NSAConfig(**LAYERS[name], phi=phi)  # type: ignore[arg-type]
    layer = make_layer(cfg, 12, dtype)
    length = 40 if name == "l8d4s8" else 200
    x = randn(gen, 2, length, 12, dtype=dtype)
    with torch.no_grad():
        before = layer(x)
        for t in cuts(cfg.cmp_block, cfg.sel_block, length):
            assert_rows_unchanged(before, layer(change_after(gen, x, t)), t, "layer output")


@pytest.mark.parametrize("phi", ["avg", "mlp"])
def test_layer_gradient_at_t_does_not_reach_inputs_after_t(
    gen: torch.Generator, make_layer: Callable[..., nc.NSAAttention], phi: str
) -> None:
    cfg = nc.NSAConfig(**LAYERS["l8d4s8"], phi=phi)  # type: ignore[arg-type]
    layer = make_layer(cfg, 12)
    x = randn(gen, 1, 30, 12).requires_grad_()
    for t in (3, 7, 16, 28):
        (grad,) = torch.autograd.grad(layer(x)[:, : t + 1].sum(), x)
        assert torch.count_nonzero(grad[:, t + 1 :]) == 0, t
        assert torch.count_nonzero(grad[:, : t + 1]) > 0, t
