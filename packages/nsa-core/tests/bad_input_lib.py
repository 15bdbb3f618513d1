"""The small, valid geometry the bad-input tests start from, and its inputs.

B=1, T=8, HQ=4, H=2, dk=8, dv=6, l=4, d=2, l'=4, n=3, w=3: each test replaces one argument of a
call on these inputs (or one field of this geometry's config) with a bad value.
"""

from __future__ import annotations

from typing import Any

import torch

from nsa_core import NSAConfig

B, T, HQ, H, DK, DV = 1, 8, 4, 2, 8, 6
L_CMP, D_CMP, L_SEL, N_SEL, W = 4, 2, 4, 3, 3
N_CMP = (T - L_CMP) // D_CMP + 1  # 3 compressed blocks
N_BLOCKS = T // L_SEL  # 2 selection blocks
HIDDEN = 16


def rand(*shape: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    """N(0, 1) of ``shape`` from the global generator."""
    return torch.randn(*shape, dtype=dtype, device=device)


def valid_indices(batch: int = B, t: int = T) -> torch.Tensor:
    """[batch, t, H, n]: block 0, the current block and padding: always in range."""
    idx = torch.full((batch, t, H, N_SEL), -1, dtype=torch.int32)
    idx[..., 0] = 0
    idx[..., 1] = (torch.arange(t) // L_SEL).view(1, t, 1).to(torch.int32)
    return idx


def config(**over: Any) -> NSAConfig:
    """The NSAConfig of this geometry (HQ, H, dk, dv, l, d, l', n, w) with ``over`` changed."""
    base: dict[str, Any] = {
        "num_q_heads": HQ,
        "num_kv_heads": H,
        "head_dim_qk": DK,
        "head_dim_v": DV,
        "cmp_block": L_CMP,
        "cmp_stride": D_CMP,
        "sel_block": L_SEL,
        "num_selected": N_SEL,
        "window": W,
    }
    return NSAConfig(**(base | over))
