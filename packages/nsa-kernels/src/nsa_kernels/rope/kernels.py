# Triton kernels take untyped pointer/scalar parameters (types come from the launch), and
# triton.jit is untyped without triton installed: mypy checks only the plain Python here.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""The rotary-embedding kernel: each channel pair (c, c + D/2) of a row turned by its angle.

Forward, for the row's cos c and sin s (float32, from ``nsa_core.reference.rope_angles``):
``(x1 c - x2 s, x2 c + x1 s)``; backward (INVERSE), the transpose: ``(g1 c + g2 s, g2 c - g1 s)``,
the same code with s negated (negation is exact). Arithmetic in float32, one rounding to the
output's dtype; launched without fused multiply-adds so that every product rounds as the
reference's does (bit-equal results, forward and backward).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _head_channels(ptr, b, t, h, c, stride_b, stride_t, stride_h):
    """Pointers [BH, BD] to channels c [BD] of heads h [BH] of token (b, t) in a [B, T, H, D]
    tensor of these strides (unit stride in D); int64 offsets, as a large tensor needs."""
    return (
        ptr
        + b.to(tl.int64) * stride_b
        + t.to(tl.int64) * stride_t
        + h.to(tl.int64)[:, None] * stride_h
        + c[None, :]
    )


@triton.jit
def rope_kernel(
    x_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    stride_xb,
    stride_xt,
    stride_xh,
    stride_ob,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ct,
    pos_ptr,
    tokens,
    heads,
    HALF: tl.constexpr,
    BH: tl.constexpr,
    BD: tl.constexpr,
    INVERSE: tl.constexpr,
    TABLE: tl.constexpr,
):
    """out [BH heads, D] of one token (b, t) = x rotated by the token's angles.

    x, out [B, T, H, D] with unit stride in D; cos, sin [B | 1, T, D/2] float32 with unit stride
    in D/2 (stride_cb = 0: one row of angles for every batch row). With TABLE, cos and sin are
    tables [P, D/2] (row stride stride_ct) and token (b, t) takes row ``pos[b * T + t]`` (pos
    int32 [B, T], contiguous). Grid: (B * T, cdiv(H, BH)).
    """
    row = tl.program_id(0)
    b = row // tokens
    t = row - b * tokens
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    c = tl.arange(0, BD)
    c_ok = c < HALF
    ok = (h < heads)[:, None] & c_ok[None, :]
    if TABLE:
        angle_at = tl.load(pos_ptr + row).to(tl.int64) * stride_ct + c
    else:
        angle_at = b.to(tl.int64) * stride_cb + t.to(tl.int64) * stride_ct + c
    cos = tl.load(cos_ptr + angle_at, mask=c_ok, other=0.0)[None, :]
    sin = tl.load(sin_ptr + angle_at, mask=c_ok, other=0.0)[None, :]
    if INVERSE:
        sin = -sin
    x_at = _head_channels(x_ptr, b, t, h, c, stride_xb, stride_xt, stride_xh)
    x1 = tl.load(x_at, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_at + HALF, mask=ok, other=0.0).to(tl.float32)
    out1 = x1 * cos - x2 * sin
    out2 = x2 * cos + x1 * sin
    out_at = _head_channels(out_ptr, b, t, h, c, stride_ob, stride_ot, stride_oh)
    tl.store(out_at, out1.to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(out_at + HALF, out2.to(out_ptr.dtype.element_ty), mask=ok)
