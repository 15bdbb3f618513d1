"""Gated combine of the three branches."""

from __future__ import annotations

import torch

from nsa_core.checks import check_gated_combine


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
    check_gated_combine(o_cmp, o_slc, o_win, gates)
    g = gates.unsqueeze(-1)
    return g[..., 0, :] * o_cmp + g[..., 1, :] * o_slc + g[..., 2, :] * o_win
