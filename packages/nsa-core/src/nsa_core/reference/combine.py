"""Gated combine of the three branches."""

from __future__ import annotations

import torch

from nsa_core.checks import check_rank, shape


def gated_combine(
    o_cmp: torch.Tensor, o_slc: torch.Tensor, o_win: torch.Tensor, gates: torch.Tensor
) -> torch.Tensor:
    """o = g[..., 0] * o_cmp + g[..., 1] * o_slc + g[..., 2] * o_win.

    Args:
        o_cmp, o_slc, o_win: [B, T, HQ, dv] branch outputs.
        gates: [B, T, HQ, 3] in (0, 1), ordered (cmp, slc, win).

    Returns:
        [B, T, HQ, dv].
    """
    check_rank("gates", gates, 4, "[B, T, HQ, 3]")
    for name, o in (("o_cmp", o_cmp), ("o_slc", o_slc), ("o_win", o_win)):
        check_rank(name, o, 4, "[B, T, HQ, dv]")
        if o.shape != o_cmp.shape:
            raise ValueError(f"{name} {shape(o)} differs from o_cmp {shape(o_cmp)}")
    if tuple(gates.shape) != (*o_cmp.shape[:3], 3):
        raise ValueError(f"gates {shape(gates)} must be [B, T, HQ, 3] matching {shape(o_cmp)}")
    g = gates.unsqueeze(-1)
    return g[..., 0, :] * o_cmp + g[..., 1, :] * o_slc + g[..., 2, :] * o_win
