"""What one call runs: how often each registry op is resolved and each validator runs.

A profile hook sees every Python call whatever name the caller imported the function under, so
the counts hold for the GPU default routes (nsa-kernels' fused core) as for the reference.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import nsa_core.attention
import nsa_core.checks
import nsa_core.core
import nsa_core.reference.compress
import nsa_core.registry
from nsa_core.registry import STEP_OPS

# The validators of whole calls: the core's, the layer core's, each step op's, compress's.
VALIDATORS = (
    nsa_core.attention.check_nsa_attention,
    nsa_core.core.check_attention_core,
    nsa_core.checks.check_apply_rope,
    nsa_core.checks.check_select_blocks,
    nsa_core.checks.check_compressed_attention,
    nsa_core.checks.check_selected_attention,
    nsa_core.checks.check_sliding_attention,
    nsa_core.checks.check_gated_combine,
    nsa_core.checks.check_compress,
)


@dataclass
class CallCounts:
    """``resolved[op]``: registry resolutions of op; ``validated[name]``: validator runs."""

    resolved: Counter[str] = field(default_factory=Counter)
    validated: Counter[str] = field(default_factory=Counter)

    @property
    def step_resolutions(self) -> int:
        return sum(self.resolved[op] for op in STEP_OPS)


@contextmanager
def counting_calls() -> Iterator[CallCounts]:
    """Count, inside the block, each ``registry.resolve(op, ...)`` by op and each validator run."""
    counts = CallCounts()
    resolve_code = nsa_core.registry.resolve.__code__
    validator_codes = {v.__code__: v.__name__ for v in VALIDATORS}

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        if code is resolve_code:
            counts.resolved[frame.f_locals["op"]] += 1
        elif code in validator_codes:
            counts.validated[validator_codes[code]] += 1

    previous: Callable[..., Any] | None = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield counts
    finally:
        sys.setprofile(previous)
