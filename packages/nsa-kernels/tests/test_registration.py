"""Every registered backend takes its op's arguments by the op's own names.

A public op (nsa_core.ops) hands its backend the call's arguments as the user gave them,
positional or by keyword, plus ``toggles``: so each backend must accept every parameter of the
op's reference signature under the same name and kind.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from typing import Any

import pytest

from nsa_core import core, reference, registry
from nsa_kernels.common.triton_routing import TritonFn
from nsa_kernels.registration import all_backends

HAS_TRITON = importlib.util.find_spec("triton") is not None
REFERENCE: dict[str, Callable[..., Any]] = {
    "attention_core": core.attention_core,
    "apply_rope": reference.apply_rope,
    "select_blocks": reference.select_blocks,
    "compressed_attention": reference.compressed_attention,
    "selected_attention": reference.selected_attention,
    "sliding_attention": reference.sliding_attention,
    "gated_combine": reference.gated_combine,
}
# The package's own backend tables (what its entry point registers), read directly: a checkout
# run from PYTHONPATH, as on a GPU host, has no installed entry point for the registry to load.
ROWS = [
    pytest.param(backend.op, backend, id=f"{backend.op}-{backend.name}")
    for backend in all_backends()
]


def runs(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The function a backend's ``fn`` ends in (a Triton backend's imported target)."""
    return fn.target() if isinstance(fn, TritonFn) else fn


def test_every_op_has_a_non_reference_backend_here() -> None:
    assert {row.values[0] for row in ROWS} == set(registry.OPS)


@pytest.mark.parametrize(("op", "backend"), ROWS)
def test_backend_takes_the_ops_arguments_by_name(op: str, backend: registry.Backend) -> None:
    if isinstance(backend.fn, TritonFn) and not HAS_TRITON:
        pytest.skip("triton is not installed: the Triton backend's target cannot be imported")
    reference_op = REFERENCE[op]
    op_params = inspect.signature(getattr(reference_op, "body", reference_op)).parameters
    target = inspect.signature(runs(backend.fn)).parameters
    for name, param in op_params.items():
        assert name in target, f"{backend.name} has no parameter {name!r} of {op}"
        assert target[name].kind == param.kind, (
            f"{backend.name}'s {name!r} is {target[name].kind.description}, "
            f"the op's is {param.kind.description}"
        )
        assert (target[name].default is inspect.Parameter.empty) == (
            param.default is inspect.Parameter.empty
        ), f"{backend.name}'s {name!r} differs from {op}'s in having a default"
    if isinstance(backend.fn, TritonFn):
        # The registry's calls were validated already: a Triton row hands validated=True on.
        assert "validated" in target, f"{backend.name}'s target takes no 'validated'"
        assert target["validated"].kind is inspect.Parameter.KEYWORD_ONLY
