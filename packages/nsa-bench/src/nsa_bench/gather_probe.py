# Triton kernels take untyped pointer/scalar parameters (types come from the launch), and
# triton.jit is untyped without triton installed: mypy checks only the plain Python here.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""The gather probe of ``nsa-bench sel --prefill --probe``: the selected forward's K/V reads
without its attention math, whose time is the bandwidth floor of a gather-bound forward.

Per (query row, kv head) of a B == 1 problem it walks the selected blocks with the forward's own
walk (:func:`nsa_kernels.selected.row_walk.selected_tile`), loads each K/V tile as the forward
does (masked pointer loads, or whole tiles through TMA descriptors), and feeds the tiles to dots
with a constant [ROWS, BL] operand (DOT: pipelined like the forward's loads) or merely sums them.
"""

# No `from __future__ import annotations`: the triton 3.0/3.1 interpreter reads a string
# annotation as a runtime argument, so `B: tl.constexpr` would stop being a constant.
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from nsa_kernels.selected.row_walk import selected_tile

# (num_warps, num_stages, BL, DOT, TMA) variants timed by default: pointer loads, then TMA.
VARIANTS: tuple[tuple[int, int, int, int, int], ...] = (
    (4, 2, 64, 1, 0),
    (4, 3, 64, 1, 0),
    (4, 4, 32, 1, 0),
    (4, 2, 64, 1, 1),
    (4, 3, 64, 1, 1),
    (4, 4, 32, 1, 1),
    (8, 3, 64, 1, 1),
    (4, 3, 64, 0, 1),
)


@triton.jit
def gather_probe_kernel(
    k_ptr, v_ptr, idx_ptr, out_ptr, k_desc, v_desc,
    stride_kt, stride_vt, stride_it, nsel,
    H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, SEL: tl.constexpr, BL: tl.constexpr,
    ROWS: tl.constexpr, DOT: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """out [T, H, DK + DV] float32: column sums of the K/V tiles row ``program_id(0)`` selects.

    k [T, H, DK], v [T, H, DV], idx [T, H, nsel] (contiguous in its last two axes).
    TMA: the tiles come through descriptors over k, v as [T, H * D] (whole tiles, no mask).
    """
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_k = tl.arange(0, DK)
    offs_v = tl.arange(0, DV)
    ones = tl.full([ROWS, BL], 1.0, dtype=k_ptr.dtype.element_ty)
    acc_k = tl.zeros([ROWS, DK], dtype=tl.float32)
    acc_v = tl.zeros([ROWS, DV], dtype=tl.float32)
    NSUB: tl.constexpr = SEL // BL
    idx_row = idx_ptr + row * stride_it + h * nsel
    for it in range(nsel * NSUB):
        pos, live, first = selected_tile(idx_row, it, row, SEL=SEL, BL=BL, NSUB=NSUB)
        if TMA:
            kv_row = first.to(tl.int32)
            kt = k_desc.load([kv_row, h * DK])
            vt = v_desc.load([kv_row, h * DV])
        else:
            kt = tl.load(
                k_ptr + pos.to(tl.int64)[:, None] * stride_kt + h * DK + offs_k[None, :],
                mask=live[:, None],
                other=0.0,
            )
            vt = tl.load(
                v_ptr + pos.to(tl.int64)[:, None] * stride_vt + h * DV + offs_v[None, :],
                mask=live[:, None],
                other=0.0,
            )
        if DOT:
            acc_k = tl.dot(ones, kt, acc_k)
            acc_v = tl.dot(ones, vt, acc_v)
        else:
            acc_k += tl.sum(kt.to(tl.float32), 0)[None, :]
            acc_v += tl.sum(vt.to(tl.float32), 0)[None, :]
    out = out_ptr + (row * H + h) * (DK + DV)
    tl.store(out + offs_k, tl.sum(acc_k, 0))
    tl.store(out + DK + offs_v, tl.sum(acc_v, 0))


def run_probe(
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor,
    sel_block: int,
    bench: Callable[[Callable[[], object]], float],
    variants: Sequence[tuple[int, int, int, int, int]] = VARIANTS,
) -> list[tuple[str, float, float]]:
    """(variant, ms, K/V GB/s) of the probe for each (num_warps, num_stages, BL, DOT, TMA).

    k [1, T, H, dk], v [1, T, H, dv], idx [1, T, H, n] (-1 padded), as the forward takes them;
    ``bench`` times a launch in ms. A variant that fails is reported by its error, with NaNs.
    """
    from triton.tools.tensor_descriptor import TensorDescriptor

    batch, t, h, dk = k.shape
    dv = v.shape[-1]
    if batch != 1:
        raise ValueError("the probe runs B == 1")
    out = torch.empty(t, h, dk + dv, device=k.device, dtype=torch.float32)
    blocks = int((idx >= 0).sum())
    kv = blocks * sel_block * (dk + dv) * k.element_size()
    results = []
    k2, v2 = k.reshape(t, h * dk), v.reshape(t, h * dv)
    for warps, stages, bl, dot, tma in variants:
        descs = [
            TensorDescriptor(x, list(x.shape), list(x.stride()), [bl, d]) if tma else x
            for x, d in ((k2, dk), (v2, dv))
        ]

        def launch(
            warps: int = warps,
            stages: int = stages,
            bl: int = bl,
            dot: int = dot,
            tma: int = tma,
            descs: list[Any] = descs,
        ) -> None:
            gather_probe_kernel[(t, h)](
                k, v, idx, out, descs[0], descs[1],
                k.stride(1), v.stride(1), idx.stride(1), idx.shape[-1],
                H=h, DK=dk, DV=dv, SEL=sel_block, BL=bl, ROWS=16,
                DOT=bool(dot), TMA=bool(tma), num_warps=warps, num_stages=stages,
            )  # fmt: skip

        name = f"{'dot' if dot else 'sum'}/w{warps}/s{stages}/bl{bl}{'/tma' if tma else ''}"
        try:
            launch()
            ms = bench(launch)
        except Exception as exc:  # report and go on
            results.append((f"{name}: {type(exc).__name__}", math.nan, math.nan))
            continue
        results.append((name, ms, kv / (ms * 1e6)))
    return results
