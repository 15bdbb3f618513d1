"""The cuDNN compressed backend's fold on CPU, cuDNN replaced by a float64 model of its semantics.

Everything the backend does around the fused kernel (the row split, heads folded d to a row with
the keys repeated per slot, the causal mask or the offset diagonal's bias, the queries cut off
before the first row and after the last, lse unfolded) runs for real and is compared with the
nsa-core reference in float64: outputs and lse within docs/spec.md's float32 bound (1e-5),
gradients the same. The routing rules that need no GPU are checked here too.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from cudnn_testlib import BOUND, CALLS, CASES, like_q_layout, model_attend, reference_lse
from kernel_testlib import DEVICE, SKIP_REASON, rel_err

from nsa_core.blocks import num_cmp_blocks
from nsa_core.reference import compressed_attention
from nsa_core.registry import OpContext
from nsa_core.toggles import Toggles
from nsa_kernels.common.op_calls import CompressedCall
from nsa_kernels.compressed.cmp_fold import row_split
from nsa_kernels.compressed.cudnn import (
    CUDNN_MIN_LEN,
    cudnn_compressed_supports,
    folded_attention,
    folded_runs,
)


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "forward_only"])
@pytest.mark.parametrize(("batch", "tq", "q_start", "h", "group", "cmp_block", "d"), CASES)
def test_fold_matches_reference(
    batch: int, tq: int, q_start: int, h: int, group: int, cmp_block: int, d: int, grad: bool
) -> None:
    """With a gradient the slots of a row go into the heads; forward only, one sequence puts
    them into the batch dimension (its keys a stride-0 view); both give the reference's o and
    lse, and the first its gradients."""
    gen = torch.Generator().manual_seed(tq * 1000 + q_start)
    n = max(num_cmp_blocks(q_start + tq, cmp_block, d), 1) + 2
    dk, dv = 8, 6
    q, k, v = (
        torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()
        for shape in ((batch, tq, h * group, dk), (batch, n, h, dk), (batch, n, h, dv))
    )
    call = CompressedCall(
        scale=dk**-0.5, q_start=q_start, cu_seqlens=None, toggles=Toggles(), cmp_block=cmp_block,
        cmp_stride=d,
    )  # fmt: skip
    CALLS.clear()
    with torch.set_grad_enabled(grad):
        o, lse = folded_attention(q, k, v, call, model_attend)
    ref = compressed_attention(q, k, v, cmp_block, d, q_start=q_start)
    assert o.shape == ref.shape
    assert o.dtype == ref.dtype
    assert rel_err(o, ref) < BOUND
    want_lse = reference_lse(q, k, cmp_block, d, q_start)
    blind = torch.isinf(want_lse)
    assert torch.equal(torch.isneginf(lse), blind)
    assert torch.count_nonzero(o[blind]) == 0
    if not blind.all():
        assert rel_err(lse[~blind], want_lse[~blind]) < BOUND

    assert o.requires_grad == grad
    if grad:
        do = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
        got = torch.autograd.grad(o, (q, k, v), do)
        want = torch.autograd.grad(ref, (q, k, v), do)
        for name, a, b in zip("qkv", got, want, strict=True):
            assert rel_err(a, b) < BOUND, f"d{name}"

    split = row_split(tq, q_start, cmp_block, d)
    rows_batch = d if batch == 1 and not grad else batch
    calls = [(False, False, batch)] * bool(split.head)
    if split.rows:
        causal = split.row_keys == 1
        calls.append((causal, not causal, rows_batch))
    calls += [(False, False, batch)] * bool(split.tail)
    assert calls == CALLS, "one call per run of queries; the offset diagonal through a bias"


def test_fold_backward_runs_twice_through_a_retained_graph() -> None:
    gen = torch.Generator().manual_seed(7)
    q, k, v = (
        torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()
        for shape in ((1, 90, 4, 8), (1, 22, 2, 8), (1, 22, 2, 6))
    )
    call = CompressedCall(
        scale=8**-0.5, q_start=0, cu_seqlens=None, toggles=Toggles(), cmp_block=8, cmp_stride=4
    )
    o, _ = folded_attention(q, k, v, call, model_attend)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    first = torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    second = torch.autograd.grad(o, (q, k, v), do)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_backend_refuses_packed_sequences_before_any_kernel() -> None:
    from nsa_kernels.compressed.cudnn import compressed_attention_cudnn

    q = torch.randn(1, 40, 2, 8)
    k = torch.randn(1, 2, 1, 8)
    cu = torch.tensor([0, 20, 40], dtype=torch.int32)
    with pytest.raises(ValueError, match="dense inputs"):
        compressed_attention_cudnn(q, k, k, 16, 16, cu_seqlens=cu)


@pytest.mark.triton
@pytest.mark.skipif(DEVICE is None, reason=SKIP_REASON)
@pytest.mark.parametrize("bad", ["k", "v", "none"])
def test_non_finite_keys_with_a_gradient_are_contained_without_a_host_sync(
    bad: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/spec.md, "Non-finite values", with a gradient: the fold always runs (here the float64
    model of cuDNN, which leaks a NaN value to rows that do not see its block), the Triton
    forward overwrites o and lse on the device where k_cmp or v_cmp is not all finite, and the
    flag reaches the host behind the forward, where the backward reads it: then the gradients
    come from the Triton backward. So a NaN gives the Triton Function's o, lse and gradients;
    finite keys give the fold's, bit for bit."""
    from nsa_kernels.compressed import cudnn
    from nsa_kernels.compressed.function import compressed_attention_triton_with_lse

    monkeypatch.setattr(cudnn, "cudnn_attend", model_attend)
    gen = torch.Generator().manual_seed(29)
    q = torch.randn(1, 45, 2, 8, generator=gen)
    k, v = torch.randn(1, 5, 1, 8, generator=gen), torch.randn(1, 5, 1, 8, generator=gen)
    if bad != "none":
        (k if bad == "k" else v)[0, 1, 0, 3] = float("nan")
    do = torch.randn(1, 45, 2, 8, generator=gen)
    q, k, v, do = (x.to(DEVICE) for x in (q, k, v, do))

    def run(fn: Any) -> list[torch.Tensor]:
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        o, lse = fn(*leaves, 16, 8)
        return [o.detach(), lse, *torch.autograd.grad(o, leaves, do)]

    got = run(cudnn.compressed_attention_cudnn_with_lse)
    if bad == "none":
        call = CompressedCall(
            scale=8**-0.5, q_start=0, cu_seqlens=None, toggles=Toggles(), cmp_block=16,
            cmp_stride=8,
        )  # fmt: skip
        want = run(lambda q_, k_, v_, *_: folded_attention(q_, k_, v_, call, model_attend))
    else:
        want = run(compressed_attention_triton_with_lse)
    # lse on the rows that see the bad block is left to the kernel (block scoring reads such
    # a row's NaN off its scores, whatever the normaliser: docs/spec.md).
    sees_bad = torch.tensor([num_cmp_blocks(t + 1, 16, 8) > 1 for t in range(45)], device=DEVICE)
    if bad != "none":
        got[1], want[1] = got[1][:, ~sees_bad], want[1][:, ~sees_bad]
        assert torch.equal(got[0].isnan().flatten(2).any(-1)[0], sees_bad)
    for name, a, b in zip(["o", "lse", "dq", "dk", "dv"], got, want, strict=True):
        assert torch.equal(a.isnan(), b.isnan()), name
        if bad == "none":
            assert torch.equal(a, b), name
        else:
            # Run by run, the Triton tiles group other rows than one call from row 0 does.
            finite = ~a.isnan() & ~a.isneginf()
            assert torch.equal(a.isneginf(), b.isneginf()), name
            assert rel_err(a[finite], b[finite]) < BOUND, name


