"""Median timings of a callable: CUDA events (optionally over a CUDA graph) or the host clock."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_ms(
    fn: Callable[[], object],
    *,
    iters: int,
    warmup: int,
    device: torch.device,
    setup: Callable[[], object] | None = None,
) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` runs after ``warmup`` runs.

    ``setup`` (not timed) runs before every call, for work that must start from the same state.
    On CUDA each call is bracketed by events on the current stream; on CPU by the host clock.
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    times = []
    for _ in range(iters):
        if setup is not None:
            setup()
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(float(start.elapsed_time(end)))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(times))


def graph_median_ms(
    make_fn: Callable[[], Callable[[], object]],
    *,
    iters: int,
    warmup: int,
    device: torch.device,
) -> float:
    """Median milliseconds of replaying a CUDA graph of one call (CUDA only).

    ``make_fn()`` returns a fresh callable each time (for work that mutates its state, such as a
    decode step advancing its cache): a few are run on a side stream to warm up, one is captured,
    and the graph's replays are timed, so launch gaps between the many small kernels of a step
    stay out of the numbers.
    """
    if device.type != "cuda":
        raise ValueError("graph_median_ms needs a CUDA device")
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(max(warmup, 2)):
            make_fn()()
    torch.cuda.current_stream(device).wait_stream(stream)
    fn = make_fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay, iters=iters, warmup=warmup, device=device)
