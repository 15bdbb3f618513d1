"""The output buffers of the Triton attention forwards (compressed and selected branches)."""

from __future__ import annotations

import torch


def forward_outputs(
    q: torch.Tensor, batch: int, tq: int, hq: int, dv: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised o [B, Tq, HQ, dv] in q's dtype and lse [B, Tq, HQ] float32, on q's device:
    what a forward launch writes."""
    o = torch.empty(batch, tq, hq, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, tq, hq, dtype=torch.float32, device=q.device)
    return o, lse


def no_visible_keys(o: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """o [B, Tq, HQ, dv] = 0 and lse [B, Tq, HQ] = -inf, in place: a forward whose rows see no
    key (docs/spec.md: such a row gives 0, never NaN), without a launch."""
    o.zero_()
    lse.fill_(float("-inf"))
    return o, lse
