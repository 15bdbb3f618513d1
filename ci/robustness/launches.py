"""Which Triton kernels of nsa_kernels a block of code launched: every ``*_kernel`` Triton function
is found, and each module that launches one gets a recorder in its place for the block, so the
sweep can fail on a kernel it never reached."""

from __future__ import annotations

import inspect
import io
import re
import sys
import textwrap
import tokenize
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# Kernels of nsa_kernels the sweep may leave unlaunched, by function name, with the reason
# (none: every kernel there serves an op); any other kernel it never launches fails it.
KERNEL_EXEMPT: dict[str, str] = {}


def _is_triton_function(obj: object) -> bool:
    names = {cls.__name__ for cls in type(obj).__mro__}
    return bool(names & {"JITFunction", "InterpretedFunction"}) and hasattr(obj, "fn")


def _source(fn: Any) -> str:
    src = getattr(fn, "src", None)
    if isinstance(src, str):
        return src
    try:
        return inspect.getsource(fn.fn)
    except (OSError, TypeError):
        return ""


def _names_in(source: str) -> list[str]:
    """The identifiers of ``source`` (strings, docstrings and comments left out)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(textwrap.dedent(source)).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return re.findall(r"\w+", source)
    return [t.string for t in tokens if t.type == tokenize.NAME]


class LaunchRecorder:
    """Stands in for a Triton kernel in a launching module: records ``kernel[grid]`` launches."""

    def __init__(self, kernel: Any, key: str, launched: set[str]) -> None:
        self._kernel = kernel
        self._key = key
        self._launched = launched

    def __getitem__(self, grid: Any) -> Any:
        self._launched.add(self._key)
        return self._kernel[grid]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kernel, name)


@contextmanager
def kernel_launches() -> Iterator[tuple[dict[str, Any], set[str]]]:
    """Every Triton kernel of nsa_kernels (``*_kernel`` functions, by qualified name), and a set
    that fills with the ones launched inside the block.

    Each module that launches a kernel gets a recorder in its place until the block ends; a
    module whose own Triton functions use the name keeps the kernel (a recorder there would
    reach the compiler).
    """
    import importlib
    import pkgutil

    import nsa_kernels

    for info in pkgutil.walk_packages(nsa_kernels.__path__, "nsa_kernels."):
        importlib.import_module(info.name)
    modules = {n: m for n, m in list(sys.modules.items()) if n.split(".")[0] == "nsa_kernels" and m}
    kernels: dict[str, Any] = {}
    for module in modules.values():
        for attr, obj in vars(module).items():
            if attr.endswith("_kernel") and _is_triton_function(obj):
                kernels[f"{obj.fn.__module__}.{obj.fn.__name__}"] = obj
    launched: set[str] = set()
    by_id = {id(k): key for key, k in kernels.items()}
    replaced: list[tuple[Any, str, Any]] = []
    for name, module in modules.items():
        # Triton functions defined here resolve their globals in this module's namespace.
        own = [
            o for o in vars(module).values() if _is_triton_function(o) and o.fn.__module__ == name
        ]
        for attr, obj in list(vars(module).items()):
            key = by_id.get(id(obj))
            if key is None:
                continue
            # A kernel's own source names it once, in its ``def`` line; any other use in a Triton
            # function of this module would reach the compiler as a recorder: leave those alone.
            uses = sum(_names_in(_source(f)).count(attr) - (f is obj) for f in own)
            if uses > 0:
                continue
            replaced.append((module, attr, obj))
            setattr(module, attr, LaunchRecorder(obj, key, launched))
    try:
        yield kernels, launched
    finally:
        for module, attr, obj in replaced:
            setattr(module, attr, obj)
