"""Timing one row of the layer bench: a measurement that turns any failure of the timed call
into the row's status instead of a crash, with the memory the call took on CUDA."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from nsa_bench.cases import MIB, failure_status, free_memory
from nsa_bench.layer.rows import Row
from nsa_bench.timing import Timer


def measure(
    row: Row,
    fn: Callable[[], object],
    leaves: Sequence[torch.Tensor],
    timer: Timer,
    device: torch.device,
) -> Row:
    """Run ``fn`` once (compile, autotune, surface refusals), then time it; fill ms and memory.

    Any exception becomes the row's status; the row is returned either way.
    """
    base = 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    try:
        fn()
        for t in leaves:
            t.grad = None
        row.ms = timer(fn, leaves)
    except Exception as exc:  # a refusal or an OOM is a result, not a crash
        row.status = failure_status(exc)
        row.ms = math.nan
    if device.type == "cuda":
        try:
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device)
            row.peak_mib = peak / MIB
            row.work_mib = (peak - base) / MIB
        except Exception as exc:  # a kernel fault poisons the context: say so, keep the row
            row.status += f"; memory not read: {type(exc).__name__}: {exc}"
    for t in leaves:
        t.grad = None
    if row.status.startswith("oom"):
        free_memory(device)
    return row
