"""Inputs and comparisons shared by the gated-combine kernel tests."""

from __future__ import annotations

import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
if INTERPRET:
    DEVICE: str | None = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    DEVICE = None
SKIP_REASON = "needs a CUDA GPU or the Triton interpreter (run with TRITON_INTERPRET=1)"

# docs/spec.md tolerances: relative error ||out - ref|| / ||ref||; gradients get twice these.
# float32 is held to the float64 bound; half precision to its bound against float32.
BOUND = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (1 as the denominator when ref is 0)."""
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    assert torch.isfinite(out64).all(), "non-finite values in the kernel output"
    denom = ref64.norm()
    return float((out64 - ref64).norm() / (denom if denom > 0 else 1.0))


def draw(
    gen: torch.Generator, shape: tuple[int, int, int, int], dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """o_cmp, o_slc, o_win [B, T, HQ, dv] ~ N(0, 1) and gates [B, T, HQ, 3] in (0, 1)."""
    branches = [torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for _ in range(3)]
    gates = torch.rand((*shape[:3], 3), generator=gen).to(device=device, dtype=dtype)
    return branches[0], branches[1], branches[2], gates


def leaves(*tensors: torch.Tensor, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Detached copies (in ``dtype`` if given) that require grad."""
    return [t.detach().to(dtype or t.dtype).requires_grad_() for t in tensors]
