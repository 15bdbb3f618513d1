"""Entry point ``nsa.backends``: registers this package's kernels with nsa-core's registry.

Each backend decides per call whether it applies (device, dtype, shapes, toggles) and says why
not; registering is cheap and imports no kernel compiler: Triton kernels compile on first use,
the CUDA experiment builds on first use.
"""

from __future__ import annotations

from collections.abc import Callable

from nsa_core.registry import Backend


def register(register_backend: Callable[[Backend], None]) -> None:
    """Register every backend nsa-kernels provides."""
    from nsa_kernels import cuda_sel, fa2
    from nsa_kernels.selection import backend as selection

    for module_backends in (selection.backends(), fa2.backends(), cuda_sel.backends()):
        for backend in module_backends:
            register_backend(backend)
