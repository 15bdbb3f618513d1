"""Median timings of a callable: CUDA events (optionally over a CUDA graph), triton's do_bench
or the host clock, and the timer a bench picks among them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (CUDA); on the CPU it is already done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def clear_grads(tensors: Sequence[torch.Tensor]) -> Callable[[], None]:
    """A ``setup`` for :func:`median_ms` that resets ``tensors``' ``.grad`` before every call.

    Backward runs would otherwise accumulate into the previous run's gradients, timing an add
    the real step does not do.
    """

    def reset() -> None:
        for t in tensors:
            t.grad = None

    return reset


# triton's do_bench times about rep_ms / (its own estimate) runs, so a call longer than rep_ms
# would be timed once: its "median" would be one sample. Every call is timed at least this often.
MIN_TIMED_RUNS = 5


def repetition_ms(rep_ms: float, estimate_ms: float, min_runs: int = MIN_TIMED_RUNS) -> float:
    """The ``rep`` to give do_bench so that a call of ``estimate_ms`` runs at least ``min_runs``
    timed times (do_bench times ``int(rep / estimate)`` runs), and never less than ``rep_ms``."""
    # 1.25: do_bench re-estimates the call itself (with cache flushes), a little higher.
    return max(rep_ms, min_runs * estimate_ms * 1.25)


def do_bench_median_ms(
    fn: Callable[[], object],
    *,
    warmup_ms: float,
    rep_ms: float,
    grads: Sequence[torch.Tensor] = (),
) -> float:
    """Median milliseconds of ``fn()`` by ``triton.testing.do_bench`` (CUDA only).

    do_bench runs ``fn`` for about ``warmup_ms``, then times it for about ``rep_ms``, flushing the
    L2 cache between runs; the ``.grad`` of ``grads`` is reset before each run. A call too long
    for ``rep_ms`` to hold MIN_TIMED_RUNS runs gets a longer ``rep`` (:func:`repetition_ms`),
    from one timed run of its own.
    """
    import triton.testing

    fn()
    estimate = median_ms(
        fn, iters=1, warmup=0, device=torch.device("cuda"), setup=clear_grads(grads)
    )
    return float(
        triton.testing.do_bench(
            fn,
            warmup=warmup_ms,
            rep=repetition_ms(rep_ms, estimate),
            grad_to_none=list(grads) or None,
            return_mode="median",
        )
    )


# A timer: the median ms of a zero-argument call, with the tensors whose grads it fills.
Timer = Callable[[Callable[[], object], Sequence[torch.Tensor]], float]


def make_timer(
    device: torch.device,
    *,
    use_do_bench: bool,
    warmup_ms: float,
    rep_ms: float,
    iters: int,
    warmup: int,
) -> Timer:
    """``use_do_bench`` (CUDA only): :func:`do_bench_median_ms` for about ``rep_ms`` after
    ``warmup_ms``; else :func:`median_ms` over ``iters`` runs after ``warmup``. Either way the
    grads of the leaves given with the call are reset before every run."""
    if use_do_bench:

        def bench_do_bench(fn: Callable[[], object], leaves: Sequence[torch.Tensor]) -> float:
            return do_bench_median_ms(fn, warmup_ms=warmup_ms, rep_ms=rep_ms, grads=leaves)

        return bench_do_bench

    def bench_runs(fn: Callable[[], object], leaves: Sequence[torch.Tensor]) -> float:
        setup = clear_grads(leaves)
        return median_ms(fn, iters=iters, warmup=warmup, device=device, setup=setup)

    return bench_runs


def warm_then_capture(
    make_fn: Callable[[], Callable[[], object]],
    *,
    warmup: int,
    device: torch.device | None = None,
    graph: bool = True,
) -> Callable[[], object]:
    """``make_fn()()`` run ``warmup`` times on a side stream, then a fresh ``make_fn()`` captured.

    Returns the CUDA graph's replay, or with ``graph=False`` the fresh callable itself (eager
    steps after the same warm-up). The warm-up runs on a side stream, as CUDA graph capture
    needs, so lazy initialisation and autotuning happen before the capture. ``device`` None is
    the current CUDA device.
    """
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            make_fn()()
    torch.cuda.current_stream(device).wait_stream(stream)
    fn = make_fn()
    if not graph:
        return fn
    captured = torch.cuda.CUDAGraph()
    with torch.cuda.graph(captured):
        fn()
    return captured.replay


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
    replay = warm_then_capture(make_fn, warmup=max(warmup, 2), device=device)
    return median_ms(replay, iters=iters, warmup=warmup, device=device)
