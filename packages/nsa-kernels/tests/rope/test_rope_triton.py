"""Triton rotary embedding against the nsa_core reference: bit-equal, forward and gradient.

Runs on CPU under TRITON_INTERPRET=1 (CI) or on a CUDA GPU, on small shapes. The kernel turns
each channel pair by the reference's own float32 angles (``rope_angles``) with the reference's
roundings (no fused multiply-adds), so its output and its gradient equal the reference's bit for
bit in every dtype it takes (under the interpreter, which rounds float32 to bfloat16 toward zero,
it refuses bfloat16); the reference itself is checked against a float64 brute force
(nsa-core's test_ops_vs_brute.py). Shapes: positions [T], [1, T] and [B, T], far positions, D/2
not a power of two, many heads over several programs, strided x, empty x.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from kernel_testlib import BF16_ROUNDING_REFUSAL, DEVICE, SKIP_REASON, refused_here

pytestmark = [pytest.mark.triton, pytest.mark.skipif(DEVICE is None, reason=SKIP_REASON)]
pytest.importorskip("triton")

from nsa_core.reference.rope import apply_rope  # noqa: E402
from nsa_core.registry import OpContext  # noqa: E402
from nsa_core.toggles import Toggles  # noqa: E402
from nsa_kernels.rope.backends import triton_rope_supports  # noqa: E402
from nsa_kernels.rope.function import apply_rope_triton, tiles  # noqa: E402

THETA = 10000.0
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# (B, T, H, D), positions' layout, first position.
CASES = {
    "positions_T": ((2, 7, 3, 8), "T", 0),
    "positions_1T": ((2, 5, 4, 16), "1T", 3),
    "positions_BT": ((3, 4, 2, 6), "BT", 11),
    "far_positions": ((1, 3, 2, 32), "T", 131_000),
    "many_heads": ((1, 2, 80, 128), "T", 5),
    "head_dim_192": ((1, 2, 3, 192), "T", 0),
}


def _gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def _positions(
    layout: str, batch: int, tokens: int, first: int, gen: torch.Generator
) -> torch.Tensor:
    row = torch.arange(first, first + tokens)
    if layout == "T":
        return row
    if layout == "1T":
        return row.unsqueeze(0)
    # Per batch row, its own start: packed or shifted sequences.
    return row.unsqueeze(0) + torch.randint(0, 1000, (batch, 1), generator=gen)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(CASES))
def test_equals_reference_forward_and_gradient(
    name: str, dtype: str, request: pytest.FixtureRequest
) -> None:
    """Bit for bit; bfloat16 under the interpreter, which rounds float32 to bfloat16 toward zero
    (a GPU and torch round to nearest even), is refused with the reason (on a GPU it runs)."""
    assert DEVICE is not None
    gen = _gen(request)
    shape, layout, first = CASES[name]
    x = torch.randn(shape, generator=gen).to(device=DEVICE, dtype=DTYPES[dtype])
    pos = _positions(layout, shape[0], shape[1], first, gen).to(DEVICE)
    grad = torch.randn(shape, generator=gen).to(device=DEVICE, dtype=DTYPES[dtype])
    got_x, ref_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    if refused_here(DTYPES[dtype]):
        with pytest.raises(TypeError, match=BF16_ROUNDING_REFUSAL):
            apply_rope_triton(got_x, pos, THETA)
        return
    got = apply_rope_triton(got_x, pos, THETA)
    ref = apply_rope(ref_x, pos, THETA)
    assert got.dtype == x.dtype
    assert got.shape == x.shape
    assert torch.equal(got, ref)
    (got_grad,) = torch.autograd.grad(got, got_x, grad)
    (ref_grad,) = torch.autograd.grad(ref, ref_x, grad)
    assert got_grad.dtype == x.dtype
    assert torch.equal(got_grad, ref_grad)


def test_rotation_is_not_the_identity(request: pytest.FixtureRequest) -> None:
    """A kernel that copied x would fail here: position 0 keeps x, later ones move it."""
    assert DEVICE is not None
    x = torch.randn((1, 4, 2, 8), generator=_gen(request)).to(DEVICE)
    out = apply_rope_triton(x, torch.arange(4, device=DEVICE), THETA)
    assert torch.equal(out[:, 0], x[:, 0])
    assert not torch.allclose(out[:, 1:], x[:, 1:])
    # A rotation keeps the norm of every channel pair.
    half = x.shape[-1] // 2
    pair_norm = x[..., :half] ** 2 + x[..., half:] ** 2
    out_norm = out[..., :half] ** 2 + out[..., half:] ** 2
    assert torch.allclose(out_norm, pair_norm, rtol=1e-5, atol=1e-6)


def test_strided_x_equals_reference(request: pytest.FixtureRequest) -> None:
    """x as a transposed view (strides in B, T, H not those of a contiguous tensor)."""
    assert DEVICE is not None
    base = torch.randn((2, 3, 5, 16), generator=_gen(request)).to(DEVICE)  # [B, H, T, D]
    x = base.transpose(1, 2)
    pos = torch.arange(2, 7, device=DEVICE)
    assert torch.equal(apply_rope_triton(x, pos, THETA), apply_rope(x, pos, THETA))
    # D not unit-strided: copied first, same result.
    y = torch.randn((1, 3, 2, 16), generator=_gen(request)).to(DEVICE)
    y_strided = torch.empty((1, 3, 2, 32), device=DEVICE)[..., ::2]
    y_strided.copy_(y)
    assert torch.equal(apply_rope_triton(y_strided, pos[:3], THETA), apply_rope(y, pos[:3], THETA))


def test_empty_x() -> None:
    assert DEVICE is not None
    x = torch.empty((2, 0, 3, 8), device=DEVICE)
    assert (
        apply_rope_triton(x, torch.empty(0, dtype=torch.long, device=DEVICE), THETA).shape
        == x.shape
    )


def test_refuses_float64_and_checks_arguments() -> None:
    assert DEVICE is not None
    x = torch.randn((1, 2, 1, 4), dtype=torch.float64, device=DEVICE)
    with pytest.raises(TypeError, match="float64"):
        apply_rope_triton(x, torch.arange(2, device=DEVICE), THETA)
    with pytest.raises(ValueError, match="even"):
        apply_rope_triton(
            torch.randn((1, 2, 1, 5), device=DEVICE), torch.arange(2, device=DEVICE), THETA
        )
    with pytest.raises(TypeError, match="integers"):
        apply_rope_triton(
            torch.randn((1, 2, 1, 4), device=DEVICE), torch.arange(2.0, device=DEVICE), THETA
        )


def test_tiles_cover_the_heads_and_channels() -> None:
    for heads, half in ((1, 3), (4, 64), (64, 64), (80, 64), (3, 96)):
        bh, bd = tiles(heads, half)
        assert bd >= half
        assert bd & (bd - 1) == 0
        assert bh & (bh - 1) == 0
        assert 1 <= bh <= max(1, 2048 // bd)


def test_supports_declines_what_the_reference_serves() -> None:
    ctx = OpContext(
        device=torch.device("cpu"), dtype=torch.float32, seq_len=8, num_q_heads=4,
        num_kv_heads=4, head_dim_qk=8, head_dim_v=8, requires_grad=False, varlen=False,
    )  # fmt: skip
    assert triton_rope_supports(ctx, Toggles()) is not None
