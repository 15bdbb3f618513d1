"""What the kernels' bfloat16 refusals under ``TRITON_INTERPRET=1`` rest on, measured.

The refusals (nsa_kernels.common.triton_inputs: BF16_DOT, BF16_ROUNDING) hold only while
Triton's interpreter computes bfloat16 wrongly, so these tests run the kernels' own launches in
bfloat16, past the entry points that refuse it: under the interpreter they must still come back
wrong (should a triton fix it, they fail, and the refusal can go); compiled on a GPU, the same
launches must be right. Each test thus checks something on both kinds of host.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from kernel_testlib import BOUND, DEVICE, INTERPRET, SKIP_REASON, rel_err

pytestmark = [pytest.mark.triton, pytest.mark.skipif(DEVICE is None, reason=SKIP_REASON)]
pytest.importorskip("triton")

from nsa_core.reference.rope import apply_rope, rope_angles  # noqa: E402
from nsa_kernels.rope.function import rotate  # noqa: E402
from nsa_kernels.selected.quick import _launch as quick_launch  # noqa: E402


def _gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def test_bfloat16_dots(request: pytest.FixtureRequest) -> None:
    """The quick selection launch (two tl.dot per key tile) in bfloat16 against a float64 softmax
    of the same rounded inputs: within the bfloat16 bound compiled; in the interpreter, which
    multiplies bfloat16 operands as their 16-bit integers, off by orders of magnitude (about 1e9
    with triton 3.7.1)."""
    assert DEVICE is not None
    gen = _gen(request)
    shapes = ((4, 2, 16), (4, 40, 16), (4, 40, 16))
    q, k, v = (torch.randn(*shape, generator=gen).bfloat16() for shape in shapes)
    got = quick_launch(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), None, None, 16)
    scores = torch.einsum("nhd,nld->nhl", q.double(), k.double()) * 16**-0.5
    want = torch.einsum("nhl,nld->nhd", scores.softmax(-1), v.double())
    err = float((got.double().cpu() - want).norm() / want.norm())
    if INTERPRET:
        assert not err <= 1.0, f"the interpreter's bfloat16 tl.dot came back right ({err:.3g})"
    else:
        assert err < BOUND[torch.bfloat16]


def test_bfloat16_rounding(request: pytest.FixtureRequest) -> None:
    """The rotary launch in bfloat16 against the reference (the same float32 products and sums,
    rounded once to bfloat16 by torch, to nearest even): equal bit for bit compiled; in the
    interpreter, which truncates, every element that differs lies one step toward zero."""
    assert DEVICE is not None
    x = torch.randn(2, 24, 3, 16, generator=_gen(request)).bfloat16()
    positions = torch.arange(24).unsqueeze(0) + 100
    cos, sin = rope_angles(positions, 16, 10000.0, torch.bfloat16)
    got = rotate(x.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), inverse=False).cpu()
    want = apply_rope(x, positions, 10000.0)
    if not INTERPRET:
        assert torch.equal(got, want)
        return
    differs = got != want
    assert differs.any(), "the interpreter's float32 to bfloat16 rounding matched torch's"
    # One step toward zero: the magnitude's bit pattern one below the nearest-even one.
    steps = magnitude(want[differs]) - magnitude(got[differs])
    assert bool((steps == 1).all()), steps.unique().tolist()
    assert rel_err(got, want) < BOUND[torch.bfloat16]


def magnitude(x: torch.Tensor) -> torch.Tensor:
    """The bit pattern of |x| for bfloat16 x (the sign bit cleared), as int32."""
    return x.view(torch.int16).to(torch.int32) & 0x7FFF
