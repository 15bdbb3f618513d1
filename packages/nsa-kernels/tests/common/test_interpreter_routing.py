"""Under ``TRITON_INTERPRET=1`` the Triton backends decline the dtypes the interpreter computes
wrongly, with the reason, so that the registry routes such a call elsewhere.

The interpreter also runs CUDA tensors (it copies them to the host), so a GPU host with the
variable set would otherwise pick the Triton rows for a bfloat16 call and get garbage back.
These tests ask the rows about a CUDA bfloat16 call on any machine: ``supports`` reads the
call's context and the setting (read at each call, here set by the test), and runs nothing.
"""

from __future__ import annotations

import pytest
import torch
from kernel_testlib import op_context

from nsa_core.registry import (
    CORE_OP,
    STEP_OPS,
    Backend,
    isolated_registry,
    register_backend,
    resolve,
    routing_report,
)
from nsa_core.toggles import Toggles
from nsa_kernels.common.triton_inputs import interpreter_active
from nsa_kernels.registration import all_backends

# The rows whose kernels multiply in tl.dot, the one defined bit for bit, and the one that
# computes every dtype right in the interpreter.
DOT_ROWS = ("triton_score", "triton_cmp", "triton_sel", "triton_win", "fused")
ROUNDING_ROWS = ("triton_rope",)
EXACT_ROWS = ("triton_combine",)
DOT_REASON = "bfloat16 under TRITON_INTERPRET=1: Triton's interpreter multiplies bfloat16 tl.dot"
ROUNDING_REASON = "bfloat16 under TRITON_INTERPRET=1: Triton's interpreter rounds float32 to"


@pytest.fixture
def on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device facts a CUDA context asks for (the selected row's device policy), as an SM 9.0
    GPU gives them, on a machine that may have none."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))


def triton_rows() -> dict[str, Backend]:
    names = (*DOT_ROWS, *ROUNDING_ROWS, *EXACT_ROWS)
    return {row.name: row for row in all_backends() if row.name in names}


def test_interpreter_active_reads_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert interpreter_active()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not interpreter_active()
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not interpreter_active()


@pytest.mark.usefixtures("on_a_gpu")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rows_decline_bfloat16_only_under_the_interpreter(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = triton_rows()
    assert set(rows) == {*DOT_ROWS, *ROUNDING_ROWS, *EXACT_ROWS}
    ctx = op_context("cuda", dtype)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for name, row in rows.items():
        assert row.supports(ctx, Toggles()) is None, name
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for name, row in rows.items():
        reason = row.supports(ctx, Toggles())
        if dtype != torch.bfloat16 or name in EXACT_ROWS:
            assert reason is None, name
        elif name in DOT_ROWS:
            assert reason is not None
            assert reason.startswith(DOT_REASON), name
        else:
            assert reason is not None
            assert reason.startswith(ROUNDING_REASON), name


@pytest.mark.usefixtures("on_a_gpu")
def test_routing_passes_over_the_rows_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the kernels' rows installed, a CUDA bfloat16 call under the interpreter runs the
    reference for every op but the combine, and the routing report names the reason."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ctx = op_context("cuda", torch.bfloat16)
    with isolated_registry():
        for row in triton_rows().values():
            register_backend(row)
        chosen = {op: resolve(op, ctx, Toggles()).backend.name for op in (CORE_OP, *STEP_OPS)}
        report = routing_report(ctx, Toggles())
    assert chosen.pop("gated_combine") == "triton_combine"
    assert set(chosen.values()) == {"reference"}, chosen
    for name in DOT_ROWS:
        assert f"{name}: {DOT_REASON}" in report, name
    assert f"triton_rope: {ROUNDING_REASON}" in report
