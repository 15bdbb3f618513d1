"""Rotary position embedding (half-split layout) applied by token position."""

from __future__ import annotations

import torch

from nsa_core.checks import check_rank


def rope_angles(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., D/2] for integer ``positions`` [...]; frequency i is theta^(-2i/D)."""
    if head_dim % 2 != 0:
        raise ValueError(f"rotary head_dim must be even, got {head_dim}")
    work = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq = theta ** (
        -torch.arange(0, head_dim, 2, device=positions.device, dtype=work) / head_dim
    )
    angles = positions.to(work).unsqueeze(-1) * inv_freq
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate x [B, T, H, D] by the position of each token, positions [T] or [B, T] (int).

    Channel pairs (c, c + D/2) rotate by angle ``position * theta^(-2c/D)``.
    """
    check_rank("x", x, 4, "[B, T, H, D]")
    if positions.dim() == 1:
        positions = positions.unsqueeze(0)
    if positions.shape[-1] != x.shape[1]:
        raise ValueError(f"positions {list(positions.shape)} do not match x's T={x.shape[1]}")
    cos, sin = rope_angles(positions, x.shape[-1], theta, x.dtype)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [B|1, T, 1, D/2]
    x1, x2 = x.float().chunk(2, dim=-1) if x.dtype != torch.float64 else x.chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)
