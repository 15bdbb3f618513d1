"""Rotary position embedding (half-split layout) applied by token position."""

from __future__ import annotations

import torch

from nsa_core.checks import check_apply_rope
from nsa_core.reference.common import validated_by
from nsa_core.tracing import traced


def rope_angles(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., D/2] for integer ``positions`` [...]; frequency i is theta^(-2i/D).

    float32 (float64 for float64 ``dtype``): every backend rotates by these values. Traced by
    torch.compile, the tables come from the op ``nsa::rope_angles``, which runs this same eager
    code: Inductor's own pow, cos and sin differ from eager's in the last bit of some angles,
    which moves rotated bf16 q and k values by one unit and changes top-n picks where block
    scores nearly tie.
    """
    if head_dim % 2 != 0:
        raise ValueError(f"rotary head_dim must be even, got {head_dim}")
    wide = dtype == torch.float64
    if traced(positions):
        cos, sin = torch.ops.nsa.rope_angles(positions, head_dim, theta, wide)
        return cos, sin
    return _angles(positions, head_dim, theta, wide)


def _angles(
    positions: torch.Tensor, head_dim: int, theta: float, wide: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    work = torch.float64 if wide else torch.float32
    inv_freq = theta ** (
        -torch.arange(0, head_dim, 2, device=positions.device, dtype=work) / head_dim
    )
    angles = positions.to(work).unsqueeze(-1) * inv_freq
    return torch.cos(angles), torch.sin(angles)


_rope_angles_op = torch.library.custom_op(
    "nsa::rope_angles",
    _angles,
    mutates_args=(),
    schema="(Tensor positions, int head_dim, float theta, bool wide) -> (Tensor, Tensor)",
)


@_rope_angles_op.register_fake
def _(
    positions: torch.Tensor, head_dim: int, theta: float, wide: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (*positions.shape, head_dim // 2)
    work = torch.float64 if wide else torch.float32
    return positions.new_empty(shape, dtype=work), positions.new_empty(shape, dtype=work)


@validated_by(check_apply_rope)
def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate x [B, T, H, D] by the position of each token, positions [T] or [B | 1, T] (int).

    Channel pairs (c, c + D/2) rotate by angle ``position * theta^(-2c/D)``:
    ``(x_c cos - x_{c+D/2} sin, x_{c+D/2} cos + x_c sin)``, computed in float32 (float64 for
    float64 x) and rounded once to x's dtype.
    """
    if positions.dim() == 1:
        positions = positions.unsqueeze(0)
    cos, sin = rope_angles(positions, x.shape[-1], theta, x.dtype)
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [B|1, T, 1, D/2]
    x1, x2 = x.float().chunk(2, dim=-1) if x.dtype != torch.float64 else x.chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


# The body without the checks: the registry's reference backend (ValidatedOp).
apply_rope_impl = apply_rope.body
