# Triton kernels take untyped pointer/scalar parameters (types come from the launch), and
# triton.jit is untyped without triton installed: mypy checks only the plain Python here.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Quick-sanity entry points of the Triton selection kernel: plain attention over given keys.

Each row n owns a set of keys and its H query heads attend to all of them in one softmax, with
no causal mask: ``sel_attn_fwd_dense`` gives every row its own L keys, ``sel_attn_fwd_varlen``
gives row n the packed range ``K[cu[n]:cu[n+1]]`` (an empty range gives 0). One kernel,
``quick_fwd_kernel``, serves both.
"""

# No `from __future__ import annotations`: the triton 3.0/3.1 interpreter reads a string
# annotation as a runtime argument, so `B: tl.constexpr` would stop being a constant.
import torch
import triton
import triton.language as tl
from torch import Tensor

from nsa_core.checks import check_cu_seqlens, check_int, check_rank, check_same_place, check_scale
from nsa_kernels.common.online_softmax import online_softmax_step
from nsa_kernels.common.tile_config import pow2
from nsa_kernels.common.triton_inputs import check_dtype, check_head_dims, check_triton_runs
from nsa_kernels.selected.row_walk import LOG2E


def _tile(x: int) -> int:
    """A tl.dot extent for x: the next power of two, at least 16."""
    return max(16, pow2(x))


def _check(
    q: Tensor, k: Tensor, v: Tensor, scale: object, block_l: object, *, varlen: bool
) -> None:
    """q [N, H, D]; k [N, L, D] and v [N, L, Dv] (dense) or k [TotalL, D] and v [TotalL, Dv]
    (varlen); H, D, Dv >= 1 with D, Dv <= 256; one dtype Triton runs, one device; scale None or
    a finite float > 0; block_l a power of two >= 16 (a tl.dot extent)."""
    check_rank("q", q, 3, "[N, H, D]")
    k_layout, v_layout = ("[TotalL, D]", "[TotalL, Dv]") if varlen else ("[N, L, D]", "[N, L, Dv]")
    check_rank("k", k, 2 if varlen else 3, k_layout)
    check_rank("v", v, 2 if varlen else 3, v_layout)
    for what, size, name, t in (("heads H", q.shape[1], "q", q), ("head dim D", q.shape[2], "q", q),
                                ("head dim Dv", v.shape[-1], "v", v)):  # fmt: skip
        if size < 1:
            raise ValueError(f"{what} must be >= 1, got {size} ({name} {list(t.shape)})")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k's head dim {k.shape[-1]} differs from q's {q.shape[-1]}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k {list(k.shape)} and v {list(v.shape)} differ in keys")
    if not varlen and k.shape[0] != q.shape[0]:
        raise ValueError(f"k has {k.shape[0]} rows, q has {q.shape[0]}")
    check_same_place("k", k, "q", q)
    check_same_place("v", v, "q", q)
    check_dtype(q.dtype, "selection (quick)")
    check_head_dims(q.shape[2], v.shape[-1])
    check_scale(scale)
    tile = check_int("block_l", block_l, 16)
    if tile & (tile - 1):
        raise ValueError(f"block_l must be a power of two >= 16, got {tile}")


@triton.jit
def quick_fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    cu_ptr,
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kl,
    stride_vn,
    stride_vl,
    stride_on,
    stride_oh,
    num_keys,
    qk_scale,
    H: tl.constexpr,
    BH: tl.constexpr,
    D: tl.constexpr,
    BD: tl.constexpr,
    DV: tl.constexpr,
    BDV: tl.constexpr,
    BL: tl.constexpr,
    VARLEN: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """o [H, DV] of row n: its H heads attend, unmasked, to the keys of row n's range."""
    n = tl.program_id(0).to(tl.int64)
    if VARLEN:
        lo = tl.load(cu_ptr + n).to(tl.int64)
        hi = tl.load(cu_ptr + n + 1).to(tl.int64)
        k_row = k_ptr
        v_row = v_ptr
    else:
        lo = n * 0
        hi = lo + num_keys
        k_row = k_ptr + n * stride_kn
        v_row = v_ptr + n * stride_vn
    offs_h = tl.arange(0, BH)
    offs_d = tl.arange(0, BD)
    offs_v = tl.arange(0, BDV)
    offs_l = tl.arange(0, BL)
    h_mask = offs_h < H
    q = tl.load(
        q_ptr + n * stride_qn + offs_h[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None] & (offs_d < D)[None, :],
        other=0.0,
    )
    m_i = tl.full([BH], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, BDV], dtype=tl.float32)
    for start in range(lo, hi, BL):
        keys = start + offs_l
        live = keys < hi
        kt = tl.load(
            k_row + keys[:, None] * stride_kl + offs_d[None, :],
            mask=live[:, None] & (offs_d < D)[None, :],
            other=0.0,
        )
        s = tl.dot(q, tl.trans(kt), input_precision=DOT_PREC) * qk_scale
        s = tl.where(live[None, :], s, float("-inf"))
        m_new, alpha, p, l_i = online_softmax_step(m_i, l_i, s)
        vt = tl.load(
            v_row + keys[:, None] * stride_vl + offs_v[None, :],
            mask=live[:, None] & (offs_v < DV)[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PREC)
        m_i = m_new
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        o_ptr + n * stride_on + offs_h[:, None] * stride_oh + offs_v[None, :],
        o.to(o_ptr.dtype.element_ty),
        mask=h_mask[:, None] & (offs_v < DV)[None, :],
    )


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor | None,
    scale: float | None,
    block_l: int,
) -> torch.Tensor:
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    n, h, d = q.shape
    dv = v.shape[-1]
    o = torch.empty(n, h, dv, dtype=q.dtype, device=q.device)
    if n == 0:
        return o
    varlen = cu is not None
    num_keys = 0 if varlen else k.shape[1]
    qk_scale = (d**-0.5 if scale is None else scale) * LOG2E
    cu_arg = cu if cu is not None else torch.zeros(1, dtype=torch.int32, device=q.device)
    quick_fwd_kernel[(n,)](
        q, k, v, o, cu_arg,
        q.stride(0), q.stride(1),
        0 if varlen else k.stride(0), k.stride(-2),
        0 if varlen else v.stride(0), v.stride(-2),
        o.stride(0), o.stride(1),
        num_keys, qk_scale,
        H=h, BH=_tile(h), D=d, BD=_tile(d), DV=dv, BDV=_tile(dv), BL=block_l,
        VARLEN=varlen, DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return o


def sel_attn_fwd_dense(
    q: Tensor, k: Tensor, v: Tensor, scale: float | None = None, *, block_l: int = 64
) -> Tensor:
    """O [N, H, Dv]: row n's H heads attend, unmasked, over row n's L keys.

    Args:
        q: [N, H, D]; k: [N, L, D]; v: [N, L, Dv]; float16, bfloat16 or float32.
        scale: softmax scale, default D ** -0.5.
        block_l: keys per tile (power of two >= 16).
    """
    _check(q, k, v, scale, block_l, varlen=False)
    check_triton_runs("q", q)
    if k.shape[1] == 0:
        return q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    return _launch(q, k, v, None, scale, block_l)


def sel_attn_fwd_varlen(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, scale: float | None = None, *,
    block_l: int = 64,
) -> Tensor:  # fmt: skip
    """O [N, H, Dv]: row n's H heads attend, unmasked, over ``K[cu[n]:cu[n+1]]``.

    Args:
        q: [N, H, D]; k: [TotalL, D]; v: [TotalL, Dv].
        cu_seqlens: int32 [N+1], non-decreasing, from 0 to TotalL; an empty range gives 0.
        scale: softmax scale, default D ** -0.5.
        block_l: keys per tile (power of two >= 16).
    """
    _check(q, k, v, scale, block_l, varlen=True)
    check_cu_seqlens(cu_seqlens, k.shape[0], 1, q.device)
    if cu_seqlens.numel() != q.shape[0] + 1:
        raise ValueError(
            f"cu_seqlens must hold N+1={q.shape[0] + 1} entries (one range per row of q), got "
            f"{cu_seqlens.numel()}"
        )
    check_triton_runs("q", q)
    return _launch(q, k, v, cu_seqlens, scale, block_l)
