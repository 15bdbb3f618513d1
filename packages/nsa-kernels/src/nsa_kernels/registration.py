"""Entry point ``nsa.backends``: registers this package's kernels with nsa-core's registry."""

from __future__ import annotations

from collections.abc import Callable

from nsa_core.registry import Backend


def register(register_backend: Callable[[Backend], None]) -> None:
    """Register every backend nsa-kernels provides (each decides per call if it applies)."""
