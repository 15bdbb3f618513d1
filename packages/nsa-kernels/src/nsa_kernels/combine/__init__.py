"""The gated combine of the three branches on the GPU (docs/spec.md, "Output").

- :func:`~nsa_kernels.combine.function.gated_combine_triton`: the reference ``gated_combine``
  as one Triton pass forward and one backward (``function``, ``kernels``).
- :mod:`~nsa_kernels.combine.backends`: its registry table.

The Triton modules load on first use, so importing this package needs no Triton.
"""

from __future__ import annotations

from typing import Any

from nsa_kernels._lazy import lazy_attribute

_LAZY = {
    "GatedCombineFunction": "nsa_kernels.combine.function",
    "gated_combine_triton": "nsa_kernels.combine.function",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, _LAZY, name)
