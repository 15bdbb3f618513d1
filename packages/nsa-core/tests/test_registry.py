"""The backend registry: the reference is always there, resolution is by priority and support,
every rejection carries its reason, and the decision is observable."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch

from nsa_core import registry
from nsa_core.core import attention_core_reference
from nsa_core.reference.combine import gated_combine_impl
from nsa_core.reference.compressed_attention import compressed_attention_impl
from nsa_core.reference.rope import apply_rope_impl
from nsa_core.reference.selected_attention import selected_attention_impl
from nsa_core.reference.selection import select_blocks_impl
from nsa_core.reference.sliding_attention import sliding_attention_impl
from nsa_core.registry import (
    CORE_OP,
    OPS,
    STEP_OPS,
    Backend,
    OpContext,
    Resolution,
    backends,
    register_backend,
    resolve,
    routing_report,
)
from nsa_core.toggles import Toggles

# The reference bodies each op's "reference" backend runs (after the public op validated).
REFERENCE_FNS: dict[str, Callable[..., Any]] = {
    "attention_core": attention_core_reference,
    "apply_rope": apply_rope_impl,
    # It takes the keyword lse, which the reference does not read.
    "select_blocks": select_blocks_impl,
    "compressed_attention": compressed_attention_impl,
    "selected_attention": selected_attention_impl,
    "sliding_attention": sliding_attention_impl,
    "gated_combine": gated_combine_impl,
}


def body(backend: Backend) -> Callable[..., Any]:
    """The reference body a reference backend runs: the step references are wrapped to drop
    the toggles; the core's reference takes them."""
    fn: Callable[..., Any] = getattr(backend.fn, "__wrapped__", backend.fn)
    return fn


def context(**overrides: Any) -> OpContext:
    base = OpContext(
        device=torch.device("cpu"),
        dtype=torch.float32,
        seq_len=128,
        num_q_heads=8,
        num_kv_heads=2,
        head_dim_qk=64,
        head_dim_v=32,
        requires_grad=False,
        varlen=False,
    )
    return replace(base, **overrides)


def accept(ctx: OpContext, toggles: Toggles) -> str | None:
    return None


def reject_because(reason: str) -> Callable[[OpContext, Toggles], str | None]:
    def supports(ctx: OpContext, toggles: Toggles) -> str | None:
        return reason

    return supports


def only_float64(ctx: OpContext, toggles: Toggles) -> str | None:
    return None if ctx.dtype == torch.float64 else f"dtype {ctx.dtype} is not float64"