@pytest.mark.triton
@pytest.mark.skipif(DEVICE is None, reason=SKIP_REASON)
@pytest.mark.parametrize("bad", ["k", "v", "none"])
def test_non_finite_keys_without_a_gradient_are_contained_on_the_device(
    bad: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a gradient the fold always runs, then the Triton forward overwrites o and lse
    where some k_cmp or v_cmp is non-finite, decided on the device. The model of cuDNN here
    leaks a NaN value to rows that do not see its block (0 x NaN in p @ v), as a fused kernel
    may; the result must still be the reference's: NaN exactly on the rows that see the block.
    With finite keys the Triton launch changes nothing: o and lse are the fold's, bit for bit."""
    from nsa_kernels.compressed import cudnn

    def model(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        return model_attend(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(cudnn, "cudnn_attend", model)
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(1, 40, 2, 8, generator=gen)
    k, v = torch.randn(1, 4, 1, 8, generator=gen), torch.randn(1, 4, 1, 8, generator=gen)
    if bad != "none":
        (k if bad == "k" else v)[0, 1, 0, 3] = float("nan")
    q, k, v = (x.to(DEVICE) for x in (q, k, v))
    call = CompressedCall(
        scale=8**-0.5, q_start=0, cu_seqlens=None, toggles=Toggles(), cmp_block=16, cmp_stride=8
    )
    fold_o, fold_lse = folded_attention(q, k, v, call, model)
    o, lse = cudnn.compressed_attention_cudnn_with_lse(q, k, v, 16, 8)
    if bad == "none":
        assert torch.equal(o, fold_o)
        assert torch.equal(lse, fold_lse)
        return
    ref = compressed_attention(q.double(), k.double(), v.double(), 16, 8)
    sees_bad = torch.tensor([num_cmp_blocks(t + 1, 16, 8) > 1 for t in range(40)], device=DEVICE)
    assert bool(torch.isnan(fold_o[0, ~sees_bad]).any()) == (bad == "v"), "the model leaks v"
    assert torch.equal(torch.isnan(o).any(-1).any(-1)[0], sees_bad)
    assert torch.equal(torch.isnan(ref).any(-1).any(-1)[0], sees_bad)
    assert rel_err(o[0, ~sees_bad], ref[0, ~sees_bad]) < BOUND
    # lse on the rows that see the block is left to the kernel (block scoring reads such a
    # row's NaN off its scores, whatever the normaliser: docs/spec.md).
    want_lse = reference_lse(q, k, 16, 8, 0)[0, ~sees_bad]
    blind = torch.isinf(want_lse)
    assert torch.equal(torch.isneginf(lse[0, ~sees_bad]), blind)
    assert rel_err(lse[0, ~sees_bad][~blind], want_lse[~blind]) < BOUND


def test_fold_refuses_keys_it_lacks() -> None:
    q = torch.randn(1, 64, 2, 8, dtype=torch.float64)
    k = torch.randn(1, 3, 1, 8, dtype=torch.float64)
    call = CompressedCall(
        scale=1.0, q_start=0, cu_seqlens=None, toggles=Toggles(), cmp_block=8, cmp_stride=4
    )
    with pytest.raises(ValueError, match="k_cmp holds 3"):
        folded_attention(q, k, k, call, model_attend)


def _ctx(**fields: object) -> OpContext:
    base = OpContext(
        device=torch.device("cuda"), dtype=torch.bfloat16, seq_len=65536, num_q_heads=64,
        num_kv_heads=4, head_dim_qk=128, head_dim_v=128, requires_grad=True, varlen=False,
    )  # fmt: skip
    return replace(base, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"device": torch.device("cpu")}, "runs on CUDA"),
        ({"dtype": torch.float32}, "float16 or bfloat16"),
        ({"head_dim_qk": 100}, "multiples of 8 up to 256"),
        ({"head_dim_v": 512}, "multiples of 8 up to 256"),
        ({"varlen": True}, "packed sequences"),
        ({"q_start": 4096}, "q_start = 4096"),
        ({"seq_len": CUDNN_MIN_LEN - 1}, f"< {CUDNN_MIN_LEN}"),
        ({"seq_len": CUDNN_MIN_LEN - 1, "requires_grad": False}, f"< {CUDNN_MIN_LEN}"),
    ],
)
def test_routing_declines(fields: dict[str, object], reason: str) -> None:
    assert reason in (cudnn_compressed_supports(_ctx(**fields), Toggles()) or "")


