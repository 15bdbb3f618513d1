"""Triton gated combine against the nsa_core reference, forward and gradients.

Runs on CPU under TRITON_INTERPRET=1 (CI) or on a CUDA GPU, on small shapes: float32 against
the reference in float64 (1e-5, gradients 2e-5), float16 and bfloat16 against the reference in
float32 on the same inputs (5e-3 and 1e-2, gradients twice that) (docs/spec.md, "Tolerances");
odd head dims, dv over one chunk, non-contiguous inputs, empty inputs; non-finite inputs give the
reference's NaN/Inf pattern exactly (docs/spec.md, "Non-finite values": every product is taken,
0 x NaN = NaN).
The combine multiplies in float32 without tl.dot, so the interpreter computes bfloat16 within
the bound too (its rounding to bfloat16 goes toward zero); the three-way sum, defined bit for bit,
refuses bfloat16 there (test_combine_gpu.py checks it on the GPU).
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch
from combine_testlib import draw, leaves
from kernel_testlib import BF16_ROUNDING_REFUSAL, BOUND, DEVICE, SKIP_REASON, refused_here, rel_err

pytestmark = [pytest.mark.triton, pytest.mark.skipif(DEVICE is None, reason=SKIP_REASON)]
pytest.importorskip("triton")

from nsa_core.reference.combine import gated_combine  # noqa: E402
from nsa_core.registry import OpContext  # noqa: E402
from nsa_core.toggles import Toggles  # noqa: E402
from nsa_kernels.combine.backends import triton_combine_supports  # noqa: E402
from nsa_kernels.combine.function import combine_bwd, gated_combine_triton, tiles  # noqa: E402
from nsa_kernels.common.row_runs import RowRuns  # noqa: E402

SHAPES = {
    "dense": (2, 9, 3, 16),
    "odd_dv": (1, 7, 5, 5),
    "two_chunks": (1, 3, 2, 200),
    "one_token": (1, 1, 4, 24),
}


def _gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def _grads(out: torch.Tensor, inputs: list[torch.Tensor], do: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(out, inputs, do.to(out.dtype)))


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
@pytest.mark.parametrize("name", list(SHAPES))
def test_matches_reference(name: str, dtype: torch.dtype, request: pytest.FixtureRequest) -> None:
    assert DEVICE is not None
    gen = _gen(request)
    inputs = draw(gen, SHAPES[name], dtype, DEVICE)
    do = torch.randn(SHAPES[name], generator=gen).to(DEVICE)
    ref_dtype = torch.float64 if dtype == torch.float32 else torch.float32
    got_in, ref_in = leaves(*inputs), leaves(*inputs, dtype=ref_dtype)
    out = gated_combine_triton(*got_in)
    ref = gated_combine(*ref_in)
    assert out.dtype == dtype
    assert out.shape == ref.shape
    assert out.is_contiguous()
    assert rel_err(out, ref) <= BOUND[dtype]
    got_grads, ref_grads = _grads(out, got_in, do), _grads(ref, ref_in, do)
    for name_, g, r in zip(("o_cmp", "o_sel", "o_win", "gates"), got_grads, ref_grads, strict=True):
        assert g.dtype == dtype, name_
        assert g.shape == r.shape, name_
        assert rel_err(g, r) <= 2 * BOUND[dtype], name_


def test_float32_matches_the_float32_reference_to_rounding(request: pytest.FixtureRequest) -> None:
    """Same dtype on both sides: the kernel rounds once, the reference after every step."""
    assert DEVICE is not None
    inputs = draw(_gen(request), (1, 6, 4, 32), torch.float32, DEVICE)
    torch.testing.assert_close(gated_combine_triton(*inputs), gated_combine(*inputs))


def test_strided_inputs(request: pytest.FixtureRequest) -> None:
    """Branch outputs, gates and the upstream gradient as views with other strides."""
    assert DEVICE is not None
    gen = _gen(request)
    batch, t, hq, dv = 2, 5, 3, 16
    # o_cmp as a transposed view ([B, HQ, T, dv] storage), o_sel a slice of a wider head dim,
    # o_win with a dv stride of 2, gates a slice of [B, T, HQ, 5].
    o_cmp = torch.randn(batch, hq, t, dv, generator=gen).to(DEVICE).transpose(1, 2)
    o_sel = torch.randn(batch, t, hq, dv + 8, generator=gen).to(DEVICE)[..., 4 : 4 + dv]
    o_win = torch.randn(batch, t, hq, 2 * dv, generator=gen).to(DEVICE)[..., ::2]
    gates = torch.rand(batch, t, hq, 5, generator=gen).to(DEVICE)[..., 1:4]
    do = torch.randn(batch, hq, t, dv, generator=gen).to(DEVICE).transpose(1, 2)
    got_in = [x.detach().requires_grad_() for x in (o_cmp, o_sel, o_win, gates)]
    ref_in = leaves(o_cmp, o_sel, o_win, gates, dtype=torch.float64)
    out, ref = gated_combine_triton(*got_in), gated_combine(*ref_in)
    assert rel_err(out, ref) <= BOUND[torch.float32]
    for g, r in zip(_grads(out, got_in, do), _grads(ref, ref_in, do), strict=True):
        assert rel_err(g, r) <= 2 * BOUND[torch.float32]


def test_only_some_inputs_need_grad(request: pytest.FixtureRequest) -> None:
    assert DEVICE is not None
    o_cmp, o_sel, o_win, gates = draw(_gen(request), (1, 4, 2, 8), torch.float32, DEVICE)
    g = gates.detach().requires_grad_()
    out = gated_combine_triton(o_cmp, o_sel, o_win, g)
    (dg,) = torch.autograd.grad(out.sum(), [g])
    torch.testing.assert_close(dg, torch.stack([o_cmp.sum(-1), o_sel.sum(-1), o_win.sum(-1)], -1))
    w = o_win.detach().requires_grad_()
    out = gated_combine_triton(o_cmp, o_sel, w, gates)
    (dw,) = torch.autograd.grad(out.sum(), [w])
    torch.testing.assert_close(dw, gates[..., 2:].expand_as(o_win).contiguous())


def test_a_second_derivative_through_the_kernel_raises(request: pytest.FixtureRequest) -> None:
    """The backward is a kernel with no graph of its own (once_differentiable): where the
    upstream gradient carries a graph (here d(out^2) = 2 out), a second derivative through the
    kernel raises rather than treating its output as a constant."""
    assert DEVICE is not None
    inputs = leaves(*draw(_gen(request), (1, 4, 2, 8), torch.float32, DEVICE))
    out = gated_combine_triton(*inputs)
    (d_cmp,) = torch.autograd.grad(out.square().sum(), inputs[:1], create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        d_cmp.sum().backward()


def test_empty_inputs() -> None:
    assert DEVICE is not None
    for shape in ((1, 0, 2, 8), (1, 3, 2, 0)):
        inputs = leaves(*draw(torch.Generator().manual_seed(0), shape, torch.float32, DEVICE))
        out = gated_combine_triton(*inputs)
        assert out.shape == shape
        grads = torch.autograd.grad(out.sum(), inputs, allow_unused=True)
        assert grads[3] is not None
        assert grads[3].shape == (*shape[:3], 3)
        assert not grads[3].any()


def _nonfinite_pattern(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.isnan(x), torch.isinf(x)


def test_nonfinite_values_follow_the_reference(request: pytest.FixtureRequest) -> None:
    """NaN and +-Inf in every input, some under a gate of exactly 0: the output and the four
    gradients hold NaN and Inf exactly where the reference's do, and agree elsewhere."""
    assert DEVICE is not None
    gen = _gen(request)
    shape = (1, 6, 3, 8)
    o_cmp, o_sel, o_win, gates = (x.cpu() for x in draw(gen, shape, torch.float32, "cpu"))
    o_cmp[0, 0, 0, 1] = float("nan")
    gates[0, 0, 0, 0] = 0.0  # 0 x NaN = NaN: the row stays NaN in that channel
    o_sel[0, 1, 2, 3] = float("inf")
    gates[0, 1, 2, 1] = 0.0  # 0 x Inf = NaN
    o_win[0, 2, 1, 0] = float("-inf")
    o_sel[0, 2, 1, 0] = float("inf")  # Inf - Inf = NaN
    o_cmp[0, 3, 0, 5] = float("inf")  # a plain Inf stays Inf
    gates[0, 4, 1, 2] = float("nan")  # a NaN gate poisons its whole row
    do = torch.randn(shape, generator=gen)
    do[0, 5, 2, 4] = float("nan")  # a NaN upstream gradient reaches the gradients only
    inputs = [x.to(DEVICE) for x in (o_cmp, o_sel, o_win, gates)]
    got_in, ref_in = leaves(*inputs), leaves(*inputs)
    out, ref = gated_combine_triton(*got_in), gated_combine(*ref_in)
    pairs = [(out, ref)]
    pairs += zip(
        _grads(out, got_in, do.to(DEVICE)), _grads(ref, ref_in, do.to(DEVICE)), strict=True
    )
    for got, want in pairs:
        got_nan, got_inf = _nonfinite_pattern(got)
        want_nan, want_inf = _nonfinite_pattern(want)
        assert want_nan.any()
        assert torch.equal(got_nan, want_nan)
        assert torch.equal(got_inf, want_inf)
        assert torch.equal(got[got_inf], want[want_inf])  # same signs
        finite = torch.isfinite(want)
        torch.testing.assert_close(got[finite], want[finite])


