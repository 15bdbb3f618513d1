"""On a GPU with no toggle set, every NSA step runs on a GPU backend, and the public ops use it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nsa_core import registry, selected_attention
from nsa_core.ops import op_context
from nsa_core.reference import select_blocks as select_blocks_reference
from nsa_core.toggles import Toggles

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.usefixtures("kernels_registered"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _ctx(dtype: torch.dtype) -> registry.OpContext:
    q = torch.empty(1, 4096, 64, 128, device="cuda", dtype=dtype)
    k = torch.empty(1, 4096, 4, 128, device="cuda", dtype=dtype)
    return op_context(q, k, k, 4096, varlen=False)


def test_default_routes_on_cuda_are_gpu_backends() -> None:
    report = registry.routing_report(_ctx(torch.bfloat16), Toggles())
    print(report)
    chosen = dict(
        (line.split("->")[0].strip(), line.split("->")[1].split()[0])
        for line in report.splitlines()
        if not line.startswith(" ")
    )
    assert chosen["attention_core"] == "fused"
    assert chosen["select_blocks"] == "triton_score"
    assert chosen["compressed_attention"] in ("fa2", "triton_cmp")
    assert chosen["selected_attention"] == "triton_sel"
    assert chosen["sliding_attention"] in ("fa2", "triton_win")


def _call_counts() -> Any:
    """nsa-core's tests/call_counts.py (what one call validates and resolves), by path."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).parents[2] / "nsa-core" / "tests" / "call_counts.py"
    spec = importlib.util.spec_from_file_location("call_counts", path)
    assert spec is not None
    assert spec.loader is not None
    if "call_counts" in sys.modules:  # collected beside nsa-core's tests, or loaded before
        return sys.modules["call_counts"]
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs: its dataclasses look their module up by name.
    sys.modules["call_counts"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("t", [4096, 16384], ids=["4k (Triton compressed)", "16k (cuDNN)"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_one_core_call_on_the_default_routes_validates_once_and_resolves_the_core_once(
    t: int, grad: bool
) -> None:
    """The fused core serves, resolves each step once, and no kernel validates again."""
    import nsa_core
    from nsa_core.config import NSAConfig

    counting_calls = _call_counts().counting_calls
    gen = torch.Generator(device="cuda").manual_seed(5)

    def draw(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)
        return x.requires_grad_(grad)

    q, k, v, gates = draw(1, t, 64, 128), draw(1, t, 4, 128), draw(1, t, 4, 128), draw(1, t, 64, 3)
    config = NSAConfig(num_q_heads=64, num_kv_heads=4, head_dim_qk=128, head_dim_v=128)
    report = registry.routing_report(_ctx(torch.bfloat16), Toggles())
    assert report.splitlines()[0].split("->")[1].split()[0] == "fused"
    with torch.set_grad_enabled(grad), counting_calls() as counts:
        nsa_core.nsa_attention(q, k, v, gates, config)
    assert dict(counts.validated) == {"check_nsa_attention": 1}
    assert counts.resolved["attention_core"] == 1
    assert counts.step_resolutions == 5


def test_float64_and_pinned_reference_run_the_reference() -> None:
    report = registry.routing_report(_ctx(torch.float64), Toggles())
    assert all(line.split("->")[1].split()[0] == "reference" for line in report.splitlines())
    pinned = Toggles(sel_backend="reference")
    res = registry.resolve("selected_attention", _ctx(torch.bfloat16), pinned)
    assert res.backend.name == "reference"


def test_public_selected_attention_runs_the_triton_kernel() -> None:
    from nsa_kernels.selected.function import selected_attention_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    t, hq, h, d, l_sel = 512, 8, 2, 64, 64
    q = torch.randn(1, t, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(1, t, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(1, t, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_cmp = k.view(1, t // 16, 16, h, d).float().mean(2).to(torch.bfloat16)
    idx, _ = select_blocks_reference(q, k_cmp, 16, 16, l_sel, 4)
    out = selected_attention(q, k, v, idx, l_sel)
    # Bit-equal to the Triton kernel called by name: the public op dispatched to it.
    assert torch.equal(out, selected_attention_triton(q, k, v, idx, l_sel))


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_the_core_forward_at_16k_takes_no_host_sync(grad: bool) -> None:
    """With or without a gradient, the attention core's forward on its default routes (cuDNN's
    compressed branch from 16k on sm_90, block scoring, the selected and sliding branches)
    queues its work without waiting for the device: torch's sync debug mode raises on the
    synchronizing calls it knows (a prototype: item(), nonzero, masked selects, blocking copies
    and the like). With a gradient the compressed keys' finite flag goes to the host behind the
    forward, read by the backward. A warm-up call first, so that compilation and first-use
    setup stay out of the check."""
    import nsa_core
    from nsa_core.config import NSAConfig

    gen = torch.Generator(device="cuda").manual_seed(0)
    t = 16384

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)

    q, k, v = draw(1, t, 64, 128), draw(1, t, 4, 128), draw(1, t, 4, 128)
    gates = torch.sigmoid(draw(1, t, 64, 3))
    config = NSAConfig(num_q_heads=64, num_kv_heads=4, head_dim_qk=128, head_dim_v=128)
    if grad:
        q, k, v, gates = (x.requires_grad_() for x in (q, k, v, gates))
    with torch.set_grad_enabled(grad):
        want = nsa_core.nsa_attention(q, k, v, gates, config)
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = nsa_core.nsa_attention(q, k, v, gates, config)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert got.requires_grad == grad
    assert torch.equal(got, want)


def test_the_selected_backward_waits_only_for_its_index_sizes() -> None:
    """The selected branch's backward builds its reverse index with one explicit wait (an event
    behind the dq launch) and no synchronizing torch call: sync debug mode raises on those."""
    from nsa_kernels.selected.function import selected_attention_triton

    gen = torch.Generator(device="cuda").manual_seed(1)
    t, hq, h, d, l_sel = 4096, 16, 2, 64, 64
    q, k, v = (
        torch.randn(1, t, heads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        for heads in (hq, h, h)
    )
    k_cmp = k.view(1, t // 16, 16, h, d).float().mean(2).to(torch.bfloat16)
    idx, _ = select_blocks_reference(q, k_cmp, 16, 16, l_sel, 8)
    do = torch.randn(1, t, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    grads = []
    for debug in ("default", "error"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = selected_attention_triton(*leaves, idx, l_sel)
        torch.cuda.set_sync_debug_mode(debug)
        try:
            out.backward(do)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        grads.append([x.grad for x in leaves])
    for name, a, b in zip("qkv", *grads, strict=True):
        assert torch.equal(a, b), f"d{name} differs between the two runs"


@pytest.mark.slow(reason="runs the 16k paper-shape core forward+backward twice")
def test_the_core_with_a_gradient_reads_the_compressed_runs_in_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """From 16k on sm_90 the core's compressed output reaches the selected branch's gated launch
    as cuDNN's own buffers with a gradient too (no copy into one tensor in the forward, each
    run's gradient its rows of d o_cmp in the backward). Against the same core given that output
    as one tensor: o and the gates' gradient bit for bit (the same kernels read the same values);
    q, k and v's gradients within the spec's bfloat16 bound (cuDNN's dq is not bitwise
    reproducible from call to call)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the cuDNN compressed branch is routed on sm_90 only")
    from kernel_testlib import BOUND, rel_err

    import nsa_core
    from nsa_core.config import NSAConfig
    from nsa_kernels.common.row_runs import RowRuns
    from nsa_kernels.compressed import cudnn

    gen = torch.Generator(device="cuda").manual_seed(2)
    t = 16384 + 5

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)

    q, k, v, do = draw(1, t, 64, 128), draw(1, t, 4, 128), draw(1, t, 4, 128), draw(1, t, 64, 128)
    gates = torch.sigmoid(draw(1, t, 64, 3))
    config = NSAConfig(num_q_heads=64, num_kv_heads=4, head_dim_qk=128, head_dim_v=128)
    given: list[RowRuns] = []
    folded_runs = cudnn.folded_runs

    def recording(*args: Any, **kwargs: Any) -> tuple[RowRuns, torch.Tensor]:
        runs, lse = folded_runs(*args, **kwargs)
        given.append(runs)
        return runs, lse

    def one_tensor(*args: Any, **kwargs: Any) -> tuple[RowRuns, torch.Tensor]:
        runs, lse = folded_runs(*args, **kwargs)
        return RowRuns.whole(runs.assemble()), lse

    results = []
    for route in (recording, one_tensor):
        monkeypatch.setattr(cudnn, "folded_runs", route)
        leaves = [x.clone().requires_grad_() for x in (q, k, v, gates)]
        out = nsa_core.nsa_attention(*leaves, config)
        out.backward(do)
        results.append((out.detach(), [x.grad for x in leaves]))
    assert len(given) == 1
    assert given[0].start == config.cmp_block - 1
    assert len(given[0].runs) == 2, "the full rows and the tail"
    assert all(run.requires_grad for run in given[0].runs)
    (o_runs, grads_runs), (o_whole, grads_whole) = results
    assert torch.equal(o_runs, o_whole)
    assert grads_runs[3] is not None
    assert torch.equal(grads_runs[3], grads_whole[3]), "d gates"
    for name, a, b in zip("qkv", grads_runs[:3], grads_whole[:3], strict=True):
        assert a is not None
        assert b is not None
        err = rel_err(a, b)
        assert err < BOUND[torch.bfloat16], f"d{name}: relative error {err:.2e}"


def _count_local_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the sliding branch's calls that hand out the local softmax."""
    from nsa_kernels.sliding import triton_function

    calls: list[int] = []
    with_local = triton_function.sliding_attention_triton_with_local

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return with_local(*args, **kwargs)

    monkeypatch.setattr(triton_function, "sliding_attention_triton_with_local", counted)
    return calls


@pytest.mark.slow(reason="compiles the float32 core's kernels for each group size")
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "forward+backward"])
@pytest.mark.parametrize(("hq", "h"), [(16, 2), (4, 4)], ids=["G=8", "G=1"])
def test_the_core_from_the_local_softmax_matches_the_reference_in_float32(
    monkeypatch: pytest.MonkeyPatch, grad: bool, hq: int, h: int
) -> None:
    """The core on the default routes, k and v shared by the branches: the sliding branch hands
    its local softmax to the selected one (counted), and o (and the gradients of q, k, v and
    the gates) are the float64 reference's within the float32 bound (gradients twice it)."""
    from kernel_testlib import BOUND, rel_err

    import nsa_core
    from nsa_core.config import NSAConfig

    calls = _count_local_calls(monkeypatch)
    gen = torch.Generator(device="cuda").manual_seed(3)
    t = 2048 + 7
    q, k, v = (torch.randn(1, t, heads, 64, device="cuda", generator=gen) for heads in (hq, h, h))
    gates = torch.sigmoid(torch.randn(1, t, hq, 3, device="cuda", generator=gen))
    do = torch.randn(1, t, hq, 64, device="cuda", generator=gen)
    config = NSAConfig(num_q_heads=hq, num_kv_heads=h, head_dim_qk=64, head_dim_v=64)
    inputs = (q, k, v, gates)
    leaves = [x.clone().requires_grad_(grad) for x in inputs]
    ref_leaves = [x.double().cpu().requires_grad_(grad) for x in inputs]
    with torch.set_grad_enabled(grad):
        out = nsa_core.nsa_attention(*leaves, config)
        ref = nsa_core.nsa_attention(*ref_leaves, config)
    assert calls == [1]
    assert rel_err(out, ref) < BOUND[torch.float32]
    if grad:
        out.backward(do)
        ref.backward(do.double().cpu())
        for name, a, b in zip("qkvg", leaves, ref_leaves, strict=True):
            assert a.grad is not None
            assert b.grad is not None
            err = rel_err(a.grad, b.grad)
            assert err < 2 * BOUND[torch.float32], f"d{name}: relative error {err:.2e}"


def test_the_core_at_16k_in_bfloat16_is_the_same_with_and_without_the_local_softmax(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The paper's shapes at 16k in bfloat16: the core whose branches share k and v (local
    softmax on) against the same values given as separate tensors per branch (off), within the
    spec's bfloat16 bound; the index rows are the same (they come before either branch)."""
    from kernel_testlib import BOUND, rel_err

    import nsa_core
    from nsa_core.config import NSAConfig

    calls = _count_local_calls(monkeypatch)
    gen = torch.Generator(device="cuda").manual_seed(4)
    t = 16384 + 5

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)

    q, k, v = draw(1, t, 64, 128), draw(1, t, 4, 128), draw(1, t, 4, 128)
    gates = torch.sigmoid(draw(1, t, 64, 3))
    config = NSAConfig(num_q_heads=64, num_kv_heads=4, head_dim_qk=128, head_dim_v=128)
    with torch.no_grad():
        shared = nsa_core.nsa_attention(q, k, v, gates, config)
        assert calls == [1]
        apart = nsa_core.nsa_attention(
            q, {"cmp": k, "sel": k.clone(), "win": k}, {"cmp": v, "sel": v.clone(), "win": v},
            gates, config,
        )  # fmt: skip
    assert calls == [1]
    err = rel_err(shared, apart)
    assert err < BOUND[torch.bfloat16], f"relative error {err:.2e}"
