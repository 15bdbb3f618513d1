"""torch.compile of NSA on the GPU's default routes: the layer is one graph with no break; the
compiled attention (``nsa_attention``, forward and gradients) equals eager within docs/spec.md's
bounds (the eager-vs-reference tolerance) at 8k and 64k, as does the whole compiled layer
(projections fused by Inductor) at 8k and 64k; a second length of the same route takes no new
graph.

A traced call takes the routes an eager call takes: from 16k on that is cuDNN's folded
compressed runs, as the custom ops of nsa_kernels.compressed.cudnn_traced.
The layer's RoPE tables come from eager's code under compile too (the op ``nsa::rope_angles``):
with Inductor's own pow, cos and sin some bf16 q and k values differ by one unit, and among the
many blocks of a 64k row the top-16 then changes where scores nearly tie, which moves the
output by more than any rounding bound (ci/compile_drift.py shows each intermediate's drift).
"""

from __future__ import annotations

import pytest
import torch
from kernel_testlib import BOUND, rel_err

from nsa_core import NSAAttention, NSAConfig, nsa_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.usefixtures("kernels_registered"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# The layer bench's shape: HQ=64, H=4, dk=dv=128, the paper's l, d, l', n and w; bf16.
CONFIG = NSAConfig(num_q_heads=64, num_kv_heads=4, head_dim_qk=128, head_dim_v=128)
HIDDEN = 2048

# Each Inductor compile of the layer on a GPU takes 10 to 60 s: a pull request's quick run keeps
# the 8k one-graph check, the full run (the slow tier) the rest.
COMPILES = pytest.mark.slow(reason="compiles the layer with Inductor on a GPU: 10-60 s a test")


def _layer(seed: int) -> NSAAttention:
    torch.manual_seed(seed)
    return NSAAttention(CONFIG, HIDDEN).to(device="cuda", dtype=torch.bfloat16)


def _x(t: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(1, t, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16)


@pytest.mark.parametrize("t", [8192, pytest.param(65536, marks=COMPILES)], ids=["8k", "64k"])
def test_the_layer_compiles_to_one_graph_without_a_break(t: int) -> None:
    layer = _layer(0)
    x = _x(t, 1).requires_grad_()
    explained = torch._dynamo.explain(layer)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def _qkvg(t: int, seed: int, grad: bool) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, device="cuda", generator=gen, dtype=torch.bfloat16)
        return x.requires_grad_(grad)

    gates = torch.rand(1, t, 64, 3, device="cuda", generator=gen, dtype=torch.bfloat16)
    return [draw(1, t, 64, 128), draw(1, t, 4, 128), draw(1, t, 4, 128), gates.requires_grad_(grad)]


def _core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return nsa_attention(q, k, v, g, CONFIG)


@COMPILES
@pytest.mark.parametrize("t", [8192, 65536], ids=["8k", "64k"])
@pytest.mark.parametrize("train", [False, True], ids=["forward", "backward"])
def test_the_compiled_attention_equals_eager(t: int, train: bool) -> None:
    torch._dynamo.reset()
    inputs = _qkvg(t, 1, train)
    compiled = torch.compile(_core, fullgraph=True)
    bound = BOUND[torch.bfloat16]
    with torch.set_grad_enabled(train):
        eager = _core(*inputs)
        y = compiled(*inputs)
    assert rel_err(y, eager) <= bound
    if train:
        dy = torch.randn_like(y)
        grads = torch.autograd.grad(y, inputs, dy)
        grads_eager = torch.autograd.grad(eager, inputs, dy)
        for name, g, g_eager in zip("qkvg", grads, grads_eager, strict=True):
            assert rel_err(g, g_eager) <= 2 * bound, name


@COMPILES
@pytest.mark.parametrize("t", [8192, 65536], ids=["8k", "64k"])
@pytest.mark.parametrize("train", [False, True], ids=["forward", "training step"])
def test_the_compiled_layer_equals_eager(t: int, train: bool) -> None:
    torch._dynamo.reset()
    layer = _layer(0)
    compiled = torch.compile(layer, fullgraph=True)
    x = _x(t, 1).requires_grad_(train)
    dy = _x(t, 2)
    bound = BOUND[torch.bfloat16]
    with torch.set_grad_enabled(train):
        eager_y = layer(x)
        if train:
            eager_y.backward(dy)
            eager_grads = [x.grad, *(p.grad for p in layer.parameters())]
            x.grad = None
            layer.zero_grad(set_to_none=True)
        y = compiled(x)
    assert rel_err(y, eager_y) <= bound
    if train:
        y.backward(dy)
        grads = [x.grad, *(p.grad for p in layer.parameters())]
        names = ["x", *(name for name, _ in layer.named_parameters())]
        for name, g, g_eager in zip(names, grads, eager_grads, strict=True):
            assert g is not None, name
            assert g_eager is not None, name
            assert rel_err(g, g_eager) <= 2 * bound, name


@COMPILES
def test_a_new_length_on_the_same_route_takes_no_new_graph() -> None:
    torch._dynamo.reset()
    compiled = torch.compile(_core, fullgraph=True, dynamic=True)
    frames: list[int] = []
    with torch.no_grad():
        for t in (20480, 24576, 28672):
            inputs = _qkvg(t, 3, False)
            assert rel_err(compiled(*inputs), _core(*inputs)) <= BOUND[torch.bfloat16]
            frames.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert frames[0] == frames[1] == frames[2], frames


@COMPILES
def test_a_compiled_call_at_64k_takes_cudnns_runs_and_the_ops_that_wait_on_the_host() -> None:
    """At 64k eager code runs cuDNN's folded compressed runs; the traced forward graph holds
    them as ``nsa::folded_runs`` and the backward graph holds their backward and the selected
    backward as one op each (the parts that wait on the host)."""
    from torch._dynamo.backends.common import aot_autograd

    ops: dict[str, set[str]] = {"forward": set(), "backward": set()}

    def recorder(side: str) -> object:
        def record(gm: torch.fx.GraphModule, _: object) -> object:
            ops[side].update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return gm.forward

        return record

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward"))
    compiled = torch.compile(_core, backend=backend, fullgraph=True)
    inputs = _qkvg(65536, 4, True)
    out = compiled(*inputs)
    torch.autograd.grad(out, inputs, torch.ones_like(out))
    assert "nsa.folded_runs.default" in ops["forward"]
    assert "nsa.folded_runs_backward.default" in ops["backward"]
    assert "nsa.selected_backward.default" in ops["backward"]
