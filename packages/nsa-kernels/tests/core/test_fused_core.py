"""The fused attention core (nsa_kernels.core): which hand-offs a call's step backends allow,
and, under the Triton interpreter, the whole core on the Triton kernels against the reference.

The plan tests register stand-ins under the kernels' names on the CPU, so that they read as the
module table of :mod:`nsa_kernels.core.plan`; the interpreter test re-registers the kernels'
own rows to accept CPU tensors and runs them through ``nsa_attention``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from kernel_testlib import BOUND, DEVICE, SKIP_REASON, rel_err

from nsa_core import NSAConfig, nsa_attention
from nsa_core.core import StepContexts
from nsa_core.op_context import OpContext
from nsa_core.registry import CORE_OP, Backend, register_backend, resolve, routing_report
from nsa_core.toggles import Toggles
from nsa_kernels.core.backends import fused_core_supports
from nsa_kernels.core.plan import CorePlan

CONFIG = NSAConfig(
    num_q_heads=4,
    num_kv_heads=2,
    head_dim_qk=16,
    head_dim_v=16,
    cmp_block=8,
    cmp_stride=4,
    sel_block=16,
    num_selected=3,
    window=32,
)


def accept(ctx: OpContext, toggles: Toggles) -> str | None:
    return None


def unused(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("planning calls no backend")


def _context(requires_grad: bool = True) -> OpContext:
    return OpContext.for_config(
        CONFIG, device=torch.device("cpu"), dtype=torch.float32, seq_len=64,
        requires_grad=requires_grad,
    )  # fmt: skip


def _stand_ins(**names: str) -> None:
    """Register an accept-all stand-in named ``names[op]`` for each op given."""
    for op, name in names.items():
        lse = unused if name in ("cudnn", "triton_cmp") else None
        register_backend(Backend(op, name, unused, accept, priority=5, fn_with_lse=lse))


KERNELS = {
    "compressed_attention": "cudnn",
    "select_blocks": "triton_score",
    "selected_attention": "triton_sel",
    "sliding_attention": "triton_win",
    "gated_combine": "triton_combine",
}


@pytest.mark.usefixtures("isolated_registry")
def test_the_default_kernels_take_every_hand_off() -> None:
    _stand_ins(**KERNELS)
    plan = CorePlan.make(StepContexts.of_context(_context()), Toggles())
    assert (plan.gated, plan.runs, plan.local, plan.grad_sum) == (True, True, True, True)
    lines = plan.describe()
    assert "its lse reaches block scoring" in lines[0]
    assert "runs of rows" in lines[0]
    assert "softmax over its forced blocks" in lines[3]
    assert "summed inside the selected launch" in lines[4]


@pytest.mark.usefixtures("isolated_registry")
@pytest.mark.parametrize(
    ("names", "toggles", "expected"),
    [
        ({**KERNELS, "compressed_attention": "triton_cmp"}, Toggles(), (True, False, True, True)),
        ({**KERNELS, "selected_attention": "cuda_sel"}, Toggles(), (False, False, False, True)),
        ({**KERNELS, "sliding_attention": "fa2"}, Toggles(), (True, True, False, True)),
        (KERNELS, Toggles(combine_backend="reference"), (False, False, False, False)),
        (KERNELS, Toggles(combine_grad_sum=False), (True, True, True, False)),
    ],
    ids=["triton compressed", "another selected", "fa2 sliding", "pinned combine", "no grad sum"],
)
def test_a_hand_off_applies_only_between_the_kernels_that_share_it(
    names: dict[str, str], toggles: Toggles, expected: tuple[bool, bool, bool, bool]
) -> None:
    _stand_ins(**names)
    plan = CorePlan.make(StepContexts.of_context(_context()), toggles)
    assert (plan.gated, plan.runs, plan.local, plan.grad_sum) == expected


@pytest.mark.usefixtures("isolated_registry")
def test_without_a_gradient_there_is_no_gradient_sum() -> None:
    _stand_ins(**KERNELS)
    plan = CorePlan.make(StepContexts.of_context(_context(requires_grad=False)), Toggles())
    assert (plan.gated, plan.runs, plan.local, plan.grad_sum) == (True, True, True, False)
    assert "gradients" not in plan.describe()[4]


@pytest.mark.usefixtures("isolated_registry")
def test_routing_report_shows_the_core_and_the_steps_inside_it() -> None:
    _stand_ins(**KERNELS)
    fused = Backend(CORE_OP, "fused", _fused(), accept, priority=20)
    register_backend(fused)
    report = routing_report(_context(), Toggles()).splitlines()
    assert report[0].startswith("attention_core         -> fused")
    inside = [line.strip() for line in report[1:6]]
    assert [line.split(" -> ")[1].split()[0] for line in inside] == list(KERNELS.values())


def test_the_fused_core_declines_cpu_and_debug_hooks() -> None:
    assert fused_core_supports(_context(), Toggles()) is not None
    gpu = dataclasses.replace(_context(), device=torch.device("cuda", 0), dtype=torch.bfloat16)
    assert "debug hook" in str(fused_core_supports(gpu, Toggles(debug_timing=True)))


def _fused() -> Any:
    from nsa_kernels.core.fused import FusedCore

    return FusedCore()


# --------------------------------------------------------------------------- Triton interpreter


def _kernel_rows_on_this_device() -> None:
    """The kernels' own registry rows, accepting this device (the interpreter runs on CPU)."""
    from nsa_kernels.registration import all_backends

    for row in all_backends():
        if row.name in (*KERNELS.values(), "triton_cmp", "fused") and row.name != "cudnn":
            register_backend(dataclasses.replace(row, supports=accept))


