"""Block scoring and top-n selection on the GPU (docs/spec.md, "Selection scores").

- :func:`~nsa_kernels.scoring.function.select_blocks_triton`: the reference ``select_blocks``
  in one Triton kernel (``function``, ``kernels``).
- :mod:`~nsa_kernels.scoring.contract`: the index contract of docs/spec.md ("Block scoring on
  a GPU") as a checker; pure torch.

Its timing is ``nsa-bench score`` (nsa-bench).

The Triton modules load on first use, so importing this package needs no Triton.
"""

from __future__ import annotations

from typing import Any

from nsa_kernels._lazy import lazy_attribute

_LAZY = {
    "ScoreConfig": "nsa_kernels.scoring.function",
    "select_blocks_triton": "nsa_kernels.scoring.function",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    return lazy_attribute(__name__, _LAZY, name)
