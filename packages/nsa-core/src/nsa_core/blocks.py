"""Block arithmetic of docs/spec.md: compressed blocks, selection blocks and their overlap.

The public helpers: each checks its arguments (:mod:`nsa_core.checks`) and computes with
:mod:`nsa_core.block_math`, which nsa-core's ops and layer call directly on arguments their own
validators have checked.
"""

from __future__ import annotations

import torch

from nsa_core import block_math
from nsa_core.checks import (
    check_block_geometry,
    check_cmp_cu_seqlens,
    check_cmp_geometry,
    check_device,
    check_float_dtype,
    check_length,
    check_sel_block,
)


def num_cmp_blocks(length: int, cmp_block: int, cmp_stride: int) -> int:
    """N_cmp(L): complete blocks ``[i*d, i*d + l)`` inside a prefix of ``length`` tokens.

    ``length`` an int in [0, 2^31 - 1]; l, d ints >= 1 with d dividing l.
    """
    check_length("length", length)
    check_cmp_geometry(cmp_block, cmp_stride)
    return block_math.num_cmp_blocks(length, cmp_block, cmp_stride)


def num_sel_blocks(length: int, sel_block: int) -> int:
    """Selection blocks ``[j*l', (j+1)*l')`` that hold at least one of ``length`` tokens.

    ``length`` an int in [0, 2^31 - 1]; l' an int >= 1.
    """
    check_length("length", length)
    check_sel_block(sel_block)
    return block_math.num_sel_blocks(length, sel_block)


def cmp_block_overlap(
    num_cmp: int,
    num_sel: int,
    cmp_block: int,
    cmp_stride: int,
    sel_block: int,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """c [num_cmp, num_sel] = ``|[i*d, i*d+l) ∩ [j*l', (j+1)*l')| / d`` (paper Eq. 9 by overlap).

    For l=32, d=16, l'=64, selection block j takes compressed blocks 4j-1 .. 4j+3 with weights
    1, 2, 2, 2, 1. num_cmp and num_sel are ints in [0, 2^31 - 1]; d divides l and l'; dtype is a
    floating-point dtype.
    """
    check_length("num_cmp", num_cmp)
    check_length("num_sel", num_sel)
    check_block_geometry(cmp_block, cmp_stride, sel_block)
    checked_device = check_device("device", device)
    check_float_dtype("dtype", dtype)
    return block_math.cmp_block_overlap(
        num_cmp, num_sel, cmp_block, cmp_stride, sel_block, device=checked_device, dtype=dtype
    )


def cmp_cu_seqlens(cu_seqlens: torch.Tensor, cmp_block: int, cmp_stride: int) -> torch.Tensor:
    """cu_seqlens [S+1] over tokens -> [S+1] over each sequence's compressed blocks, packed.

    cu_seqlens is int32 [S+1] from 0, non-decreasing (its values are read on the CPU only; on a
    GPU reading them would sync the device); l, d ints >= 1 with d dividing l.
    """
    check_cmp_cu_seqlens(cu_seqlens, cmp_block, cmp_stride)
    return block_math.cmp_cu_seqlens(cu_seqlens, cmp_block, cmp_stride)
