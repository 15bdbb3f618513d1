"""Triton launches that torch.compile can trace: the custom op ``nsa::triton_launch``.

Outside torch.compile, :func:`launch` is ``kernel[grid](*args, **meta)``. While torch.compile
traces a region of nsa-core (:mod:`nsa_core.tracing`), the tensors are fake and a kernel cannot
run: :func:`launch` records the launch as ``nsa::triton_launch`` instead, a custom op that
mutates the tensors the kernel writes (``writes``) and whose fake implementation does nothing.
The compiled graph then launches the same kernel, with the same arguments and meta-parameters,
as eager code does: Inductor never recompiles NSA's kernels.

Arguments cross as lists by kind (written tensors, read tensors, ints, floats) with a layout
that puts them back in order; the kernel crosses as its module and name, and TMA descriptors
as their base tensor and box. Constexpr meta-parameters are concrete (a symbolic one is pinned
by a guard): they select the compiled kernel, so a graph holds one.
"""

from __future__ import annotations

import functools
import importlib
import json
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from nsa_core.tracing import traced

# Exact strides: the launches pass the strides they were traced with, so Inductor must hand
# over the tensors laid out as traced (no padded or reordered strides).
_TAGS = tuple(t for t in (getattr(torch.Tag, "needs_exact_strides", None),) if t is not None)


def launch(
    kernel: Any, grid: Sequence[int], *args: Any, writes: Sequence[Tensor], **meta: Any
) -> None:
    """``kernel[grid](*args, **meta)``, traceable by torch.compile.

    ``writes``: every tensor among ``args`` that the kernel writes (the op's mutated inputs;
    one left out would be seen unchanged by the compiled graph).
    """
    if not traced(*(a for a in args if isinstance(a, Tensor))):
        kernel[tuple(grid)](*args, **meta)
        return
    # A tensor the kernel writes through two pointers (an output standing in for one it does
    # not write) is one mutated input.
    writes = list({id(t): t for t in writes}.values())
    call = _LaunchArgs.of(args, writes)
    concrete = {name: _concrete(name, value) for name, value in meta.items()}
    torch.ops.nsa.triton_launch(
        _kernel_name(kernel), [*grid], list(writes), call.tensors, call.ints, call.floats,
        json.dumps(call.layout), json.dumps(concrete, sort_keys=True),
    )  # fmt: skip


class _LaunchArgs:
    """The positional arguments of one launch, split by kind, and the layout that rebuilds them."""

    def __init__(self) -> None:
        self.tensors: list[Tensor] = []
        self.ints: list[int] = []
        self.floats: list[float] = []
        self.layout: list[list[Any]] = []

    @classmethod
    def of(cls, args: Sequence[Any], writes: Sequence[Tensor]) -> _LaunchArgs:
        written = {id(t): i for i, t in enumerate(writes)}
        call = cls()
        for arg in args:
            call.layout.append(call._entry(arg, written))
        return call

    def _tensor(self, t: Tensor, written: dict[int, int]) -> list[Any]:
        if id(t) in written:
            return ["w", written[id(t)]]
        self.tensors.append(t)
        return ["t", len(self.tensors) - 1]

    def _entry(self, arg: Any, written: dict[int, int]) -> list[Any]:
        if isinstance(arg, Tensor):
            return self._tensor(arg, written)
        if arg is None or isinstance(arg, (bool, str)):
            return ["c", arg]
        if isinstance(arg, (int, torch.SymInt)):
            self.ints.append(arg)  # type: ignore[arg-type]
            return ["i", len(self.ints) - 1]
        if isinstance(arg, (float, torch.SymFloat)):
            self.floats.append(arg)  # type: ignore[arg-type]
            return ["f", len(self.floats) - 1]
        base = getattr(arg, "base", None)
        if isinstance(base, Tensor) and hasattr(arg, "block_shape"):
            # A TMA descriptor over ``base`` (its shape and strides are base's own).
            return ["d", self._tensor(base, written), [int(b) for b in arg.block_shape]]
        raise TypeError(f"a Triton launch argument of type {type(arg).__name__} cannot be traced")


def _concrete(name: str, value: Any) -> Any:
    """A meta-parameter as a JSON constant (a symbolic int or float is pinned by a guard)."""
    if isinstance(value, torch.SymInt):
        return int(value)
    if isinstance(value, torch.SymFloat):
        return float(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"meta-parameter {name}={value!r} is not a constant a graph can hold")


def _kernel_name(kernel: Any) -> str:
    fn = kernel.fn
    return f"{fn.__module__}:{fn.__name__}"


@functools.cache
def _kernel(name: str) -> Any:
    module, attr = name.split(":")
    return getattr(importlib.import_module(module), attr)


def _rebuilt(
    layout: list[list[Any]], writes: list[Tensor], tensors: list[Tensor], ints: list[int],
    floats: list[float],
) -> list[Any]:  # fmt: skip
    def tensor(entry: list[Any]) -> Tensor:
        index: int = entry[1]
        return writes[index] if entry[0] == "w" else tensors[index]

    args: list[Any] = []
    for entry in layout:
        kind = entry[0]
        if kind in ("w", "t"):
            args.append(tensor(entry))
        elif kind == "i":
            args.append(ints[entry[1]])
        elif kind == "f":
            args.append(floats[entry[1]])
        elif kind == "c":
            args.append(entry[1])
        else:
            from triton.tools.tensor_descriptor import TensorDescriptor

            base = tensor(entry[1])
            args.append(TensorDescriptor(base, list(base.shape), list(base.stride()), entry[2]))
    return args


@torch.library.custom_op("nsa::triton_launch", mutates_args=("writes",), tags=_TAGS)
def triton_launch(
    kernel: str, grid: list[int], writes: list[Tensor], tensors: list[Tensor], ints: list[int],
    floats: list[float], layout: str, meta: str,
) -> None:  # fmt: skip
    """Launch ``kernel`` (``module:name``) on ``grid`` with the arguments ``layout`` orders."""
    order, constants = _decoded(layout, meta)
    args = _rebuilt(order, writes, tensors, ints, floats)
    _kernel(kernel)[tuple(grid)](*args, **constants)


@functools.lru_cache(maxsize=1024)
def _decoded(layout: str, meta: str) -> tuple[list[list[Any]], dict[str, Any]]:
    """The layout and meta-parameters of a launch, parsed once per graph's launch site: a
    compiled call replays the same strings, and the parse would be host time on every launch
    (read only: ``_rebuilt`` reads the layout, the call copies the meta-parameters)."""
    return json.loads(layout), json.loads(meta)


@triton_launch.register_fake
def _(
    kernel: str, grid: list[int], writes: list[Tensor], tensors: list[Tensor], ints: list[int],
    floats: list[float], layout: str, meta: str,
) -> None:  # fmt: skip
    # The kernel writes ``writes`` in place: nothing to allocate, no shape to infer.
    return None
