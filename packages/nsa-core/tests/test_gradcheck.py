"""Gradients: float64 gradcheck of every op and of the layer, and no NaN where nothing is visible.

Shapes are tiny so that finite differences run in seconds. Every case includes rows that see no
compressed block (t < l - 1), and the selected-attention case includes padded, repeated and
future block indices and a row whose indices are all -1.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.autograd import gradcheck
from torch.func import functional_call

import nsa_core as nc

LayerFactory = Callable[..., nc.NSAAttention]

F64 = torch.float64


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=F64).to(dtype).requires_grad_()


# ---------------------------------------------------------------------------------------------
# gradcheck of each op


@pytest.mark.parametrize(("l_cmp", "d"), [(4, 2), (4, 4)])
def test_compressed_attention_gradients_match_finite_differences(
    gen: torch.Generator, l_cmp: int, d: int
) -> None:
    num = nc.num_cmp_blocks(13, l_cmp, d)
    q, k_cmp, v_cmp = randn(gen, 1, 13, 4, 3), randn(gen, 1, num, 2, 3), randn(gen, 1, num, 2, 2)
    assert gradcheck(lambda q, k, v: nc.compressed_attention(q, k, v, l_cmp, d), (q, k_cmp, v_cmp))


def test_compressed_attention_varlen_gradients_match_finite_differences(
    gen: torch.Generator,
) -> None:
    cu = torch.tensor([0, 1, 1, 9, 15], dtype=torch.int32)
    num = int(nc.cmp_cu_seqlens(cu, 4, 2)[-1])
    q, k_cmp, v_cmp = randn(gen, 1, 15, 2, 3), randn(gen, 1, num, 1, 3), randn(gen, 1, num, 1, 2)
    assert gradcheck(
        lambda q, k, v: nc.compressed_attention(q, k, v, 4, 2, cu_seqlens=cu), (q, k_cmp, v_cmp)
    )


def test_selected_attention_gradients_match_finite_differences(gen: torch.Generator) -> None:
    q, k, v = randn(gen, 2, 11, 4, 3), randn(gen, 2, 11, 2, 3), randn(gen, 2, 11, 2, 2)
    indices = torch.randint(-1, 3, (2, 11, 2, 3), generator=gen).to(torch.int32)
    indices[0, 5, 1] = -1  # nothing to attend to
    indices[1, 7, 0] = torch.tensor([2, 2, 0])  # repeated block
    assert gradcheck(lambda q, k, v: nc.selected_attention(q, k, v, indices, 4), (q, k, v))


def test_selected_attention_decode_row_gradients_match_finite_differences(
    gen: torch.Generator,
) -> None:
    q, k, v = randn(gen, 1, 1, 2, 3), randn(gen, 1, 17, 1, 3), randn(gen, 1, 17, 1, 2)
    indices = torch.tensor([[[[0, 3, 4]]]], dtype=torch.int32)
    assert gradcheck(
        lambda q, k, v: nc.selected_attention(q, k, v, indices, 4, q_start=16), (q, k, v)
    )


@pytest.mark.parametrize("window", [1, 3, 64])
def test_sliding_attention_gradients_match_finite_differences(
    gen: torch.Generator, window: int
) -> None:
    q, k, v = randn(gen, 1, 10, 3, 3), randn(gen, 1, 10, 1, 3), randn(gen, 1, 10, 1, 4)
    assert gradcheck(lambda q, k, v: nc.sliding_attention(q, k, v, window), (q, k, v))


def test_sliding_attention_varlen_gradients_match_finite_differences(gen: torch.Generator) -> None:
    cu = torch.tensor([0, 3, 3, 4, 12], dtype=torch.int32)
    q, k, v = randn(gen, 1, 12, 2, 3), randn(gen, 1, 12, 2, 3), randn(gen, 1, 12, 2, 2)
    assert gradcheck(lambda q, k, v: nc.sliding_attention(q, k, v, 3, cu_seqlens=cu), (q, k, v))


def test_gated_combine_gradients_match_finite_differences(gen: torch.Generator) -> None:
    o = [randn(gen, 1, 5, 2, 3) for _ in range(3)]
    gates = torch.rand(1, 5, 2, 3, generator=gen, dtype=F64).requires_grad_()
    assert gradcheck(nc.gated_combine, (*o, gates))


@pytest.mark.parametrize("varlen", [False, True])
def test_compress_avg_gradients_match_finite_differences(
    gen: torch.Generator, varlen: bool
) -> None:
    cu = torch.tensor([0, 5, 5, 14], dtype=torch.int32) if varlen else None
    x = randn(gen, 1, 14, 2, 3)
    assert gradcheck(lambda x: nc.compress(x, 4, 2, cu_seqlens=cu), (x,))


@pytest.mark.parametrize(
    ("tokens", "cmp_block", "cmp_stride"),
    [(13, 4, 4), (17, 6, 2), (5, 8, 2), (20, 6, 3)],
    ids=["l_eq_d", "l_3d", "no_block", "l_2d_tail"],
)
def test_compress_avg_backward_matches_autograd_of_the_window_mean(
    gen: torch.Generator, tokens: int, cmp_block: int, cmp_stride: int
) -> None:
    """compress's written-out backward (WindowMean) against finite differences and against
    autograd through the mean of the unfolded windows, for l = d, l = 3d, T < l and tokens past
    the last window."""
    x = randn(gen, 2, tokens, 2, 3)
    assert gradcheck(lambda x: nc.compress(x, cmp_block, cmp_stride), (x,))
    out = nc.compress(x, cmp_block, cmp_stride)
    g = torch.randn(out.shape, generator=gen, dtype=F64)
    (written,) = torch.autograd.grad(out, x, g)
    blocks = nc.split_blocks(x, cmp_block, cmp_stride)
    (autograd,) = torch.autograd.grad(nc.compress_avg(blocks), x, g)
    torch.testing.assert_close(written, autograd, rtol=1e-12, atol=1e-12)


def test_compress_mlp_gradients_reach_blocks_and_every_parameter(gen: torch.Generator) -> None:
    mlp = nc.CompressMLP(3, 4).double()
    names = [name for name, _ in mlp.named_parameters()]
    params = [randn(gen, *p.shape) for p in mlp.parameters()]
    x = randn(gen, 1, 10, 2, 3)

    def run(x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        blocks = nc.split_blocks(x, 4, 2)
        out: torch.Tensor = functional_call(mlp, dict(zip(names, params, strict=True)), (blocks,))
        return out

    assert gradcheck(run, (x, *params))


def test_rope_gradients_match_finite_differences(gen: torch.Generator) -> None:
    x = randn(gen, 2, 5, 2, 6)
    assert gradcheck(lambda x: nc.apply_rope(x, torch.arange(5) + 7, 10000.0), (x,))


# ---------------------------------------------------------------------------------------------
# gradcheck of the layer


TINY = dict(
    num_q_heads=2,
    num_kv_heads=1,
    head_dim_qk=4,
    head_dim_v=2,
    cmp_block=4,
    cmp_stride=2,
    sel_block=4,
    num_selected=3,
    window=3,
)


@pytest.mark.parametrize("phi", ["avg", "mlp"])
@pytest.mark.parametrize("varlen", [False, True])
def test_layer_gradients_reach_x_and_every_parameter(
    gen: torch.Generator, make_layer: LayerFactory, phi: str, varlen: bool
) -> None:
    layer = make_layer(nc.NSAConfig(**TINY, phi=phi), 4)  # type: ignore[arg-type]
    cu = torch.tensor([0, 6, 6, 17], dtype=torch.int32) if varlen else None
    names = [name for name, _ in layer.named_parameters()]
    params = [p.detach().clone().requires_grad_() for p in layer.parameters()]
    x = randn(gen, 1, 17, 4)

    def run(x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        weights = dict(zip(names, params, strict=True))
        out: torch.Tensor = functional_call(layer, weights, (x,), {"cu_seqlens": cu})
        return out

    assert gradcheck(run, (x, *params), fast_mode=True)
    # Every parameter, including both phi MLPs and the gate MLP, gets a nonzero gradient.
    grads = torch.autograd.grad(run(x, *params).square().sum(), params)
    for name, grad in zip(names, grads, strict=True):
        assert torch.count_nonzero(grad) > 0, name


# ---------------------------------------------------------------------------------------------
# Rows with nothing visible: 0, never NaN, in values and gradients


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_compressed_branch_before_the_first_block_gives_zero_and_zero_gradient(
    gen: torch.Generator, dtype: torch.dtype
) -> None:
    l_cmp, d = 8, 4
    for length in (
        1,
        l_cmp - 1,
        3 * l_cmp,
    ):  # T < l: no block at all; T >= l: rows t < l - 1 see none
        q = randn(gen, 2, length, 4, 3, dtype=dtype)
        k_raw, v_raw = (
            randn(gen, 2, length, 2, 3, dtype=dtype),
            randn(gen, 2, length, 2, 5, dtype=dtype),
        )
        o = nc.compressed_attention(
            q, nc.compress(k_raw, l_cmp, d), nc.compress(v_raw, l_cmp, d), l_cmp, d
        )
        blind = slice(0, min(length, l_cmp - 1))
        assert torch.isfinite(o).all(), length
        assert torch.equal(o[:, blind], torch.zeros_like(o[:, blind])), length
        # With no block at all the output may be cut off from the graph: no gradient path at all.
        if o.requires_grad:
            o.square().sum().backward()  # type: ignore[no-untyped-call]
        for x in (q, k_raw, v_raw):
            grad = torch.zeros_like(x) if x.grad is None else x.grad
            assert torch.isfinite(grad).all(), length
            if x is q:
                assert torch.count_nonzero(grad[:, blind]) == 0, length


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_selected_branch_with_only_padding_gives_zero_and_zero_gradient(
    gen: torch.Generator, dtype: torch.dtype
) -> None:
    q, k, v = (
        randn(gen, 2, 9, 4, 3, dtype=dtype),
        randn(gen, 2, 9, 2, 3, dtype=dtype),
        randn(gen, 2, 9, 2, 5, dtype=dtype),
    )
    indices = torch.full((2, 9, 2, 3), -1, dtype=torch.int32)
    o = nc.selected_attention(q, k, v, indices, 4)
    assert torch.equal(o, torch.zeros_like(o))
    o.square().sum().backward()  # type: ignore[no-untyped-call]
    for x in (q, k, v):
        assert x.grad is not None
        assert torch.equal(x.grad, torch.zeros_like(x.grad))


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("phi", ["avg", "mlp"])
@pytest.mark.parametrize("length", [1, 3])
def test_layer_shorter_than_a_compression_block_has_finite_values_and_gradients(
    gen: torch.Generator, make_layer: LayerFactory, dtype: torch.dtype, phi: str, length: int
) -> None:
    layer = make_layer(nc.NSAConfig(**TINY, phi=phi), 4, dtype)  # type: ignore[arg-type]
    x = randn(gen, 2, length, 4, dtype=dtype)
    y = layer(x)
    assert torch.isfinite(y).all()
    y.square().sum().backward()
    assert x.grad is not None
    assert torch.isfinite(x.grad).all()
    for name, p in layer.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), name