def dummy(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("the registry must not call a backend's fn")


def sel_triton_rejecting(reason: str) -> Backend:
    """A "triton" selected-attention backend (priority 10) that NSA_SEL_TRITON asks for and
    that rejects every call with ``reason``."""
    return Backend(
        "selected_attention",
        "triton",
        dummy,
        reject_because(reason),
        priority=10,
        requested_by=lambda toggles: toggles.sel_triton,
    )


def test_reference_backends_registered_for_every_op() -> None:
    """In the live registry (entry points included), every op ends in the reference."""
    for op in OPS:
        rows = backends(op)
        refs = [b for b in rows if b.name == "reference"]
        assert len(refs) == 1, op
        assert body(refs[0]) is REFERENCE_FNS[op]
        assert refs[0].priority == 0
        assert [b.priority for b in rows] == sorted((b.priority for b in rows), reverse=True)


@pytest.mark.usefixtures("isolated_registry")
@pytest.mark.parametrize(
    "ctx",
    [
        context(),
        context(device=torch.device("meta")),
        context(dtype=torch.bfloat16, varlen=True, requires_grad=True),
    ],
)
def test_reference_accepts_every_context(ctx: OpContext) -> None:
    for op in OPS:
        res = resolve(op, ctx, Toggles())
        assert res.backend.name == "reference"
        assert body(res.backend) is REFERENCE_FNS[op]
        assert res.rejected == ()


@pytest.mark.usefixtures("isolated_registry")
def test_resolve_picks_highest_priority_that_supports() -> None:
    op = "selected_attention"
    register_backend(Backend(op, "f64-only", dummy, only_float64, priority=20))
    register_backend(Backend(op, "always", dummy, accept, priority=10))
    register_backend(Backend(op, "low", dummy, accept, priority=5))

    res = resolve(op, context(dtype=torch.float64), Toggles())
    assert res.backend.name == "f64-only"
    assert res.rejected == ()

    res = resolve(op, context(dtype=torch.float32), Toggles())
    assert res.backend.name == "always"
    assert res.rejected == (("f64-only", "dtype torch.float32 is not float64"),)

    # Other ops are untouched.
    assert resolve("sliding_attention", context(), Toggles()).backend.name == "reference"


@pytest.mark.usefixtures("isolated_registry")
def test_every_rejection_carries_its_reason_in_priority_order() -> None:
    op = "compressed_attention"
    register_backend(Backend(op, "b", dummy, reject_because("needs CUDA"), priority=2))
    register_backend(Backend(op, "a", dummy, reject_because("seq_len < 1024"), priority=3))
    register_backend(Backend(op, "c", dummy, reject_because("no varlen"), priority=1))
    res = resolve(op, context(), Toggles())
    assert isinstance(res, Resolution)
    assert res.op == op
    assert res.backend.name == "reference"
    assert res.rejected == (("a", "seq_len < 1024"), ("b", "needs CUDA"), ("c", "no varlen"))


@pytest.mark.usefixtures("isolated_registry")
def test_supports_sees_the_toggles() -> None:
    op = "sliding_attention"

    def fa2_if_enabled(ctx: OpContext, toggles: Toggles) -> str | None:
        return None if toggles.win_fa2 else "NSA_WIN_FA2=0"

    register_backend(Backend(op, "fa2", dummy, fa2_if_enabled, priority=10))
    assert resolve(op, context(), Toggles(win_fa2=True)).backend.name == "fa2"
    res = resolve(op, context(), Toggles(win_fa2=False))
    assert res.backend.name == "reference"
    assert res.rejected == (("fa2", "NSA_WIN_FA2=0"),)


@pytest.mark.usefixtures("isolated_registry")
def test_same_name_replaces_earlier_registration() -> None:
    op = "selected_attention"
    register_backend(Backend(op, "triton", dummy, reject_because("old"), priority=10))
    register_backend(Backend(op, "triton", dummy, accept, priority=10))
    assert [b.name for b in backends(op)] == ["triton", "reference"]
    assert resolve(op, context(), Toggles()).backend.name == "triton"


@pytest.mark.usefixtures("isolated_registry")
def test_requested_backend_rejection_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    op = "selected_attention"
    register_backend(sel_triton_rejecting("sm 8.9 falls back"))
    register_backend(Backend(op, "quiet", dummy, reject_because("not asked for"), priority=5))
    with caplog.at_level(logging.WARNING, logger="nsa"):
        for _ in range(3):
            assert resolve(op, context(), Toggles(sel_triton=True)).backend.name == "reference"
    fallback = [r for r in caplog.records if "registry.fallback" in r.getMessage()]
    assert len(fallback) == 1
    message = fallback[0].getMessage()
    assert fallback[0].levelno == logging.WARNING
    assert "backend=triton" in message
    assert f"op={op}" in message
    assert "sm 8.9 falls back" in message
    assert "quiet" not in caplog.text  # nobody asked for it: its rejection is not a fallback


@pytest.mark.usefixtures("isolated_registry")
def test_unrequested_rejection_is_not_logged(caplog: pytest.LogCaptureFixture) -> None:
    op = "selected_attention"
    register_backend(sel_triton_rejecting("disabled"))
    with caplog.at_level(logging.WARNING, logger="nsa"):
        resolve(op, context(), Toggles(sel_triton=False))
    assert "registry.fallback" not in caplog.text


@pytest.mark.usefixtures("isolated_registry")
def test_routing_report_shows_every_op() -> None:
    register_backend(
        Backend("selected_attention", "triton", dummy, reject_because("needs CUDA"), priority=10)
    )
    register_backend(Backend("sliding_attention", "fa2", dummy, accept, priority=10))
    report = routing_report(context(), Toggles())
    lines = report.splitlines()
    order = (CORE_OP, *STEP_OPS)
    assert len(lines) == len(order)
    for op, line in zip(order, lines, strict=True):
        assert line.startswith(op)
    by_op = dict(zip(order, lines, strict=True))
    assert "-> reference" in by_op[CORE_OP]
    assert "-> reference" in by_op["compressed_attention"]
    assert "passed over" not in by_op["compressed_attention"]
    assert "-> reference" in by_op["selected_attention"]
    assert "triton: needs CUDA" in by_op["selected_attention"]
    assert "-> fa2" in by_op["sliding_attention"]


@pytest.mark.usefixtures("isolated_registry")
def test_unknown_op_raises() -> None:
    with pytest.raises(ValueError, match=r"unknown op 'dense_attention'.*selected_attention"):
        register_backend(Backend("dense_attention", "x", dummy, accept))
    with pytest.raises(ValueError, match="unknown op 'dense_attention'"):
        resolve("dense_attention", context(), Toggles())
    with pytest.raises(ValueError, match="unknown op 'dense_attention'"):
        backends("dense_attention")


@pytest.mark.usefixtures("isolated_registry")
def test_no_backend_accepting_raises_with_rejections() -> None:
    """Only reachable when the reference is gone; the error lists every reason."""
    registry._backends["sliding_attention"] = []
    register_backend(Backend("sliding_attention", "x", dummy, reject_because("never")))
    with pytest.raises(RuntimeError, match=r"no backend accepts op 'sliding_attention'.*never"):
        resolve("sliding_attention", context(), Toggles())


@pytest.mark.usefixtures("isolated_registry")
def test_entry_points_register_backends_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The nsa.backends group: each entry point's callable receives register_backend."""
    calls: list[str] = []

    def register_fake(register: Callable[[Backend], None]) -> None:
        calls.append("registered")
        register(Backend("sliding_attention", "plugin", dummy, accept, priority=7))

    class FakeEntryPoint:
        name = "fake"
        value = "fake_pkg.registration:register"

        def load(self) -> Callable[[Callable[[Backend], None]], None]:
            return register_fake

    def fake_entry_points(*, group: str) -> list[FakeEntryPoint]:
        assert group == registry.ENTRY_POINT_GROUP
        return [FakeEntryPoint()]

    monkeypatch.setattr(registry, "entry_points", fake_entry_points)
    registry._entry_points_loaded = False
    assert resolve("sliding_attention", context(), Toggles()).backend.name == "plugin"
    assert resolve("sliding_attention", context(), Toggles()).backend.name == "plugin"
    assert calls == ["registered"]
    assert [b.name for b in backends("sliding_attention")] == ["plugin", "reference"]


def test_op_context_group_size_and_capability() -> None:
    ctx = context(num_q_heads=12, num_kv_heads=4)
    assert ctx.group_size == 3
    assert ctx.device_capability is None  # not a CUDA device


@pytest.mark.usefixtures("isolated_registry")
def test_module_routes_through_registry() -> None:
    """NSAAttention calls whatever the registry resolves, for each of its ops."""
    from nsa_core import NSAAttention, NSAConfig

    called: list[str] = []

    def spy(op: str) -> Callable[..., Any]:
        reference = REFERENCE_FNS[op]

        def fn(*args: Any, toggles: Toggles, **kwargs: Any) -> Any:
            called.append(op)
            if op == CORE_OP:  # the core's reference runs the steps it resolves: the spies
                return reference(*args, toggles=toggles, **kwargs)
            return reference(*args, **kwargs)

        return fn

    for op in OPS:
        register_backend(Backend(op, "spy", spy(op), accept, priority=1))
    cfg = NSAConfig(
        num_q_heads=2,
        num_kv_heads=1,
        head_dim_qk=4,
        head_dim_v=4,
        cmp_block=4,
        cmp_stride=2,
        sel_block=4,
        num_selected=3,
        window=3,
    )
    layer = NSAAttention(cfg, 8)
    layer(torch.randn(1, 10, 8))
    # The core and each step once, and rotary embedding for q and for each branch's k.
    assert sorted(called) == sorted([*OPS, *["apply_rope"] * 3])


@pytest.mark.usefixtures("isolated_registry")
def test_backend_toggle_pins_the_backend_over_priority() -> None:
    op = "selected_attention"
    register_backend(Backend(op, "fast", dummy, accept, priority=50))
    assert resolve(op, context(), Toggles()).backend.name == "fast"
    assert resolve(op, context(), Toggles(sel_backend="reference")).backend.name == "reference"


@pytest.mark.usefixtures("isolated_registry")
def test_backend_toggle_never_falls_back_silently() -> None:
    op = "compressed_attention"
    register_backend(Backend(op, "f64-only", dummy, only_float64, priority=20))
    with pytest.raises(RuntimeError, match="NSA_CMP_BACKEND='f64-only'"):
        resolve(op, context(dtype=torch.float32), Toggles(cmp_backend="f64-only"))
    with pytest.raises(ValueError, match=r"NSA_SCORE_BACKEND='nope'.*no such backend"):
        resolve("select_blocks", context(), Toggles(score_backend="nope"))