def test_routing_declines_when_toggled_off() -> None:
    reason = cudnn_compressed_supports(_ctx(), Toggles(cmp_cudnn=False))
    assert reason == "NSA_CMP_CUDNN is off"


def test_routing_declines_a_gradient_under_deterministic_algorithms() -> None:
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        reason = cudnn_compressed_supports(_ctx(), Toggles())
    finally:
        torch.use_deterministic_algorithms(previous)
    assert reason is not None
    assert "bitwise reproducible" in reason


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "forward_only"])
@pytest.mark.parametrize(("batch", "tq", "q_start", "h", "group", "cmp_block", "d"), CASES)
def test_fold_runs_are_the_folded_output_where_the_calls_left_it(
    batch: int, tq: int, q_start: int, h: int, group: int, cmp_block: int, d: int, grad: bool
) -> None:
    """``folded_runs`` gives o as one run per attention call from the first query that sees a
    block: they make up ``folded_attention``'s o bit for bit, lse is the same, and where the
    kernel writes its output in q's layout (as cuDNN does) every run is a view of that output,
    not a copy; with a gradient as well, each run then differentiable on its own."""
    gen = torch.Generator().manual_seed(tq * 1000 + q_start + 1)
    n = max(num_cmp_blocks(q_start + tq, cmp_block, d), 1) + 2
    q, k, v = (
        torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_(grad)
        for shape in ((batch, tq, h * group, 8), (batch, n, h, 8), (batch, n, h, 6))
    )
    call = CompressedCall(
        scale=8**-0.5, q_start=q_start, cu_seqlens=None, toggles=Toggles(), cmp_block=cmp_block,
        cmp_stride=d,
    )  # fmt: skip
    outputs: list[torch.Tensor] = []

    def cudnn_like(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        o, lse = model_attend(*args)
        outputs.append(like_q_layout(o, args[0]))
        return outputs[-1], lse

    runs, lse = folded_runs(q, k, v, call, cudnn_like)
    want_o, want_lse = folded_attention(q, k, v, call, model_attend)
    assert torch.equal(runs.assemble(), want_o)
    assert torch.equal(lse, want_lse)
    split = row_split(tq, q_start, cmp_block, d)
    if not outputs:
        assert sum(run.shape[1] for run in runs.runs) == 0 if grad else runs.start == 0
        return
    assert runs.start == split.blind
    assert len(runs.runs) == len(outputs) == bool(split.head) + bool(split.rows) + bool(split.tail)
    for run, out in zip(runs.runs, outputs, strict=True):
        assert run.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
        assert run.requires_grad == grad


@pytest.mark.triton
@pytest.mark.skipif(DEVICE is None, reason=SKIP_REASON)
def test_fold_runs_with_a_gradient_give_the_reference_gradients_run_by_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The cuDNN backend's runs with a gradient (its ``fn_runs_with_lse``; float32 here, for its
    containment launch): one upstream gradient per run, never put in one tensor, gives the
    reference's gradients of q, k_cmp and v_cmp."""
    from nsa_kernels.compressed import cudnn

    monkeypatch.setattr(cudnn, "cudnn_attend", model_attend)
    gen = torch.Generator().manual_seed(23)
    q = torch.randn(1, 45, 2, 8, generator=gen).to(DEVICE).requires_grad_()
    k, v = (torch.randn(1, 5, 1, dim, generator=gen).to(DEVICE).requires_grad_() for dim in (8, 6))
    runs, _ = cudnn.compressed_attention_cudnn_runs_with_lse(q, k, v, 16, 8)
    split = row_split(45, 0, 16, 8)
    assert runs.start == split.blind
    assert len(runs.runs) == 2, "the full rows and the cut row after them"
    ref = compressed_attention(q, k, v, 16, 8)
    do = torch.randn(ref.shape, generator=gen).to(DEVICE)
    do[:, : runs.start] = 0  # the blind rows' output is 0 whatever q
    row, grads = runs.start, []
    for run in runs.runs:
        assert run.requires_grad
        grads.append(do[:, row : row + run.shape[1]])
        row += run.shape[1]
    got = torch.autograd.grad(runs.runs, (q, k, v), grads)
    want = torch.autograd.grad(ref, (q, k, v), do)
    for name, a, b in zip("qkv", got, want, strict=True):
        assert rel_err(a, b) < BOUND, f"d{name}"


