"""Gated combine of the three branches."""

from __future__ import annotations

import torch

from nsa_core.checks import check_gated_combine
from nsa_core.reference.common import validated_by


@validated_by(check_gated_combine)
def gated_combine(
    o_cmp: torch.Tensor, o_sel: torch.Tensor, o_win: torch.Tensor, gates: torch.Tensor
) -> torch.Tensor:
    """o = g[..., 0] * o_cmp + g[..., 1] * o_sel + g[..., 2] * o_win.

    Args:
        o_cmp, o_sel, o_win: [B, T, HQ, dv] branch outputs.
        gates: [B, T, HQ, 3] in (0, 1), ordered (cmp, sel, win).

    Returns:
        [B, T, HQ, dv] in the inputs' dtype, summed left to right:
        ``(g0 * o_cmp + g1 * o_sel) + g2 * o_win``. Every product is taken, so a non-finite
        branch value stays non-finite whatever its gate (0 x NaN = NaN).
    """
    g = gates.unsqueeze(-1)
    return g[..., 0, :] * o_cmp + g[..., 1, :] * o_sel + g[..., 2, :] * o_win


# The body without the checks: the registry's reference backend (ValidatedOp).
gated_combine_impl = gated_combine.body
