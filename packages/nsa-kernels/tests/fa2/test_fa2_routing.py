"""Which FA-2 / fallback backend serves a call, and why the others refused (CPU)."""

from __future__ import annotations

import logging

import pytest
import torch
from kernel_testlib import op_context as ctx

from nsa_core import registry
from nsa_core.debug_log import reset_log_state
from nsa_core.registry import Backend, resolve
from nsa_core.toggles import Toggles
from nsa_kernels.common import flash as _flash
from nsa_kernels.common.fa2_routing import (
    FLEX_MIN_LEN,
    fa2_compressed_supports,
    fa2_sliding_supports,
    flex_supports,
    sdpa_compressed_supports,
    sdpa_supports,
)
from nsa_kernels.compressed.backends import backends as compressed_backends
from nsa_kernels.sliding.backends import backends as sliding_backends


def backends() -> list[Backend]:
    """The FA-2 family's rows of both branches' tables."""
    return [*compressed_backends(), *sliding_backends()]


@pytest.fixture
def isolated_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Register this package's backends into a copy of the registry, dropped after the test."""
    registry.load_entry_points()
    monkeypatch.setattr(
        registry, "_backends", {op: list(b) for op, b in registry._backends.items()}
    )
    for backend in backends():
        registry.register_backend(backend)
    reset_log_state()


def test_backend_table() -> None:
    table = {(b.op, b.name): b.priority for b in backends()}
    assert table == {
        ("sliding_attention", "fa2"): 30,
        ("compressed_attention", "cudnn"): 35,
        ("compressed_attention", "fa2"): 30,
        ("compressed_attention", "triton_cmp"): 25,
        ("sliding_attention", "triton_win"): 25,
        ("sliding_attention", "flex"): 20,
        ("compressed_attention", "flex"): 20,
        ("sliding_attention", "sdpa"): 10,
        ("compressed_attention", "sdpa"): 10,
    }
    # FA-2 is on by default: where it is installed and declines, the refusal is logged.
    requested = {(b.op, b.name) for b in backends() if b.requested_by(Toggles())}
    assert requested == {("sliding_attention", "fa2"), ("compressed_attention", "fa2")}
    assert not any(b.requested_by(Toggles(win_fa2=False, cmp_fa2=False)) for b in backends())


def test_fa2_off_only_turns_off_fa2() -> None:
    off = Toggles(win_fa2=False, cmp_fa2=False)
    for supports, step in ((fa2_sliding_supports, "WIN"), (fa2_compressed_supports, "CMP")):
        assert f"NSA_{step}_FA2 is off" in str(supports(ctx(device="cuda"), off))
    assert sdpa_supports(ctx(device="cuda"), off) is None


def test_sdpa_serves_cuda_and_cpu_only_when_pinned() -> None:
    assert sdpa_supports(ctx(device="cuda"), Toggles()) is None
    assert "the reference serves cpu" in str(sdpa_supports(ctx(device="cpu"), Toggles()))
    assert sdpa_supports(ctx(device="cpu"), Toggles(win_backend="sdpa")) is None


def test_pinning_sdpa_for_one_branch_leaves_the_other_branch_on_its_route() -> None:
    cpu = ctx(device="cpu")
    assert sdpa_compressed_supports(cpu, Toggles(cmp_backend="sdpa")) is None
    assert "pin NSA_CMP_BACKEND=sdpa" in str(sdpa_compressed_supports(cpu, Toggles()))
    assert "pin NSA_CMP_BACKEND=sdpa" in str(
        sdpa_compressed_supports(cpu, Toggles(win_backend="sdpa"))
    )
    assert "pin NSA_WIN_BACKEND=sdpa" in str(sdpa_supports(cpu, Toggles(cmp_backend="sdpa")))


def test_fa2_reasons_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    on = Toggles(win_fa2=True, cmp_fa2=True, win_fa2_min_len=64, cmp_fa2_min_len=128)
    assert "CUDA device" in str(fa2_sliding_supports(ctx(device="cpu"), on))
    # Past the device check the answer depends on flash_attn and the GPU; pretend both are there.
    monkeypatch.setattr(_flash, "_module", object())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fa2_sliding_supports(ctx(device="cuda"), on) is None
    assert "float16 or bfloat16" in str(fa2_sliding_supports(ctx("cuda", torch.float32), on))
    assert "head dims <= 256" in str(fa2_sliding_supports(ctx("cuda", dk=264, dv=8), on))
    assert fa2_sliding_supports(ctx("cuda", dk=192, dv=128), on) is None
    assert "NSA_WIN_FA2_MIN_LEN=64" in str(fa2_sliding_supports(ctx("cuda", seq_len=63), on))
    assert fa2_sliding_supports(ctx("cuda", seq_len=64), on) is None
    assert "NSA_CMP_FA2_MIN_LEN=128" in str(fa2_compressed_supports(ctx("cuda", seq_len=127), on))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert "sm80" in str(fa2_sliding_supports(ctx(device="cuda"), on))


def test_fa2_missing_module_is_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_flash, "_module", None)
    monkeypatch.setattr(
        _flash, "_import_error", "ModuleNotFoundError: No module named 'flash_attn'"
    )
    reason = fa2_sliding_supports(ctx(device="cuda"), Toggles(win_fa2=True, cmp_fa2=True))
    assert reason is not None
    assert "flash_attn is not importable" in reason


def test_flex_reasons() -> None:
    on = Toggles(win_fa2=True, cmp_fa2=True)
    assert "on CUDA" in str(flex_supports(ctx(device="cpu"), on))
    assert "power-of-two group size" in str(flex_supports(ctx("cuda", hq=12, h=4), on))
    assert f"< {FLEX_MIN_LEN}" in str(flex_supports(ctx("cuda", seq_len=FLEX_MIN_LEN - 1), on))
    assert flex_supports(ctx("cuda", seq_len=FLEX_MIN_LEN), on) is None
    fp32 = torch.float32
    assert "shared memory" in str(flex_supports(ctx("cuda", dtype=fp32, dk=192), on))
    assert flex_supports(ctx("cuda", dtype=fp32, dk=128), on) is None
    assert flex_supports(ctx("cuda", dk=192), on) is None  # bf16 fits


@pytest.mark.usefixtures("isolated_registry")
def test_registry_falls_back_and_logs_once(caplog: pytest.LogCaptureFixture) -> None:
    on = Toggles()
    for op in ("sliding_attention", "compressed_attention"):
        assert (
            resolve(op, ctx(device="cpu"), Toggles(win_fa2=False, cmp_fa2=False)).backend.name
            == "reference"
        )
        with caplog.at_level(logging.WARNING, logger="nsa"):
            caplog.clear()
            first = resolve(op, ctx(device="cpu"), on)
            again = resolve(op, ctx(device="cpu"), on)
        assert first.backend.name == again.backend.name == "reference"
        rejected = dict(first.rejected)
        assert "CUDA device" in rejected["fa2"]
        assert "on CUDA" in rejected["flex"]
        assert "the reference serves cpu" in rejected["sdpa"]
        fallback_logs = [r for r in caplog.records if "registry.fallback" in r.getMessage()]
        assert len(fallback_logs) == 1
        assert "backend=fa2" in fallback_logs[0].getMessage()
    pinned = Toggles(win_backend="sdpa", cmp_backend="sdpa")
    report = registry.routing_report(ctx(device="cpu"), pinned)
    assert "sliding_attention      -> sdpa" in report
    assert "compressed_attention   -> sdpa" in report
