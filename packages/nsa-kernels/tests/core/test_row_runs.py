"""A branch output as runs of rows (``RowRuns``), and the core handing the compressed branch's
runs to the selected step's one-launch sum without putting them in one tensor first: where that
step's backend takes runs (``gated_runs``) it gets them as they are; everywhere else it gets
the one tensor they make up, and the layer's output is the all-reference one either way."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import nsa_core
from nsa_core import NSAConfig, ops, registry
from nsa_core.reference.combine import gated_combine_impl
from nsa_core.reference.compressed_attention import compressed_attention_impl
from nsa_core.reference.selected_attention import selected_attention_impl
from nsa_core.registry import Backend, OpContext, register_backend
from nsa_kernels.common.row_runs import RowRuns, as_tensor
from nsa_core.toggles import Toggles

CONFIG = NSAConfig(
    num_q_heads=4,
    num_kv_heads=2,
    head_dim_qk=8,
    head_dim_v=8,
    cmp_block=4,
    cmp_stride=2,
    sel_block=4,
    num_selected=3,
    window=3,
)


def accept(ctx: OpContext, toggles: Toggles) -> str | None:
    return None


def test_assemble_puts_zero_rows_then_the_runs_in_order() -> None:
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 3, 4, 5, generator=gen), torch.randn(2, 4, 4, 5, generator=gen)
    runs = RowRuns(start=2, runs=(a, b))
    assert runs.shape == (2, 9, 4, 5)
    whole = runs.assemble()
    assert whole.shape == (2, 9, 4, 5)
    assert torch.equal(whole[:, :2], torch.zeros(2, 2, 4, 5))
    assert torch.equal(whole[:, 2:5], a)
    assert torch.equal(whole[:, 5:], b)
    assert as_tensor(runs).shape == whole.shape


def test_one_run_from_row_0_is_the_tensor_itself() -> None:
    x = torch.randn(1, 6, 2, 3)
    assert RowRuns.whole(x).assemble() is x
    assert as_tensor(x) is x


@pytest.mark.parametrize(
    ("runs", "start", "match"),
    [
        ((), 0, "at least one run"),
        ((torch.zeros(1, 2, 3, 4),), -1, "start"),
        ((torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 2, 4)), 0, "differs"),
        ((torch.zeros(1, 2, 3, 4), torch.zeros(2, 2, 3, 4)), 0, "differs"),
        ((torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4, dtype=torch.float64)), 0, "dtype"),
        ((torch.zeros(1, 2, 4, 3).transpose(-1, -2),), 0, "unit stride"),
        ((torch.zeros(2, 3, 4),), 0, "runs\\[0\\]"),
    ],
)
def test_runs_are_checked(runs: tuple[torch.Tensor, ...], start: int, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        RowRuns(start=start, runs=runs)


class RunsSpy:
    """A compressed backend whose ``fn_runs_with_lse`` gives the reference's o as runs (zero
    rows before l - 1, then two runs in storage of their own), and a selected backend whose
    ``fn_gated`` records what o_cmp it got and sums the three branches (the reference ops)."""

    def __init__(self, gated_runs: bool, gated_grad: bool = False) -> None:
        self.gated_runs = gated_runs
        self.gated_grad = gated_grad
        self.o_cmp_given: list[Any] = []
        self.combine_given: list[Any] = []

    def cmp_runs(self, *args: Any, toggles: Toggles, **kwargs: Any) -> Any:
        o = compressed_attention_impl(*args, **kwargs)
        start, cut = CONFIG.cmp_block - 1, o.shape[1] // 2 + 1
        runs = (o[:, start:cut].clone(), o[:, cut:].clone())
        return RowRuns(start=start, runs=runs), None

    def gated(
        self, *args: Any, o_cmp: Any, o_win: Any, gates: Any, toggles: Toggles, **kwargs: Any
    ) -> Any:
        self.o_cmp_given.append(o_cmp)
        o_slc = selected_attention_impl(*args, **kwargs)
        return gated_combine_impl(as_tensor(o_cmp), o_slc, o_win, gates)

    def combine(self, *args: Any, toggles: Toggles, **kwargs: Any) -> Any:
        self.combine_given.append(args[0])
        return gated_combine_impl(*args, **kwargs)

    def register(self, *, gated: bool = True) -> None:
        register_backend(
            Backend(
                "compressed_attention",
                "cmp_runs_spy",
                lambda *a, toggles, **k: compressed_attention_impl(*a, **k),
                accept,
                priority=5,
                fn_runs_with_lse=self.cmp_runs,
            )
        )
        register_backend(
            Backend(
                "selected_attention",
                "sel_spy",
                lambda *a, toggles, **k: selected_attention_impl(*a, **k),
                accept,
                priority=5,
                fn_gated=self.gated if gated else None,
                gated_grad=self.gated_grad,
                gated_runs=self.gated_runs,
            )
        )
        register_backend(Backend("gated_combine", "combine_spy", self.combine, accept, priority=5))


def _inputs(gen: torch.Generator, t: int = 15) -> list[torch.Tensor]:
    q = torch.randn(1, t, 4, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(1, t, 2, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(1, t, 2, 8, generator=gen, dtype=torch.float64)
    gates = torch.rand(1, t, 4, 3, generator=gen, dtype=torch.float64)
    return [q, k, v, gates]


@pytest.mark.usefixtures("isolated_registry")
@pytest.mark.parametrize("gated_runs", [True, False], ids=["takes_runs", "takes_tensors"])
def test_core_hands_the_runs_to_a_gated_step_that_takes_them(
    gen: torch.Generator, gated_runs: bool
) -> None:
    inputs = _inputs(gen)
    want = nsa_core.nsa_attention(*inputs, CONFIG)  # all reference
    spy = RunsSpy(gated_runs)
    spy.register()
    with torch.no_grad():
        out = nsa_core.nsa_attention(*inputs, CONFIG)
    assert len(spy.o_cmp_given) == 1
    given = spy.o_cmp_given[0]
    assert isinstance(given, RowRuns) == gated_runs
    if gated_runs:
        assert given.start == CONFIG.cmp_block - 1
        assert len(given.runs) == 2
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.usefixtures("isolated_registry")
def test_core_assembles_the_runs_for_the_combine_when_no_gated_step_serves(
    gen: torch.Generator,
) -> None:
    inputs = _inputs(gen)
    want = nsa_core.nsa_attention(*inputs, CONFIG)
    spy = RunsSpy(gated_runs=True)
    spy.register(gated=False)
    with torch.no_grad():
        out = nsa_core.nsa_attention(*inputs, CONFIG)
    assert len(spy.combine_given) == 1
    assert isinstance(spy.combine_given[0], torch.Tensor)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.usefixtures("isolated_registry")
@pytest.mark.parametrize("gated_runs", [True, False], ids=["takes_runs", "takes_tensors"])
def test_runs_that_take_a_gradient_reach_the_gated_step_as_it_takes_them(
    gen: torch.Generator, gated_runs: bool
) -> None:
    """With a gradient too, a gated step that takes runs gets them as they are (each run an
    input of the graph) and one that does not gets the assembled tensor (a differentiable
    copy); the routing sees the runs' need of a gradient either way. Each run's gradient is
    g_cmp on its rows, on every channel."""
    q, k, v, gates = _inputs(gen)
    spy = RunsSpy(gated_runs=gated_runs, gated_grad=True)
    spy.register()
    o_win = torch.randn(1, q.shape[1], 4, 8, generator=gen, dtype=torch.float64)
    head = torch.randn(1, 6, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    tail = torch.randn(1, 6, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    idx, _ = ops.select_blocks(q, nsa_core.compress(k, 4, 2), 4, 2, 4, 3)
    out = ops.selected_attention_gated(
        q, k, v, idx, 4, o_cmp=RowRuns(start=3, runs=(head, tail)), o_win=o_win, gates=gates
    )
    assert out is not None
    given = spy.o_cmp_given[-1]
    assert isinstance(given, RowRuns) == gated_runs
    if gated_runs:
        assert given.runs[0] is head
        assert given.runs[1] is tail
    out.sum().backward()
    g_cmp = gates[..., 0:1].expand(-1, -1, -1, 8)
    assert head.grad is not None
    assert tail.grad is not None
    torch.testing.assert_close(head.grad, g_cmp[:, 3:9], rtol=0, atol=0)
    torch.testing.assert_close(tail.grad, g_cmp[:, 9:], rtol=0, atol=0)


@pytest.mark.usefixtures("isolated_registry")
def test_a_gated_step_without_gradient_support_is_passed_over_for_runs_that_need_one(
    gen: torch.Generator,
) -> None:
    """The runs' need of a gradient reaches the routing: a gated step without one
    (``gated_grad`` False) is not called, and the caller runs the two ops."""
    q, k, v, gates = _inputs(gen)
    spy = RunsSpy(gated_runs=True, gated_grad=False)
    spy.register()
    o_win = torch.randn(1, q.shape[1], 4, 8, generator=gen, dtype=torch.float64)
    head = torch.randn(1, 6, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    tail = torch.randn(1, 6, 4, 8, generator=gen, dtype=torch.float64)
    idx, _ = ops.select_blocks(q, nsa_core.compress(k, 4, 2), 4, 2, 4, 3)
    out = ops.selected_attention_gated(
        q, k, v, idx, 4, o_cmp=RowRuns(start=3, runs=(head, tail)), o_win=o_win, gates=gates
    )
    assert out is None
    assert spy.o_cmp_given == []


def test_assembled_runs_give_each_run_its_rows_of_the_gradient(gen: torch.Generator) -> None:
    head = torch.randn(1, 4, 2, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    tail = torch.randn(1, 2, 2, 3, generator=gen, dtype=torch.float64, requires_grad=True)
    whole = RowRuns(start=3, runs=(head, tail)).assemble()
    assert whole.shape == (1, 9, 2, 3)
    torch.testing.assert_close(whole[:, :3], torch.zeros(1, 3, 2, 3, dtype=torch.float64))
    torch.testing.assert_close(whole[:, 3:7], head, rtol=0, atol=0)
    torch.testing.assert_close(whole[:, 7:], tail, rtol=0, atol=0)
    up = torch.randn(1, 9, 2, 3, generator=gen, dtype=torch.float64)
    whole.backward(up)
    assert head.grad is not None
    assert tail.grad is not None
    torch.testing.assert_close(head.grad, up[:, 3:7], rtol=0, atol=0)
    torch.testing.assert_close(tail.grad, up[:, 7:], rtol=0, atol=0)


@pytest.mark.usefixtures("isolated_registry")
def test_without_fn_runs_the_compressed_output_is_one_run(gen: torch.Generator) -> None:
    q, k, v, _ = _inputs(gen)
    k_cmp, v_cmp = nsa_core.compress(k, 4, 2), nsa_core.compress(v, 4, 2)
    runs, lse = ops.compressed_attention_runs_with_lse(q, k_cmp, v_cmp, 4, 2)
    assert lse is None
    assert runs.start == 0
    assert len(runs.runs) == 1
    torch.testing.assert_close(
        runs.runs[0], nsa_core.compressed_attention(q, k_cmp, v_cmp, 4, 2), rtol=0, atol=0
    )


@pytest.mark.usefixtures("isolated_registry")
@pytest.mark.parametrize(
    ("gated_runs", "requires_grad", "gated_grad", "shown"),
    [
        (True, False, True, True),
        (False, False, True, False),
        (True, True, True, True),
        (True, True, False, False),
    ],
    ids=["runs_no_grad", "gated_step_takes_tensors", "with_grad", "gated_step_without_grad"],
)
def test_routing_report_says_where_the_compressed_output_goes_as_runs(
    gated_runs: bool, requires_grad: bool, gated_grad: bool, shown: bool
) -> None:
    spy = RunsSpy(gated_runs=gated_runs, gated_grad=gated_grad)
    spy.register()
    ctx = OpContext.for_config(
        CONFIG, device=torch.device("cpu"), dtype=torch.float32, seq_len=64,
        requires_grad=requires_grad,
    )  # fmt: skip
    line = next(x for x in registry.routing_report(ctx).splitlines() if "compressed_attention" in x)
    assert line.startswith("compressed_attention   -> cmp_runs_spy")
    assert ("as runs of rows" in line) == shown
    if shown:
        assert ("with grad" if requires_grad else "no grad") in line
