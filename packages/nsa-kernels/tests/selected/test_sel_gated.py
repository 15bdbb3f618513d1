"""The selected forward that sums the three branches itself (``selected_attention_gated_triton``).

It must give the gated combine (docs/spec.md, "Gated combine") of the other two branches and the
selected branch's own output, and with a gradient the gradients of all six inputs: against the
float64 reference of both steps, and against the two Triton steps run apart (the selected
kernel, then the combine kernel), for every kind of row the selected kernel serves.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from kernel_testlib import BF16_DOT_REFUSAL, BOUND, DEVICE, SKIP_REASON, refused_here, rel_err
from sel_testlib import Case, make_inputs, reference

pytest.importorskip("triton")

from nsa_core.reference.combine import gated_combine
from nsa_kernels.combine.function import combine_fwd, gated_combine_triton
from nsa_kernels.common.row_runs import RowRuns
from nsa_kernels.selected.function import (
    SelConfig,
    selected_attention_gated_triton,
    selected_attention_triton,
    tma_available,
)

F64 = torch.float64
pytestmark = [pytest.mark.triton, pytest.mark.skipif(DEVICE is None, reason=SKIP_REASON)]

FORCED = Case("forced prologue", group=3, tq=45, n=4, config={"tma": 1, "forced_tokens": 8})
FORCED_PARAM = pytest.param(
    FORCED,
    id=FORCED.name,
    marks=pytest.mark.skipif(
        not tma_available(), reason="this triton has no triton.tools.tensor_descriptor (< 3.4)"
    ),
)
CASES = [
    Case("G=1", group=1, tq=37),
    Case("G=3 empty rows", group=3, tq=29, indices="empty"),
    Case("G=16 paper l'=64", group=16, h=1, tq=70, dk=32, dv=32, sel_block=64, n=2),
    Case("q_start>0", group=2, tq=9, q_start=40),
    Case("varlen with a length-1 sequence", group=2, tq=41, seqlens=[1, 25, 15]),
    # Two programs per row along dv: each sums its own channels.
    Case("dv chunks", group=2, tq=19, dv=32, config={"block_dv": 16, "tma": 2}),
    # dk = 48 in 16-wide chunks (the pointer path of dk = 192).
    Case("dk chunks", group=2, tq=17, dk=48, config={"block_d": 16, "tma": 2}),
    # The forced blocks first, eight rows a program (nsa_kernels.selected.forced; TMA).
    FORCED_PARAM,
]


def other_branches(
    case: Case, gen: torch.Generator, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """o_cmp, o_win [B, Tq, HQ, dv] and gates [B, Tq, HQ, 3] in (0, 1), drawn in float32."""
    shape = (case.batch, case.tq, case.hq, case.dv)
    o_cmp = torch.randn(shape, generator=gen)
    o_win = torch.randn(shape, generator=gen)
    gates = torch.sigmoid(torch.randn(*shape[:3], 3, generator=gen))
    return o_cmp.to(DEVICE, dtype), o_win.to(DEVICE, dtype), gates.to(DEVICE, dtype)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gated_forward_is_the_combine_of_the_three_branches(case: Case, dtype: torch.dtype) -> None:
    """Within the spec's bound; bfloat16 under the interpreter, whose bfloat16 tl.dot is wrong, is
    refused with the reason (on a GPU it runs)."""
    assert DEVICE is not None
    gen = torch.Generator().manual_seed(7)
    q, k, v, idx, cu = make_inputs(case, gen, dtype, DEVICE)
    o_cmp, o_win, gates = other_branches(case, gen, dtype)
    cfg = SelConfig(**case.config)
    if refused_here(dtype):
        with pytest.raises(TypeError, match=BF16_DOT_REFUSAL):
            selected_attention_gated_triton(
                q, k, v, idx, case.sel_block, o_cmp=o_cmp, o_win=o_win, gates=gates,
                q_start=case.q_start, cu_seqlens=cu, config=cfg,
            )  # fmt: skip
        return
    out = selected_attention_gated_triton(
        q, k, v, idx, case.sel_block, o_cmp=o_cmp, o_win=o_win, gates=gates,
        q_start=case.q_start, cu_seqlens=cu, config=cfg,
    )  # fmt: skip
    assert out.dtype == dtype
    assert out.shape == o_cmp.shape
    # The spec's bound against the float64 reference of both steps.
    o_sel64 = reference(q, k, v, idx, case, cu)
    want64 = gated_combine(o_cmp.double(), o_sel64, o_win.double(), gates.double())
    assert rel_err(out, want64) < BOUND[dtype]
    # The two Triton steps apart: the same sum, with o_sel rounded to q's dtype first.
    o_sel = selected_attention_triton(
        q, k, v, idx, case.sel_block, q_start=case.q_start, cu_seqlens=cu, config=cfg
    )
    apart = combine_fwd(o_cmp, o_sel, o_win, gates)
    if dtype == torch.float32:
        assert rel_err(out, apart) < BOUND[dtype]
    else:
        # One rounding of o_sel apart: within two units in the last place of the output.
        ulp = torch.finfo(dtype).eps * apart.float().abs().clamp_min(1.0)
        assert ((out.float() - apart.float()).abs() <= 2 * ulp).all()


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gated_gradients_match_the_reference_and_the_two_steps_apart(case: Case) -> None:
    """With a gradient the launch stores o_sel beside the sum; the backward (the combine's
    kernel, then the selected branch's) gives q, k, v, o_cmp, o_win and gates their gradients:
    within twice the float32 bound of the float64 reference of both steps, and of the Triton
    selected step and combine run apart."""
    assert DEVICE is not None
    gen = torch.Generator().manual_seed(11)
    q, k, v, idx, cu = make_inputs(case, gen, torch.float32, DEVICE)
    o_cmp, o_win, gates = other_branches(case, gen, torch.float32)
    do = torch.randn(o_cmp.shape, generator=gen).to(DEVICE)
    cfg = SelConfig(**case.config)
    names = ("q", "k", "v", "o_cmp", "o_win", "gates")

    def grads(dtype: torch.dtype, run: Any) -> list[torch.Tensor]:
        leaves = [t.to(dtype).clone().requires_grad_() for t in (q, k, v, o_cmp, o_win, gates)]
        out = run(*leaves)
        got = torch.autograd.grad(out, leaves, do.to(dtype))
        return [out.detach(), *got]

    def fused(q: Any, k: Any, v: Any, o_cmp: Any, o_win: Any, gates: Any) -> torch.Tensor:
        return selected_attention_gated_triton(
            q, k, v, idx, case.sel_block, o_cmp=o_cmp, o_win=o_win, gates=gates,
            q_start=case.q_start, cu_seqlens=cu, config=cfg,
        )  # fmt: skip

    def apart(q: Any, k: Any, v: Any, o_cmp: Any, o_win: Any, gates: Any) -> torch.Tensor:
        o_sel = selected_attention_triton(
            q, k, v, idx, case.sel_block, q_start=case.q_start, cu_seqlens=cu, config=cfg
        )
        return gated_combine_triton(o_cmp, o_sel, o_win, gates)

    def reference64(q: Any, k: Any, v: Any, o_cmp: Any, o_win: Any, gates: Any) -> torch.Tensor:
        return gated_combine(o_cmp, reference(q, k, v, idx, case, cu), o_win, gates)

    got = grads(torch.float32, fused)
    wanted = {"apart": grads(torch.float32, apart), "float64": grads(F64, reference64)}
    for label, want in wanted.items():
        for name, a, b in zip(("o", *names), got, want, strict=True):
            assert rel_err(a, b) < 2 * BOUND[torch.float32], f"d{name} against {label}"


def test_gated_gradients_where_the_gates_take_none() -> None:
    """Gates that need no gradient get none (the combine's backward skips them); the other
    gradients are the same as when they need one."""
    assert DEVICE is not None
    case = Case("fixed gates", group=2, tq=12)
    gen = torch.Generator().manual_seed(5)
    q, k, v, idx, _ = make_inputs(case, gen, torch.float32, DEVICE)
    o_cmp, o_win, gates = other_branches(case, gen, torch.float32)
    do = torch.randn(o_cmp.shape, generator=gen).to(DEVICE)
    results = []
    for gates_need_grad in (True, False):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, o_cmp, o_win)]
        g = gates.clone().requires_grad_(gates_need_grad)
        out = selected_attention_gated_triton(
            *leaves[:3], idx, case.sel_block, o_cmp=leaves[3], o_win=leaves[4], gates=g
        )
        out.backward(do)
        assert (g.grad is not None) == gates_need_grad
        results.append([t.grad for t in leaves])
    for with_gates, without in zip(*results, strict=True):
        assert with_gates is not None
        assert torch.equal(with_gates, without)


def test_gated_forward_without_a_gradient_stores_nothing_more() -> None:
    assert DEVICE is not None
    case = Case("no grad", group=2, tq=8)
    gen = torch.Generator().manual_seed(1)
    q, k, v, idx, _ = make_inputs(case, gen, torch.float32, DEVICE)
    o_cmp, o_win, gates = other_branches(case, gen, torch.float32)
    q.requires_grad_()
    with torch.no_grad():
        out = selected_attention_gated_triton(
            q, k, v, idx, case.sel_block, o_cmp=o_cmp, o_win=o_win, gates=gates
        )
    assert not out.requires_grad
    assert out.grad_fn is None


def test_gated_forward_checks_the_other_branches() -> None:
    assert DEVICE is not None
    case = Case("shapes", group=2, tq=8)
    gen = torch.Generator().manual_seed(2)
    q, k, v, idx, _ = make_inputs(case, gen, torch.float32, DEVICE)
    o_cmp, o_win, gates = other_branches(case, gen, torch.float32)
    with pytest.raises(ValueError, match="o_cmp"):
        selected_attention_gated_triton(
            q, k, v, idx, case.sel_block, o_cmp=o_cmp[:, :4], o_win=o_win[:, :4],
            gates=gates[:, :4],
        )  # fmt: skip
    with pytest.raises(ValueError, match="gates"):
        selected_attention_gated_triton(
            q, k, v, idx, case.sel_block, o_cmp=o_cmp, o_win=o_win, gates=gates[..., :2]
        )
    with pytest.raises(TypeError, match="dtype"):
        selected_attention_gated_triton(
            q, k, v, idx, case.sel_block, o_cmp=o_cmp.double(), o_win=o_win.double(),
            gates=gates.double(),
        )  # fmt: skip


def test_gated_forward_with_no_index_columns_sums_the_other_two_branches() -> None:
    # n = 0: no launch; o_sel = 0, and its product is still taken (a NaN gate reaches its row).
    assert DEVICE is not None
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 8, 2, 16, generator=gen).to(DEVICE)
    k = torch.randn(1, 8, 1, 16, generator=gen).to(DEVICE)
    v = torch.randn(1, 8, 1, 16, generator=gen).to(DEVICE)
    idx = torch.zeros(1, 8, 1, 0, dtype=torch.int32, device=DEVICE)
    case = Case("n=0", group=2, h=1, tq=8)
    o_cmp, o_win, gates = other_branches(case, gen, torch.float32)
    gates[0, 3, 1, 1] = float("nan")
    out = selected_attention_gated_triton(q, k, v, idx, 4, o_cmp=o_cmp, o_win=o_win, gates=gates)
    assert torch.isnan(out[0, 3, 1]).all()
    want = gates[..., 0:1] * o_cmp + gates[..., 2:3] * o_win
    finite = ~torch.isnan(out)
    assert finite.sum() == out.numel() - out.shape[-1]
    torch.testing.assert_close(out[finite], want[finite], rtol=0, atol=0)


def row_runs_of(o_cmp: torch.Tensor, start: int, cuts: list[int]) -> RowRuns:
    """o_cmp's rows from ``start`` as runs ending at each cut (and at Tq), each in storage of
    its own; the last in a heads-major layout (strides other than o_cmp's)."""
    bounds = [start, *cuts, o_cmp.shape[1]]
    runs = [o_cmp[:, a:b].clone() for a, b in itertools.pairwise(bounds)]
    last = runs[-1]
    runs[-1] = last.transpose(1, 2).contiguous().transpose(1, 2)
    return RowRuns(start=start, runs=tuple(runs))


RUN_LAYOUTS = [
    # (start, cuts): the folded cuDNN branch's shape (blind rows, the full rows, a tail), one
    # run after the blind rows, one run from row 0, and three runs (assembled first).
    pytest.param(5, [13], id="blind_rows_then_two_runs"),
    pytest.param(3, [], id="one_run_after_blind_rows"),
    pytest.param(0, [], id="one_run_from_row_0"),
    pytest.param(2, [6, 9], id="three_runs"),
]


@pytest.mark.parametrize("case", [*CASES[:4], FORCED_PARAM], ids=lambda c: c.name)
@pytest.mark.parametrize(("start", "cuts"), RUN_LAYOUTS)
def test_gated_forward_reads_o_cmp_in_runs_where_they_lie(
    case: Case, start: int, cuts: list[int]
) -> None:
    """o_cmp given as a RowRuns (the rows where their attention calls left them, zero before the
    first run) gives the output of the one tensor those runs make up, bit for bit."""
    assert DEVICE is not None
    gen = torch.Generator().manual_seed(13)
    q, k, v, idx, cu = make_inputs(case, gen, torch.float32, DEVICE)
    o_cmp, o_win, gates = other_branches(case, gen, torch.float32)
    start = min(start, case.tq)
    cuts = [c for c in cuts if start < c < case.tq]
    runs = row_runs_of(o_cmp, start, cuts)
    whole = runs.assemble()
    assert torch.equal(whole[:, :start], torch.zeros_like(whole[:, :start]))
    assert torch.equal(whole[:, start:], o_cmp[:, start:])

    def gated(o: torch.Tensor | RowRuns) -> torch.Tensor:
        return selected_attention_gated_triton(
            q, k, v, idx, case.sel_block, o_cmp=o, o_win=o_win, gates=gates,
            q_start=case.q_start, cu_seqlens=cu, config=SelConfig(**case.config),
        )  # fmt: skip

    assert torch.equal(gated(runs), gated(whole))


@pytest.mark.parametrize(("start", "cuts"), RUN_LAYOUTS)
def test_gated_gradients_with_o_cmp_in_runs_are_those_of_the_assembled_tensor(
    start: int, cuts: list[int]
) -> None:
    """With a gradient too the runs are read where they lie, each an input of the graph: the
    output and every gradient equal those of the one tensor they make up, given whole; each
    run's gradient is that tensor's gradient on the run's rows."""
    assert DEVICE is not None
    case = Case("runs with grad", group=2, tq=21)
    gen = torch.Generator().manual_seed(17)
    q, k, v, idx, _ = make_inputs(case, gen, torch.float32, DEVICE)
    o_cmp, o_win, gates = other_branches(case, gen, torch.float32)
    do = torch.randn(o_cmp.shape, generator=gen).to(DEVICE)
    base = row_runs_of(o_cmp, start, cuts)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, o_win, gates)]
    run_leaves = tuple(run.clone().requires_grad_() for run in base.runs)
    out = selected_attention_gated_triton(
        *leaves[:3], idx, case.sel_block, o_cmp=RowRuns(start=start, runs=run_leaves),
        o_win=leaves[3], gates=leaves[4],
    )  # fmt: skip
    got = torch.autograd.grad(out, [*leaves, *run_leaves], do)
    whole = base.assemble().requires_grad_()
    leaves2 = [t.clone().requires_grad_() for t in (q, k, v, o_win, gates)]
    out2 = selected_attention_gated_triton(
        *leaves2[:3], idx, case.sel_block, o_cmp=whole, o_win=leaves2[3], gates=leaves2[4]
    )
    want = torch.autograd.grad(out2, [*leaves2, whole], do)
    assert torch.equal(out, out2)
    for a, b in zip(got[:5], want[:5], strict=True):
        assert torch.equal(a, b)
    d_whole, row = want[5], start
    for run, d_run in zip(run_leaves, got[5:], strict=True):
        assert torch.equal(d_run, d_whole[:, row : row + run.shape[1]])
        row += run.shape[1]