def _inputs(seed: int, t: int, requires_grad: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    assert DEVICE is not None

    def draw(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, generator=gen).to(DEVICE)
        return x.requires_grad_(requires_grad)

    gates = torch.rand(1, t, 4, 3, generator=gen).to(DEVICE).requires_grad_(requires_grad)
    return [draw(1, t, 4, 16), draw(1, t, 2, 16), draw(1, t, 2, 16), gates]


@pytest.mark.triton
@pytest.mark.skipif(DEVICE is None, reason=SKIP_REASON)
@pytest.mark.usefixtures("isolated_registry")
@pytest.mark.parametrize("requires_grad", [False, True], ids=["forward", "backward"])
def test_the_fused_core_on_the_triton_kernels_matches_the_reference_core(
    requires_grad: bool,
) -> None:
    """Every hand-off but cuDNN's runs (a GPU library): the lse, the forced-block softmax, the
    combine inside the selected launch and the one-pass gradient sum of q, in float32 against
    the reference core at the spec's float32 bound (gradients: twice it)."""
    t = 80
    inputs = _inputs(7, t, requires_grad)
    reference = nsa_attention(*inputs, CONFIG)
    grads_ref = torch.autograd.grad(reference.sum(), inputs) if requires_grad else ()
    _kernel_rows_on_this_device()
    assert resolve(CORE_OP, _context(requires_grad)).backend.name == "fused"
    plan = CorePlan.make(StepContexts.of_context(_context(requires_grad)), Toggles())
    assert (plan.gated, plan.local, plan.grad_sum) == (True, True, requires_grad)
    fused = nsa_attention(*inputs, CONFIG)
    assert rel_err(fused, reference) <= BOUND[torch.float32]
    if requires_grad:
        grads = torch.autograd.grad(fused.sum(), inputs)
        for name, g, g_ref in zip(("q", "k", "v", "gates"), grads, grads_ref, strict=True):
            assert rel_err(g, g_ref) <= 2 * BOUND[torch.float32], name


@pytest.mark.triton
@pytest.mark.skipif(DEVICE is None, reason=SKIP_REASON)
@pytest.mark.usefixtures("isolated_registry")
def test_the_fused_core_compiles_to_one_graph_that_launches_the_same_kernels() -> None:
    """torch.compile(fullgraph=True, dynamic shapes) of ``nsa_attention`` on the Triton rows:
    the region runs the plan once while tracing, every launch is ``nsa::triton_launch`` and the
    selected backward ``nsa::selected_backward``. The output is the eager one bit for
    bit (the same kernels on the same arguments); the gradients within the float32 bound of
    eager against the reference (twice the spec's), since the compiled backward may sum a
    gradient's parts in another order."""
    torch._dynamo.reset()
    inputs = _inputs(11, 80, True)
    _kernel_rows_on_this_device()
    eager = nsa_attention(*inputs, CONFIG)
    grads_eager = torch.autograd.grad(eager.sum(), inputs)

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return nsa_attention(q, k, v, g, CONFIG)

    compiled = torch.compile(call, fullgraph=True, dynamic=True, backend="aot_eager")
    out = compiled(*inputs)
    assert torch.equal(out, eager)
    grads = torch.autograd.grad(out.sum(), inputs)
    for name, g, g_eager in zip(("q", "k", "v", "gates"), grads, grads_eager, strict=True):
        assert rel_err(g, g_eager) <= 2 * BOUND[torch.float32], name


@pytest.mark.triton
@pytest.mark.skipif(DEVICE is None, reason=SKIP_REASON)
@pytest.mark.usefixtures("isolated_registry")
def test_new_lengths_reuse_the_compiled_fused_core() -> None:
    """With dynamic shapes the kernels' host planning keeps T symbolic (a tile sized from T
    only where T is below a tile): a second length, no new graph."""
    torch._dynamo.reset()
    _kernel_rows_on_this_device()

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return nsa_attention(q, k, v, g, CONFIG)

    compiled = torch.compile(call, fullgraph=True, dynamic=True, backend="aot_eager")
    graphs = []
    with torch.no_grad():
        for t in (96, 144):
            inputs = _inputs(5, t, False)
            assert rel_err(compiled(*inputs), call(*inputs)) <= BOUND[torch.float32]
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[0] == graphs[1], graphs
