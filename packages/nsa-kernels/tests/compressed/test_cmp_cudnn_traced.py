"""The folded compressed runs as custom ops (nsa_kernels.compressed.cudnn_traced), on CPU with
cuDNN replaced by the float64 model of its semantics and of its backward.

The ops' forward and their own backward (each run differentiated on its folded layout, a row's
slots summed into dk_cmp and dv_cmp) give the nsa-core reference's o, lse and gradients within
docs/spec.md's float32 bound (1e-5); torch.library's opcheck accepts their schemas, fake
implementations and autograd registration; and a call traced by torch.compile takes them and
equals the eager call.
"""

from __future__ import annotations

import pytest
import torch
from cudnn_testlib import BOUND, CASES, model_attend, model_attend_backward, reference_lse
from kernel_testlib import rel_err

from nsa_core.blocks import num_cmp_blocks
from nsa_core.reference import compressed_attention
from nsa_core.toggles import Toggles
from nsa_kernels.common.op_calls import CompressedCall
from nsa_kernels.common.row_runs import RowRuns
from nsa_kernels.compressed import cudnn_traced
from nsa_kernels.compressed.cmp_fold import row_split
from nsa_kernels.compressed.cudnn import folded_attention


@pytest.fixture(autouse=True)
def model_is_traceable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(cudnn_traced.TRACED_ATTENDS, "model", (model_attend, model_attend_backward))


def _inputs(
    batch: int, tq: int, q_start: int, h: int, group: int, cmp_block: int, d: int, seed: int
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n = max(num_cmp_blocks(q_start + tq, cmp_block, d), 1) + 2
    return [
        torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()
        for shape in ((batch, tq, h * group, 8), (batch, n, h, 8), (batch, n, h, 6))
    ]


@pytest.mark.parametrize(("batch", "tq", "q_start", "h", "group", "cmp_block", "d"), CASES)
def test_the_ops_give_the_reference_output_lse_and_gradients(
    batch: int, tq: int, q_start: int, h: int, group: int, cmp_block: int, d: int
) -> None:
    q, k, v = _inputs(batch, tq, q_start, h, group, cmp_block, d, tq * 1000 + q_start)
    lse, *runs = torch.ops.nsa.folded_runs(q, k, v, cmp_block, d, 8**-0.5, q_start, "model", False)
    split = row_split(tq, q_start, cmp_block, d)
    assert [run.shape[1] for run in runs] == [
        n for n in (split.head, split.rows * d, split.tail) if n
    ]
    ref = compressed_attention(q, k, v, cmp_block, d, q_start=q_start)
    want_lse = reference_lse(q, k, cmp_block, d, q_start)
    blind = torch.isinf(want_lse)
    assert torch.equal(torch.isneginf(lse), blind)
    if not blind.all():
        assert rel_err(lse[~blind], want_lse[~blind]) < BOUND
    if not runs:
        assert split.blind == tq
        return
    o = RowRuns(start=split.blind, runs=tuple(runs)).assemble()
    assert rel_err(o, ref) < BOUND
    do = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    do[:, : split.blind] = 0  # the blind rows' output is 0 whatever q
    got = torch.autograd.grad(o, (q, k, v), do)
    want = torch.autograd.grad(ref, (q, k, v), do)
    for name, a, b in zip("qkv", got, want, strict=True):
        assert rel_err(a, b) < BOUND, f"d{name}"


@pytest.mark.parametrize(
    ("batch", "tq", "q_start", "h", "group", "cmp_block", "d"), [CASES[0], CASES[3]]
)
def test_the_ops_pass_torch_library_opcheck(
    batch: int, tq: int, q_start: int, h: int, group: int, cmp_block: int, d: int
) -> None:
    q, k, v = _inputs(batch, tq, q_start, h, group, cmp_block, d, 3)
    args = (q, k, v, cmp_block, d, 8**-0.5, q_start, "model", False)
    torch.library.opcheck(torch.ops.nsa.folded_runs.default, args)
    # The backward op has no gradient of its own (the ops are once differentiable).
    with torch.no_grad():
        lse, *runs = torch.ops.nsa.folded_runs(*args)
    grads = [torch.randn_like(run) for run in runs]
    backward_args = (grads, q.detach(), k.detach(), v.detach(), lse, runs, *args[3:])
    torch.library.opcheck(torch.ops.nsa.folded_runs_backward.default, backward_args)


def test_the_backward_op_lays_its_gradients_out_as_its_fake_promises() -> None:
    """Inputs laid out heads-first ([B, H, T, D] in memory, not contiguous as [B, T, H, D]):
    opcheck compares the real outputs' strides with the fake ones'."""
    inputs = _inputs(1, 45, 0, 2, 2, 8, 4, 9)
    q, k, v = (x.detach().transpose(1, 2).contiguous().transpose(1, 2) for x in inputs)
    assert not q.is_contiguous()
    args = (q, k, v, 8, 4, 8**-0.5, 0, "model", False)
    with torch.no_grad():
        lse, *runs = torch.ops.nsa.folded_runs(*args)
    grads = [torch.randn_like(run) for run in runs]
    backward_args = (grads, q, k, v, lse, runs, *args[3:])
    torch.library.opcheck(torch.ops.nsa.folded_runs_backward.default, backward_args)
    dq, dk, dv = torch.ops.nsa.folded_runs_backward(*backward_args)
    for got, x in zip((dq, dk, dv), (q, k, v), strict=True):
        assert got.stride() == torch.empty_like(x).stride()


def test_a_traced_call_takes_the_ops_and_equals_eager() -> None:
    q, k, v = _inputs(2, 53, 13, 2, 2, 8, 4, 17)
    call = CompressedCall(
        scale=8**-0.5, q_start=13, cu_seqlens=None, toggles=Toggles(), cmp_block=8, cmp_stride=4
    )
    ops: list[str] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        ops.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return folded_attention(q, k, v, call, model_attend)[0]

    torch._dynamo.reset()
    compiled = torch.compile(attention, backend=backend, fullgraph=True)
    out = compiled(q, k, v)
    assert "nsa.folded_runs" in ops
    eager = attention(q, k, v)
    assert rel_err(out, eager) < BOUND
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), do)
    want = torch.autograd.grad(eager, (q, k, v), do)
    for name, a, b in zip("qkv", got, want, strict=True):
        assert rel_err(a, b) < BOUND, f"d{name}"


def test_an_attend_without_a_registered_backward_cannot_be_traced() -> None:
    def attend(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        raise AssertionError("never called")

    with pytest.raises(ValueError, match="has no backward in TRACED_ATTENDS"):
        cudnn_traced.attend_name(attend)  # type: ignore[arg-type]
