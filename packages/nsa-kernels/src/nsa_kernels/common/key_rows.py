# Triton kernels take untyped pointer/scalar parameters (types come from the launch), and
# triton.jit is untyped without triton installed: mypy checks only the plain Python here.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Tiles of key rows of one kv head of k/v-shaped tensors [B, T, H, D], shared by the kernels.

A tile is BN rows (keys, blocks) by BD >= D columns; columns past D read 0 and are not stored.
"""

# No `from __future__ import annotations`: the triton 3.0/3.1 interpreter reads a string
# annotation as a runtime argument, so `B: tl.constexpr` would stop being a constant.
import triton
import triton.language as tl


@triton.jit
def load_key_rows(
    head,
    rows,
    stride_t,
    live,
    D: tl.constexpr,
    BD: tl.constexpr,
    MASK: tl.constexpr,
):
    """[BN, BD] of the rows ``rows`` [BN] (int64) below ``head`` (the kv head's row 0).

    MASK: rows where ``live`` [BN] is false read 0; without it every row is read, so the
    caller knows each of them exists.
    """
    offs = tl.arange(0, BD)
    ptrs = head + rows[:, None] * stride_t + offs[None, :]
    if MASK:
        tile = tl.load(ptrs, mask=live[:, None] & (offs < D)[None, :], other=0.0)
    else:
        tile = tl.load(ptrs, mask=(offs < D)[None, :], other=0.0)
    return tile


@triton.jit
def store_key_grads(
    dk_ptr, dv_ptr, dk, dv, b, h, krow, kvalid,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    DK: tl.constexpr, BK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """Store dk [BL, BK], dv [BL, BV] (float32) to the rows ``krow`` of dk [B, Tk, H, dk] and
    dv [B, Tk, H, dv] of kv head h, in their dtypes, where ``kvalid``."""
    offs_k = tl.arange(0, BK)
    offs_v = tl.arange(0, BV)
    tl.store(
        dk_ptr + b * stride_kb + krow[:, None] * stride_kt + h * stride_kh + offs_k[None, :],
        dk.to(dk_ptr.dtype.element_ty),
        mask=kvalid[:, None] & (offs_k < DK)[None, :],
    )
    tl.store(
        dv_ptr + b * stride_vb + krow[:, None] * stride_vt + h * stride_vh + offs_v[None, :],
        dv.to(dv_ptr.dtype.element_ty),
        mask=kvalid[:, None] & (offs_v < DV)[None, :],
    )
