"""What torch.compile traces of an NSA layer, and what it runs as opaque regions.

An NSA call does work that a graph cannot hold: it resolves backends through the registry
(entry points, logging, the device's properties), reads the toggles, and its kernels plan
launches on the host. Under torch.compile that work runs once, when the graph is traced: the
attention core and the rotary embedding are *non-strict regions*
(``torch._dynamo.nonstrict_trace``): Dynamo does not interpret their Python; AOTAutograd runs
it on fake tensors and records the torch ops and the kernel custom ops it issues (nsa-kernels
launches every Triton kernel through one, ``nsa::triton_launch``, while tracing). The compiled
graph then replays the recorded ops with no routing at all: the toggles and backends in force
when a graph is traced are the ones it keeps (a new toggle takes a new compile, or
``torch.compiler.reset()``).

Arguments cross into a region as tensors, ints and constants: the config crosses as
:class:`TraceConstant` (a frozen dataclass cannot), which the config carries from its creation
(``NSAConfig.constant``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar, cast

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import is_fake

_T = TypeVar("_T")
_F = TypeVar("_F", bound=Callable[..., object])


class TraceConstant(Generic[_T]):
    """A hashable value that enters a non-strict region as a constant of the traced graph.

    The value must be immutable and hashable; two constants are equal when their values are, so
    a graph traced for one config serves every equal config.
    """

    __slots__ = ("value",)

    def __init__(self, value: _T) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TraceConstant) and other.value == self.value

    def __hash__(self) -> int:
        return hash(self.value)

    def __repr__(self) -> str:
        return f"TraceConstant({self.value!r})"


pytree.register_constant(TraceConstant)


def compiling() -> bool:
    """Whether torch.compile is tracing this call (Dynamo, or AOTAutograd inside a region)."""
    return bool(torch.compiler.is_compiling())


def traced(*tensors: torch.Tensor) -> bool:
    """Whether these tensors are being traced: torch.compile is on (:func:`compiling`), or one
    of them is fake (Dynamo runs a region once on fake tensors to learn its outputs, and some
    torch releases do not report that run as compiling)."""
    # A plain torch.Tensor is never fake: the exact type check keeps every routed eager op
    # off is_fake's slower walk of tensor subclasses.
    return compiling() or any(type(t) is not torch.Tensor and is_fake(t) for t in tensors)


def nonstrict_region(fn: _F) -> _F:
    """``fn`` as a non-strict region of torch.compile (module docstring).

    ``fn`` takes tensors, ints, floats, strings and :class:`TraceConstant` (no None) and returns
    tensors; it may run any Python. Outside torch.compile it is ``fn`` itself. On a torch
    without non-strict tracing (before 2.7) the region is a graph break.
    """
    nonstrict_trace = getattr(torch._dynamo, "nonstrict_trace", None)
    if nonstrict_trace is None:
        # torch < 2.7: the region is a graph break (fullgraph=True then says so).
        return cast(_F, torch.compiler.disable(fn))  # type: ignore[no-untyped-call]
    return cast(_F, nonstrict_trace(fn))