@pytest.mark.triton
@pytest.mark.skipif(DEVICE is None, reason=SKIP_REASON)
@pytest.mark.parametrize("bad", ["k", "v", "none"])
def test_fold_runs_without_a_gradient_are_contained_run_by_run(
    bad: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runs route contains a non-finite k_cmp or v_cmp as the one-tensor route does: the
    Triton forward over each run's queries at their positions overwrites that run, so NaN lands
    on exactly the rows that see the bad block, from a model of cuDNN that leaks NaN values, and
    every other row is the reference's. With finite keys nothing is overwritten: the runs are
    the one-tensor route's o, bit for bit."""
    from nsa_kernels.compressed import cudnn

    monkeypatch.setattr(cudnn, "cudnn_attend", model_attend)
    gen = torch.Generator().manual_seed(19)
    # T = 45, l = 16, d = 8: 15 blind queries, 3 full rows, a tail of 6.
    q = torch.randn(1, 45, 2, 8, generator=gen)
    k, v = torch.randn(1, 5, 1, 8, generator=gen), torch.randn(1, 5, 1, 8, generator=gen)
    if bad != "none":
        (k if bad == "k" else v)[0, 1, 0, 3] = float("nan")
    q, k, v = (x.to(DEVICE) for x in (q, k, v))
    runs, lse = cudnn.compressed_attention_cudnn_runs_with_lse(q, k, v, 16, 8)
    assert runs.start == 15
    assert [r.shape[1] for r in runs.runs] == [24, 6]
    o = runs.assemble()
    if bad == "none":
        o_want, lse_want = cudnn.compressed_attention_cudnn_with_lse(q, k, v, 16, 8)
        assert torch.equal(o, o_want)
        assert torch.equal(lse, lse_want)
        return
    ref = compressed_attention(q.double(), k.double(), v.double(), 16, 8)
    sees_bad = torch.tensor([num_cmp_blocks(t + 1, 16, 8) > 1 for t in range(45)], device=DEVICE)
    assert torch.equal(torch.isnan(o).any(-1).any(-1)[0], sees_bad)
    assert torch.equal(torch.isnan(ref).any(-1).any(-1)[0], sees_bad)
    assert rel_err(o[0, ~sees_bad], ref[0, ~sees_bad]) < BOUND
    want_lse = reference_lse(q, k, 16, 8, 0)[0, ~sees_bad]
    blind = torch.isinf(want_lse)
    assert torch.equal(torch.isneginf(lse[0, ~sees_bad]), blind)
    assert rel_err(lse[0, ~sees_bad][~blind], want_lse[~blind]) < BOUND


def _call(cmp_block: int, d: int) -> CompressedCall:
    return CompressedCall(
        scale=8**-0.5, q_start=0, cu_seqlens=None, toggles=Toggles(), cmp_block=cmp_block,
        cmp_stride=d,
    )  # fmt: skip
