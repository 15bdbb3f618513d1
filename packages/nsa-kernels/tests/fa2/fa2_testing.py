"""Helpers shared by the FA-2 adapter tests (CPU and GPU)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from nsa_core.debug_log import reset_log_state
from nsa_core.toggles import reload_toggles

# docs/spec.md tolerances: relative error ||out - ref|| / ||ref||.
FLOAT32_BOUND = 1e-5
KERNEL_BOUND = {torch.bfloat16: 1e-2, torch.float16: 5e-3}
GRAD_FACTOR = 2.0


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref64 = ref.detach().double()
    return float((out.detach().double() - ref64).norm() / ref64.norm().clamp_min(1e-30))


def randn(*shape: int, dtype: torch.dtype, device: str = "cpu", grad: bool = False) -> torch.Tensor:
    x = torch.randn(*shape, dtype=dtype, device=device)
    return x.requires_grad_(grad)


def cu_seqlens_of(lengths: list[int], device: str = "cpu") -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


@contextmanager
def toggles(**values: str) -> Iterator[None]:
    """Set NSA_<NAME>=value for the block, re-parse the toggles, restore afterwards."""
    patch = pytest.MonkeyPatch()
    for key, value in values.items():
        patch.setenv("NSA_" + key.upper(), value)
    reload_toggles()
    reset_log_state()
    try:
        yield
    finally:
        patch.undo()
        reload_toggles()
        reset_log_state()
