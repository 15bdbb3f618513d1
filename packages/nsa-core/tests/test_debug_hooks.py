"""The per-call debug hooks (shapes, timing, compare) wrap whichever backend the registry picks."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from nsa_core import ops
from nsa_core.registry import Backend, OpContext, register_backend, resolve_fn
from nsa_core.toggles import Toggles, reload_toggles

# Every test registers its dummy backends into a throwaway registry and turns hooks on.
pytestmark = pytest.mark.usefixtures("isolated_registry", "restore_toggles")

HOOK_TOGGLES = ("NSA_DEBUG_SHAPES", "NSA_DEBUG_TIMING", "NSA_DEBUG_COMPARE")
SLEEP_S = 0.02


def set_hooks(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """Turn the debug log and the named hook toggles on (and every other hook off)."""
    monkeypatch.setenv("NSA_DEBUG_LOG", "1")
    monkeypatch.setenv("NSA_DEBUG_LOG_LIMIT", "100")
    for name in HOOK_TOGGLES:
        monkeypatch.setenv(name, "1" if name in names else "0")
    reload_toggles()


@pytest.fixture
def restore_toggles(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    yield
    monkeypatch.undo()
    reload_toggles()


@pytest.fixture
def log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """The records of the nsa logger at INFO, where the hooks write."""
    caplog.set_level(logging.INFO, logger="nsa")
    return caplog


def accept(ctx: OpContext, toggles: Toggles) -> str | None:
    return None


def off_by_half(*args: Any, toggles: Toggles, **kwargs: Any) -> torch.Tensor:
    """A sliding-attention backend whose output is the reference's plus 0.5 (after a sleep)."""
    from nsa_core.reference.sliding_attention import sliding_attention_impl

    time.sleep(SLEEP_S)
    out: torch.Tensor = sliding_attention_impl(*args, **kwargs)
    return out + 0.5


def one_index_off(*args: Any, toggles: Toggles, **kwargs: Any) -> tuple[torch.Tensor, ...]:
    """A select_blocks backend whose first index differs from the reference's."""
    from nsa_core.reference.selection import select_blocks_impl

    indices, counts = select_blocks_impl(*args, **kwargs)
    indices = indices.clone()
    indices.view(-1)[0] += 1
    return indices, counts


def sliding_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(1, 8, 4, 16, generator=gen)
    k = torch.randn(1, 8, 2, 16, generator=gen)
    v = torch.randn(1, 8, 2, 16, generator=gen)
    return q, k, v


def dummy_sliding_with_hooks(
    monkeypatch: pytest.MonkeyPatch, *hooks: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The named hook toggles on (:func:`set_hooks`), the off-by-half dummy registered as the
    sliding backend (priority 10), and :func:`sliding_inputs`."""
    set_hooks(monkeypatch, *hooks)
    register_backend(Backend("sliding_attention", "dummy", off_by_half, accept, priority=10))
    return sliding_inputs()


def records(log: pytest.LogCaptureFixture, tag: str) -> list[str]:
    return [r.getMessage() for r in log.records if r.getMessage().startswith(tag + " ")]


def field(message: str, name: str) -> str:
    return message.split(f" {name}=")[1].split()[0]


def test_no_hook_toggle_leaves_the_backend_unwrapped(
    monkeypatch: pytest.MonkeyPatch, log: pytest.LogCaptureFixture
) -> None:
    q, k, v = dummy_sliding_with_hooks(monkeypatch)
    ctx = ops.op_context(q, k, v, k.shape[1], varlen=False)
    assert resolve_fn("sliding_attention", ctx, Toggles()) is off_by_half
    ops.sliding_attention(q, k, v, 4)
    assert not [r for r in log.records if r.getMessage().startswith("debug.")]


def test_shapes_hook_logs_each_tensor_argument(
    monkeypatch: pytest.MonkeyPatch, log: pytest.LogCaptureFixture
) -> None:
    q, k, v = dummy_sliding_with_hooks(monkeypatch, "NSA_DEBUG_SHAPES")
    k_strided = k.transpose(1, 2).contiguous().transpose(1, 2)
    ops.sliding_attention(q, k_strided, v, 4)
    (shapes,) = records(log, "debug.shapes")
    assert "op=sliding_attention backend=dummy" in shapes
    assert field(shapes, "q") == "[1,8,4,16]/[512,64,16,1]/float32"
    assert field(shapes, "k") == "[1,8,2,16]/[256,16,128,1]/float32"
    assert "toggles=" not in shapes
    assert not records(log, "debug.timing")
    assert not records(log, "debug.compare")


def test_timing_hook_measures_the_call(
    monkeypatch: pytest.MonkeyPatch, log: pytest.LogCaptureFixture
) -> None:
    q, k, v = dummy_sliding_with_hooks(monkeypatch, "NSA_DEBUG_TIMING")
    ops.sliding_attention(q, k, v, 4)
    (timing,) = records(log, "debug.timing")
    assert "op=sliding_attention backend=dummy" in timing
    assert field(timing, "bucket") == "1x8x4x16/L8/float32"
    assert float(field(timing, "ms")) >= SLEEP_S * 1e3 * 0.9
    assert not records(log, "debug.shapes")


def test_compare_hook_reports_the_error_against_the_reference(
    monkeypatch: pytest.MonkeyPatch, log: pytest.LogCaptureFixture
) -> None:
    q, k, v = dummy_sliding_with_hooks(monkeypatch, "NSA_DEBUG_COMPARE")
    q.requires_grad_(True)
    out = ops.sliding_attention(q, k, v, 4)
    assert out.requires_grad  # the hook returns the backend's output untouched
    (compare,) = records(log, "debug.compare")
    assert "op=sliding_attention backend=dummy" in compare
    assert float(field(compare, "mae")) == pytest.approx(0.5, abs=1e-6)
    assert float(field(compare, "max_abs")) == pytest.approx(0.5, abs=1e-6)


def test_compare_hook_counts_integer_mismatches_per_output(
    monkeypatch: pytest.MonkeyPatch, log: pytest.LogCaptureFixture
) -> None:
    set_hooks(monkeypatch, "NSA_DEBUG_COMPARE")
    register_backend(Backend("select_blocks", "dummy", one_index_off, accept, priority=10))
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 32, 4, 16, generator=gen)
    k_cmp = torch.randn(1, 4, 2, 16, generator=gen)
    indices, counts = ops.select_blocks(q, k_cmp, 8, 8, 8, 2)
    (compare,) = records(log, "debug.compare")
    assert field(compare, "mismatches_0") == f"1/{indices.numel()}"
    assert field(compare, "mismatches_1") == f"0/{counts.numel()}"


def test_reference_is_not_compared_with_itself_but_keeps_the_other_hooks(
    monkeypatch: pytest.MonkeyPatch, log: pytest.LogCaptureFixture
) -> None:
    set_hooks(monkeypatch, *HOOK_TOGGLES)
    q, k, v = sliding_inputs()
    ops.sliding_attention(q, k, v, 4)
    assert "backend=reference" in records(log, "debug.shapes")[0]
    assert "backend=reference" in records(log, "debug.timing")[0]
    assert not records(log, "debug.compare")
