"""Entry point ``nsa.backends``: registers this package's kernels with nsa-core's registry.

One folder per NSA step, each with one table of its backends and their priorities:

| step | op | table |
|---|---|---|
| rotary embedding of q and k | ``apply_rope`` | :mod:`nsa_kernels.rope.backends` |
| block scoring and top-n | ``select_blocks`` | :mod:`nsa_kernels.scoring.backends` |
| compressed branch | ``compressed_attention`` | :mod:`nsa_kernels.compressed.backends` |
| selected branch | ``selected_attention`` | :mod:`nsa_kernels.selected.backends` |
| sliding branch | ``sliding_attention`` | :mod:`nsa_kernels.sliding.backends` |
| gated combine | ``gated_combine`` | :mod:`nsa_kernels.combine.backends` |
| all steps after compression | ``attention_core`` | :mod:`nsa_kernels.core.backends` |

Each backend decides per call whether it applies (device, dtype, shapes, toggles) and says why
not; registering is cheap and imports no kernel compiler: Triton kernels compile on first use,
the CUDA experiment builds on first use.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from nsa_core.registry import Backend

STEP_TABLES = (
    "nsa_kernels.rope.backends",
    "nsa_kernels.scoring.backends",
    "nsa_kernels.compressed.backends",
    "nsa_kernels.selected.backends",
    "nsa_kernels.sliding.backends",
    "nsa_kernels.combine.backends",
    "nsa_kernels.core.backends",
)


def all_backends() -> list[Backend]:
    """Every backend nsa-kernels provides, step by step."""
    rows: list[Backend] = []
    for name in STEP_TABLES:
        rows.extend(importlib.import_module(name).backends())
    return rows


def register(register_backend: Callable[[Backend], None]) -> None:
    """Register every backend nsa-kernels provides with ``register_backend`` (nsa-core's
    ``registry.register_backend``, or any callable taking one Backend)."""
    if not callable(register_backend):
        kind = type(register_backend).__name__
        raise TypeError(f"register_backend must be callable (one Backend -> None), got {kind}")
    for backend in all_backends():
        register_backend(backend)
