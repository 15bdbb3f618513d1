"""apply_rope is a public op: validated once, routed by the registry, the reference on a CPU.

The reference's values are checked against a float64 brute force in test_ops_vs_brute.py and its
gradient by gradcheck in test_gradcheck.py; here: the routing, the pinned toggle, and the
argument rules of docs/spec.md ("Rotary embedding").
"""

from __future__ import annotations

import pytest
import torch

import nsa_core
from nsa_core import ops, registry
from nsa_core.checks import check_apply_rope
from nsa_core.reference.rope import apply_rope as reference_apply_rope
from nsa_core.toggles import Toggles


def test_public_op_equals_reference_on_cpu() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 8, generator=gen)
    pos = torch.arange(4, 9)
    assert nsa_core.apply_rope is ops.apply_rope
    assert torch.equal(ops.apply_rope(x, pos, 500.0), reference_apply_rope(x, pos, 500.0))


def test_cpu_routes_to_the_reference() -> None:
    ctx = check_apply_rope(torch.randn(1, 4, 2, 8), torch.arange(4), 10000.0)
    assert ctx.num_q_heads == ctx.num_kv_heads == 2
    assert ctx.head_dim_qk == ctx.head_dim_v == 8
    assert registry.resolve("apply_rope", ctx, Toggles()).backend.name == "reference"
    assert "apply_rope             -> reference" in registry.routing_report(ctx, Toggles())


def test_requires_grad_in_the_context() -> None:
    x = torch.randn(1, 3, 1, 4, requires_grad=True)
    assert check_apply_rope(x, torch.arange(3), 10000.0).requires_grad
    with torch.no_grad():
        assert not check_apply_rope(x, torch.arange(3), 10000.0).requires_grad


@pytest.mark.parametrize(
    ("x_shape", "positions", "theta", "error", "match"),
    [
        ((1, 4, 2, 5), torch.arange(4), 10000.0, ValueError, "even"),
        ((1, 4, 2), torch.arange(4), 10000.0, ValueError, "rank 4"),
        ((1, 4, 2, 8), torch.arange(3), 10000.0, ValueError, "do not match"),
        ((1, 4, 2, 8), torch.arange(4).float(), 10000.0, TypeError, "integers"),
        ((2, 4, 2, 8), torch.arange(12).view(3, 4), 10000.0, ValueError, "1 or B=2 rows"),
        ((1, 4, 2, 8), torch.arange(4).view(1, 1, 4), 10000.0, ValueError, "do not match"),
        ((1, 4, 2, 8), [0, 1, 2, 3], 10000.0, TypeError, "torch.Tensor"),
        ((1, 4, 2, 8), torch.arange(4), 0.0, ValueError, "theta"),
        ((1, 4, 2, 8), torch.arange(4), float("nan"), ValueError, "theta"),
        ((1, 4, 2, 8), torch.arange(4), True, TypeError, "theta"),
    ],
)
def test_bad_arguments_raise_naming_the_rule(
    x_shape: tuple[int, ...],
    positions: object,
    theta: object,
    error: type[Exception],
    match: str,
) -> None:
    with pytest.raises(error, match=match):
        ops.apply_rope(torch.randn(*x_shape), positions, theta)  # type: ignore[arg-type]


def test_integer_x_is_refused() -> None:
    with pytest.raises(TypeError, match="floating-point"):
        ops.apply_rope(torch.ones(1, 2, 1, 4, dtype=torch.int32), torch.arange(2), 10000.0)
