"""How long the benches time a call: at least MIN_TIMED_RUNS runs, whatever its length."""

from __future__ import annotations

import torch

from nsa_bench.timing import MIN_TIMED_RUNS, median_ms, repetition_ms


def test_a_long_call_gets_enough_repetition_for_a_median_of_several_runs() -> None:
    # do_bench times int(rep / estimate) runs: 100 ms would time a 136 ms call once.
    assert int(100.0 / 136.0) == 0
    rep = repetition_ms(100.0, 136.0)
    assert int(rep / 136.0) >= MIN_TIMED_RUNS
    # A little above the estimate (do_bench's own, with cache flushes) still gives the minimum.
    assert int(rep / (136.0 * 1.2)) >= MIN_TIMED_RUNS


def test_a_short_call_keeps_the_requested_repetition() -> None:
    assert repetition_ms(100.0, 0.5) == 100.0
    assert repetition_ms(100.0, 0.5, min_runs=1000) > 100.0


def test_median_ms_on_the_host_clock_runs_setup_before_every_call() -> None:
    calls: list[str] = []
    ms = median_ms(
        lambda: calls.append("fn"),
        iters=3,
        warmup=1,
        device=torch.device("cpu"),
        setup=lambda: calls.append("setup"),
    )
    assert calls == ["setup", "fn"] * 4
    assert ms >= 0.0
