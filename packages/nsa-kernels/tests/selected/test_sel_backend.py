"""Routing of the Triton selection backend (no kernels run) and its debug hooks (kernels run)."""

from __future__ import annotations

import logging
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from kernel_testlib import DEVICE, SKIP_REASON, op_context
from sel_testlib import Case, make_inputs

from nsa_core import registry
from nsa_core.debug_log import reset_log_state
from nsa_core.toggles import Toggles, reload_toggles
from nsa_kernels.selected.backend import (
    DEVICE_POLICY,
    alignment_reason,
    backends,
    decline_reason,
    device_policy,
    supports,
)

CUDA_OK: dict[str, Any] = dict(
    device_type="cuda",
    capability=(9, 0),
    dtype=torch.bfloat16,
    dk=128,
    dv=128,
    seq_len=4096,
    requires_grad=False,
)


def reason(toggles: Toggles | None = None, **overrides: Any) -> str | None:
    return decline_reason(toggles or Toggles(), **{**CUDA_OK, **overrides})


def test_serves_hopper_bf16_by_default() -> None:
    assert reason() is None


def test_declines_each_rule_with_its_reason() -> None:
    assert reason(device_type="cpu") == "needs a CUDA device, got cpu"
    assert reason(Toggles(sel_triton=False)) == "NSA_SEL_TRITON=0"
    assert reason(Toggles(sel_triton=False, sel_triton_force=True)) is None
    assert reason(Toggles(sel_triton_grad=False), requires_grad=True) == (
        "gradients are required and NSA_SEL_TRITON_GRAD=0"
    )
    assert reason(Toggles(sel_triton_grad=False)) is None
    assert reason(Toggles(sel_triton_min_len=8192)) == "seq_len=4096 < NSA_SEL_TRITON_MIN_LEN=8192"
    assert reason(dtype=torch.float64) is not None
    assert "float64" in str(reason(dtype=torch.float64))
    assert "dk=72" in str(reason(dk=72))
    assert "dv=512" in str(reason(dv=512))


def test_device_policy_is_one_table() -> None:
    ada = reason(capability=(8, 9))
    assert ada is not None
    assert "NSA_SEL_TRITON_FORCE" in ada
    assert reason(Toggles(sel_triton_force=True), capability=(8, 9)) is None
    assert device_policy((8, 9)).decision == "fallback"
    turing = reason(Toggles(sel_triton_force=True), capability=(7, 5))
    assert turing == device_policy((7, 5)).reason
    assert device_policy((7, 5)).decision == "refuse"
    assert device_policy((8, 0)).decision == "use"
    assert device_policy((9, 0)).decision == "use"
    assert all(row.reason for row in DEVICE_POLICY)


def test_alignment_guard() -> None:
    assert alignment_reason(torch.float16, 64, 64) is None
    assert alignment_reason(torch.float32, 192, 128) is None
    assert alignment_reason(torch.float16, 8, 64) is not None
    assert alignment_reason(torch.int8, 64, 64) is not None


def test_registered_backend_falls_back_on_cpu_with_its_reason(
    isolated_registry: None, caplog: pytest.LogCaptureFixture
) -> None:
    (backend,) = backends()
    assert (backend.op, backend.name, backend.priority) == ("selected_attention", "triton_sel", 20)
    assert backend.requested_by(Toggles())
    assert backend.requested_by(Toggles(sel_triton=False, sel_triton_force=True))
    assert not backend.requested_by(Toggles(sel_triton=False))
    registry.register_backend(backend)
    ctx = op_context("cpu", torch.float32, seq_len=128, hq=4, h=2, dk=64, dv=64)
    assert supports(ctx, Toggles()) == "needs a CUDA device, got cpu"
    with caplog.at_level(logging.WARNING, logger="nsa"):
        res = registry.resolve("selected_attention", ctx, Toggles())
    assert res.backend.name == "reference"
    assert res.rejected == (("triton_sel", "needs a CUDA device, got cpu"),)
    assert any("triton_sel" in r.getMessage() for r in caplog.records)


@pytest.fixture
def debug_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("NSA_DEBUG_LOG", "NSA_DEBUG_SHAPES", "NSA_DEBUG_COMPARE", "NSA_DEBUG_TIMING"):
        monkeypatch.setenv(name, "1")
    reload_toggles()
    reset_log_state()
    yield
    monkeypatch.undo()
    reload_toggles()
    reset_log_state()


@pytest.mark.triton
@pytest.mark.skipif(DEVICE is None, reason=SKIP_REASON)
def test_debug_hooks_log_shapes_and_parity(
    debug_env: None, caplog: pytest.LogCaptureFixture, request: pytest.FixtureRequest
) -> None:
    """The registry's generic hooks around the Triton backend: shapes, timing, reference parity."""
    assert DEVICE is not None
    from nsa_core.debug_hooks import with_debug_hooks
    from nsa_core.toggles import get_toggles
    from nsa_kernels.selected.backend import selected_attention_backend

    reference = {b.name: b for b in registry.backends("selected_attention")}["reference"]
    hooked = with_debug_hooks(
        "selected_attention", "triton_sel", selected_attention_backend, reference.fn, get_toggles()
    )
    case = Case("debug", tq=20, h=1, group=2)
    gen = torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
    q, k, v, idx, _ = make_inputs(case, gen, torch.float32, DEVICE)
    with caplog.at_level(logging.INFO, logger="nsa"):
        hooked(q, k, v, idx, case.sel_block, toggles=get_toggles())
    messages = [r.getMessage() for r in caplog.records]
    shapes = [m for m in messages if m.startswith("debug.shapes ")]
    compare = [m for m in messages if m.startswith("debug.compare ")]
    timing = [m for m in messages if m.startswith("debug.timing ")]
    assert shapes
    assert "backend=triton_sel" in shapes[0]
    assert "q=[1,20,2,16]/" in shapes[0]
    assert compare
    mae = float(compare[0].split("mae=")[1].split()[0])
    assert mae < 1e-5
    assert timing
    assert "ms=" in timing[0]
    if DEVICE == "cuda":
        assert any(m.startswith("sel.triton.device ") for m in messages)


def test_backend_hands_the_routings_toggles_to_the_kernels_and_skips_checks_when_routed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The routing's toggles reach the kernels, not the global ones; called by name the backend
    has the kernels validate, as the registry's ``fn`` (``unchecked``) it tells them the call
    was validated already."""
    from nsa_kernels.selected import backend as backend_module
    from nsa_kernels.selected import function as function_module

    seen: dict[str, Any] = {}

    def capture(*args: Any, toggles: Any = None, validated: bool = False, **kwargs: Any) -> str:
        seen.update(toggles=toggles, validated=validated, config=kwargs.get("config"))
        return "out"

    monkeypatch.setattr(function_module, "selected_attention_triton", capture)
    routed = Toggles(sel_triton_group=False)
    q = torch.zeros(1, 4, 2, 16)
    backend_module.selected_attention_backend(q, q, q, q, 4, toggles=routed)
    assert seen == {"toggles": routed, "validated": False, "config": None}
    backend_module.selected_attention_backend.unchecked(q, q, q, q, 4, toggles=routed)
    assert seen == {"toggles": routed, "validated": True, "config": None}
    (row,) = backend_module.backends()
    assert row.fn == backend_module.selected_attention_backend.unchecked
