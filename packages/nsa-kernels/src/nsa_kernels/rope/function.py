"""Rotary embedding on Triton: the launch and the autograd Function.

:func:`apply_rope_triton` has the reference op's signature and semantics
(``nsa_core.reference.apply_rope``, docs/spec.md "Rotary embedding"): x [B, T, H, D] turned by
the angles ``position * theta^(-2c/D)`` of its token, which come from the reference's own
``rope_angles`` (float32), so the results are bit-equal to the reference's, forward and
backward. One read of x and one write of the output per pass, where the reference's float32
intermediates cost it about ten.

Requirements beyond the reference: CUDA tensors (or CPU under ``TRITON_INTERPRET=1``), dtype
float16, bfloat16 or float32 (float64 runs the reference), not bfloat16 under the interpreter
(:data:`~nsa_kernels.common.triton_inputs.BF16_ROUNDING`). x may have any strides in
(B, T, H); one whose D stride is not 1 is copied first.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from nsa_core.checks import check_apply_rope
from nsa_core.reference.rope import rope_angles
from nsa_kernels.common.traced_launch import launch
from nsa_kernels.common.triton_inputs import BF16_ROUNDING, check_dtype, check_triton_runs
from nsa_kernels.rope.kernels import rope_kernel

# Elements of each half a program turns (BH heads x BD channels): the pass is bound by memory.
TILE_ELEMENTS = 2048
NUM_WARPS = 4


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def tiles(heads: int, half: int) -> tuple[int, int]:
    """(BH heads, BD channels) per program for H heads and D/2 = ``half`` channel pairs."""
    bd = _pow2(half)
    bh = min(_pow2(heads), max(1, TILE_ELEMENTS // bd))
    return bh, bd


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def rotate(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    inverse: bool,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [B, T, H, D] turned by cos, sin [B | 1, T, D/2] float32 (inverse: the other way).

    With ``positions`` (int32 [B, T], contiguous), cos and sin are tables [P, D/2] float32 with
    unit stride in D/2, and token (b, t) takes their row ``positions[b, t]`` (< P, unchecked).
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    batch, tokens, heads, dim = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    bh, bd = tiles(heads, dim // 2)
    launch(
        rope_kernel, (batch * tokens, _cdiv(heads, bh)),
        x, out, cos, sin,
        x.stride(0), x.stride(1), x.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        0 if positions is not None or cos.shape[0] == 1 else cos.stride(0),
        cos.stride(0) if positions is not None else cos.stride(1),
        cos if positions is None else positions,
        tokens, heads,
        HALF=dim // 2, BH=bh, BD=bd, INVERSE=inverse, TABLE=positions is not None,
        num_warps=NUM_WARPS, enable_fp_fusion=False, writes=(out,),
    )  # fmt: skip
    return out


class RopeFunction(torch.autograd.Function):
    """x -> x turned by (cos, sin); the gradient turns back (the rotation is orthogonal)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return rotate(x, cos, sin, inverse=False)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return rotate(grad, cos, sin, inverse=True), None, None


def apply_rope_triton(
    x: torch.Tensor, positions: torch.Tensor, theta: float, *, validated: bool = False
) -> torch.Tensor:
    """Rotate x [B, T, H, D] by the position of each token, positions [T] or [B | 1, T] (int).

    The reference's contract (``nsa_core.reference.apply_rope``), bit for bit; differentiable
    in x. ``validated``: nsa-core validated the call already (the registry's ``fn``); nothing
    is checked again.
    """
    if not validated:
        check_apply_rope(x, positions, theta)
        # The rotation is defined bit for bit: the interpreter's bfloat16 rounding breaks it.
        check_dtype(x.dtype, "rotary embedding", "x")
        check_triton_runs("x", x, BF16_ROUNDING)
    rows = positions if positions.dim() == 2 else positions.unsqueeze(0)
    cos, sin = rope_angles(rows, x.shape[-1], theta, x.dtype)
    out: torch.Tensor = RopeFunction.apply(x, cos.contiguous(), sin.contiguous())  # type: ignore[no-untyped-call]
    return out


__all__ = ["RopeFunction", "apply_rope_triton", "rotate", "tiles"]
