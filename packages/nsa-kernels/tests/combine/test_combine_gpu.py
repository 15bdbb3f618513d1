"""GPU parity of the Triton gated combine at the paper's shapes, and its routing.

Bounds from docs/spec.md: bfloat16 against the reference in float32 on the same inputs, 1e-2,
gradients twice that. Shape: B=1, T=4096, HQ=64, dv=128 (the attention core's combine).
"""

from __future__ import annotations

import pytest
import torch
from combine_testlib import draw, leaves
from kernel_testlib import BOUND, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.triton]
pytest.importorskip("triton")

import nsa_core  # noqa: E402
from nsa_core.reference.combine import gated_combine  # noqa: E402
from nsa_core.registry import register_backend, resolve  # noqa: E402
from nsa_core.toggles import get_toggles  # noqa: E402
from nsa_kernels.combine.function import gated_combine_triton  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_paper_shape(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(12)
    shape = (1, 4096, 64, 128)
    inputs = draw(gen, shape, dtype, "cuda")
    do = torch.randn(shape, generator=gen).to("cuda", dtype)
    got_in, ref_in = leaves(*inputs), leaves(*inputs, dtype=torch.float32)
    out, ref = gated_combine_triton(*got_in), gated_combine(*ref_in)
    assert rel_err(out, ref) <= BOUND[dtype]
    got_grads = torch.autograd.grad(out, got_in, do)
    ref_grads = torch.autograd.grad(ref, ref_in, do.float())
    for name, g, r in zip(("o_cmp", "o_sel", "o_win", "gates"), got_grads, ref_grads, strict=True):
        err = rel_err(g, r)
        print(f"\n{dtype} d{name}: rel err {err:.2e}")
        assert err <= 2 * BOUND[dtype], name


@pytest.fixture
def kernels_registered() -> None:
    """As an install's entry point would (a GPU host may run the checkout from PYTHONPATH)."""
    from nsa_kernels.registration import register

    register(register_backend)


@pytest.mark.usefixtures("kernels_registered")
def test_public_op_routes_to_triton_on_cuda() -> None:
    if get_toggles().combine_backend != "auto":
        pytest.skip(f"NSA_COMBINE_BACKEND={get_toggles().combine_backend} pins the backend")
    inputs = draw(torch.Generator().manual_seed(3), (1, 64, 8, 128), torch.bfloat16, "cuda")
    ctx = nsa_core.ops.op_context(inputs[0], inputs[0], inputs[0], 64, varlen=False)
    assert resolve("gated_combine", ctx).backend.name == "triton_combine"
    torch.testing.assert_close(
        nsa_core.gated_combine(*inputs), gated_combine_triton(*inputs), rtol=0, atol=0
    )


def test_sum3_in_bfloat16_is_the_float32_sum_rounded_once() -> None:
    from nsa_kernels.combine.function import sum3_triton

    gen = torch.Generator(device="cuda").manual_seed(4)
    a, b, c = (
        torch.randn(1, 4096 + 3, 64, 128, device="cuda", generator=gen).to(torch.bfloat16)
        for _ in range(3)
    )
    assert torch.equal(sum3_triton(a, b, c), ((a.float() + b.float()) + c.float()).bfloat16())
