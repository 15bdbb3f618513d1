"""Names a package exports but imports on first use (PEP 562 module ``__getattr__``).

Kernel modules import Triton at their top; the packages that export them stay importable
without it (nsa-core's entry-point loader imports nsa_kernels on every machine).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any


def lazy_attribute(package: str, lazy: Mapping[str, str], name: str) -> Any:
    """``name`` from the module ``lazy[name]``, imported now; AttributeError if ``lazy`` lacks it.

    ``package`` is the exporting package's ``__name__`` (for the error message).
    """
    if name in lazy:
        return getattr(importlib.import_module(lazy[name]), name)
    raise AttributeError(f"module {package!r} has no attribute {name!r}")