@pytest.mark.parametrize(
    ("start", "cuts"),
    [
        pytest.param(3, [6], id="blind_rows_then_two_runs"),
        pytest.param(2, [], id="one_run_after_blind_rows"),
        pytest.param(1, [3, 5], id="three_runs"),
    ],
)
def test_backward_reads_o_cmp_in_runs_where_they_lie(
    start: int, cuts: list[int], request: pytest.FixtureRequest
) -> None:
    """The backward kernel given o_cmp as runs of rows (zero rows first, each run in storage of
    its own, the last with other strides) gives the four gradients of the tensor they make up,
    bit for bit."""
    assert DEVICE is not None
    gen = _gen(request)
    o_cmp, o_sel, o_win, gates = draw(gen, (2, 9, 3, 16), torch.float32, DEVICE)
    o_cmp[:, :start] = 0
    do = torch.randn(o_cmp.shape, generator=gen).to(DEVICE)
    bounds = [start, *cuts, o_cmp.shape[1]]
    runs = [o_cmp[:, a:b].clone() for a, b in itertools.pairwise(bounds)]
    runs[-1] = runs[-1].transpose(1, 2).contiguous().transpose(1, 2)
    got = combine_bwd(do, RowRuns(start=start, runs=tuple(runs)), o_sel, o_win, gates)
    want = combine_bwd(do, o_cmp, o_sel, o_win, gates)
    for a, b in zip(got, want, strict=True):
        assert a is not None
        assert b is not None
        assert torch.equal(a, b)


