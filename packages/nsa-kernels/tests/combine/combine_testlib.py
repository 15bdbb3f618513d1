"""Inputs and comparisons shared by the gated-combine kernel tests."""

from __future__ import annotations

import torch


def draw(
    gen: torch.Generator, shape: tuple[int, int, int, int], dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """o_cmp, o_sel, o_win [B, T, HQ, dv] ~ N(0, 1) and gates [B, T, HQ, 3] in (0, 1)."""
    branches = [torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for _ in range(3)]
    gates = torch.rand((*shape[:3], 3), generator=gen).to(device=device, dtype=dtype)
    return branches[0], branches[1], branches[2], gates


def leaves(*tensors: torch.Tensor, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Detached copies (in ``dtype`` if given) that require grad."""
    return [t.detach().to(dtype or t.dtype).requires_grad_() for t in tensors]