def test_tiles_and_routing() -> None:
    """A program holds whole chunks of at most 128 channels; the backend serves CUDA only."""
    assert tiles(5) == (256, 16)
    assert tiles(128) == (32, 128)
    assert tiles(200) == (32, 128)
    ctx = OpContext(
        device=torch.device("cpu"), dtype=torch.float32, seq_len=8, num_q_heads=4,
        num_kv_heads=4, head_dim_qk=1024, head_dim_v=1024, requires_grad=True, varlen=False,
    )  # fmt: skip
    assert "CUDA" in (triton_combine_supports(ctx, Toggles()) or "")
    cuda = OpContext(**{**ctx.__dict__, "device": torch.device("cuda")})
    assert triton_combine_supports(cuda, Toggles()) is None
    f64 = OpContext(**{**cuda.__dict__, "dtype": torch.float64})
    assert "float64" in (triton_combine_supports(f64, Toggles()) or "")


def test_rejects_bad_arguments() -> None:
    assert DEVICE is not None
    inputs = draw(torch.Generator().manual_seed(0), (1, 4, 2, 8), torch.float32, DEVICE)
    with pytest.raises(TypeError, match="supports"):
        gated_combine_triton(*(x.double() for x in inputs))
    with pytest.raises(ValueError, match="gates"):
        gated_combine_triton(*inputs[:3], inputs[3][..., :2])
    with pytest.raises(TypeError, match="dtype"):
        gated_combine_triton(inputs[0], inputs[1].half(), *inputs[2:])


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
@pytest.mark.parametrize("numel", [1, 4096, 2 * 4096 + 37], ids=["one", "one_block", "ragged"])
def test_sum3_is_the_float32_sum_rounded_once(
    dtype: torch.dtype, numel: int, request: pytest.FixtureRequest
) -> None:
    """sum3_triton (the combine backend's fn_sum3): (a + b) + c in float32, one rounding to the
    dtype, bit for bit, over a last block that is partly masked; a non-contiguous input is read
    by value. Under the interpreter, whose bfloat16 rounding goes toward zero, bfloat16 is
    refused with the reason."""
    from nsa_kernels.combine.function import sum3_triton

    gen = _gen(request)
    a, b, c = (torch.randn(numel, 2, generator=gen).to(dtype).to(DEVICE) for _ in range(3))
    want = ((a.float() + b.float()) + c.float()).to(dtype)
    if refused_here(dtype):
        with pytest.raises(TypeError, match=BF16_ROUNDING_REFUSAL):
            sum3_triton(a, b, c)
        return
    assert torch.equal(sum3_triton(a, b, c), want)
    strided = torch.stack([c, c], dim=-1)[..., 0]
    assert not strided.is_contiguous()
    assert torch.equal(sum3_triton(a, b, strided), want)


def test_sum3_takes_one_shape_and_dtype() -> None:
    from nsa_kernels.combine.function import sum3_triton

    a = torch.zeros(4, 3, device=DEVICE)
    with pytest.raises(ValueError, match="one shape and dtype"):
        sum3_triton(a, a, torch.zeros(3, 4, device=DEVICE))
    with pytest.raises(TypeError, match=r"c dtype torch\.float16 differs from a dtype"):
        sum3_triton(a, a, a.half())
