"""The selected forward that starts from the sliding branch's local softmax (``local``).

Where the selected and sliding branches share k and v, the sliding kernel hands over each row's
softmax over its forced blocks' keys, ``[0, l')`` and ``[max(jt - 1, 0) l', t]``
(nsa_kernels.common.local_softmax), and the selected walk covers only the row's blocks between them.
Output, log-sum-exp and every gradient must be the reference's, for index rows that hold their
forced blocks; a row without them says so with NaN.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from kernel_testlib import BOUND, DEVICE, SKIP_REASON, rel_err
from sel_testlib import Case, make_inputs, reference, reference_lse

pytest.importorskip("triton")

from nsa_core.reference.combine import gated_combine
from nsa_kernels.common.local_softmax import LocalSoftmax, local_softmax_reference
from nsa_kernels.selected.function import (
    SelConfig,
    selected_attention_fwd,
    selected_attention_gated_triton,
    tma_available,
)

F32, F64 = torch.float32, torch.float64
pytestmark = [pytest.mark.triton, pytest.mark.skipif(DEVICE is None, reason=SKIP_REASON)]
TMA = pytest.mark.skipif(
    not tma_available(), reason="this triton has no triton.tools.tensor_descriptor (< 3.4)"
)

CASES = [
    Case("G=1 batch 2", group=1, batch=2, tq=53, n=5),
    Case("G=3", group=3, tq=45, n=4),
    Case("G=16 paper l'=64", group=16, h=1, tq=150, dk=32, dv=32, sel_block=64, n=4),
    Case("q_start>0 off the block grid", group=2, tq=21, q_start=37, n=3),
    Case("varlen with a length-1 sequence", group=2, tq=58, seqlens=[1, 33, 0, 24], n=4),
    # Block 0 and a contiguous run of blocks ending at jt: every block between is walked.
    Case("spans", group=2, tq=50, n=4, indices="initial_span"),
    # Two programs per row along dv, each starting from its channels of the local output.
    Case("dv chunks", group=2, tq=40, dv=32, n=4, config={"block_dv": 16, "tma": 2}),
    pytest.param(Case("TMA", group=3, tq=45, n=4, config={"tma": 1}), marks=TMA, id="TMA"),
]


def local_of(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, case: Case, cu: Any
) -> LocalSoftmax:
    """The float64 definition of the local softmax, rounded to the kernel's float32."""
    want = local_softmax_reference(
        q.double(), k.double(), v.double(), case.sel_block, q_start=case.q_start, cu_seqlens=cu
    )
    return LocalSoftmax(o=want.o.float(), lse=want.lse.float(), sel_block=case.sel_block)


def ids(case: Any) -> str:
    return str(case.name)


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_forward_from_the_local_softmax_matches_reference(case: Case) -> None:
    assert DEVICE is not None
    gen = torch.Generator().manual_seed(5)
    q, k, v, idx, cu = make_inputs(case, gen, F32, DEVICE)
    o, lse = selected_attention_fwd(
        q, k, v, idx, case.sel_block, q_start=case.q_start, cu_seqlens=cu,
        config=SelConfig(**case.config), local=local_of(q, k, v, case, cu),
    )  # fmt: skip
    assert rel_err(o, reference(q, k, v, idx, case, cu)) < BOUND[F32]
    want_lse = reference_lse(q, k, idx, case)
    assert torch.equal(torch.isinf(lse).cpu(), torch.isinf(want_lse))
    finite = torch.isfinite(want_lse)
    assert (lse.double().cpu()[finite] - want_lse[finite]).abs().max().item() < BOUND[F32]


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_gated_gradients_from_the_local_softmax_match_reference(case: Case) -> None:
    """The gated launch with a gradient: o and the gradients of q, k, v, o_cmp, o_win and gates
    within twice the float32 bound of the float64 reference (the backward recomputes the
    softmax from the final lse, so it needs nothing of the local one)."""
    assert DEVICE is not None
    gen = torch.Generator().manual_seed(6)
    q, k, v, idx, cu = make_inputs(case, gen, F32, DEVICE)
    shape = (case.batch, case.tq, case.hq, case.dv)
    o_cmp = torch.randn(shape, generator=gen).to(DEVICE)
    o_win = torch.randn(shape, generator=gen).to(DEVICE)
    gates = torch.sigmoid(torch.randn(*shape[:3], 3, generator=gen)).to(DEVICE)
    do = torch.randn(shape, generator=gen).to(DEVICE)
    local = local_of(q, k, v, case, cu)

    def grads(dtype: torch.dtype, fused: bool) -> list[torch.Tensor]:
        leaves = [t.to(dtype).clone().requires_grad_() for t in (q, k, v, o_cmp, o_win, gates)]
        if fused:
            out = selected_attention_gated_triton(
                *leaves[:3], idx, case.sel_block, o_cmp=leaves[3], o_win=leaves[4],
                gates=leaves[5], q_start=case.q_start, cu_seqlens=cu,
                config=SelConfig(**case.config), local=local,
            )  # fmt: skip
        else:
            o_sel = reference(*leaves[:3], idx, case, cu)
            out = gated_combine(leaves[3], o_sel, leaves[4], leaves[5])
        return [out.detach(), *torch.autograd.grad(out, leaves, do.to(dtype))]

    names = ("o", "dq", "dk", "dv", "d o_cmp", "d o_win", "d gates")
    for name, a, b in zip(names, grads(F32, True), grads(F64, False), strict=True):
        assert rel_err(a, b) < 2 * BOUND[F32], name


def test_a_row_without_its_forced_blocks_gives_nan() -> None:
    """The local softmax stands for the blocks 0, jt - 1 and jt; a row whose set lacks one of
    them has no right output from it: NaN on that row's heads, the other rows as the
    reference."""
    assert DEVICE is not None
    case = Case("missing", group=2, tq=40, n=3)
    gen = torch.Generator().manual_seed(7)
    q, k, v, idx, cu = make_inputs(case, gen, F32, DEVICE)
    idx[0, 35, 1] = torch.tensor([0, 1, -1], dtype=idx.dtype)  # jt = 2: block 2 is missing
    idx[0, 38, 0] = torch.tensor([1, 2, -1], dtype=idx.dtype)  # jt = 2: block 0 is missing
    o, lse = selected_attention_fwd(q, k, v, idx, case.sel_block, local=local_of(q, k, v, case, cu))
    bad = torch.zeros(o.shape[:3], dtype=torch.bool)
    bad[0, 35, 2:4] = True  # the two query heads of kv head 1
    bad[0, 38, 0:2] = True
    assert torch.isnan(o.cpu()).any(-1).equal(bad)
    assert torch.isnan(lse.cpu()).equal(bad)
    want = reference(q, k, v, idx, case, cu)
    assert rel_err(o[~bad.to(o.device)], want[~bad]) < BOUND[F32]


@pytest.mark.parametrize(
    ("where", "bad"),
    [("v", float("nan")), ("v", float("inf")), ("k", float("nan")), ("k", float("-inf"))],
    ids=["nan_value", "inf_value", "nan_key", "-inf_key"],
)
@pytest.mark.parametrize("at", [37, 5], ids=["in_local_blocks", "in_block_0"])
def test_a_non_finite_local_key_or_value_reaches_the_rows_the_plain_walk_gives_it(
    where: str, bad: float, at: int
) -> None:
    """A non-finite key or value inside some rows' local blocks (position 37: those of blocks 2
    and 3, l' = 16) or in block 0 (every row's): the sliding branch's local
    softmax (its containing launch) and the selected walk from it give non-finite values
    exactly where the selected kernel without it does (docs/spec.md, "Non-finite values"; which
    of NaN or inf is not specified: the sliding kernel writes NaN in a value channel that meets
    an inf), and the same finite values elsewhere within the float32 bound."""
    from nsa_kernels.sliding.triton_function import sliding_attention_triton_with_local

    assert DEVICE is not None
    case = Case("non-finite", group=2, tq=70, n=4)
    gen = torch.Generator().manual_seed(8)
    q, k, v, idx, _ = make_inputs(case, gen, F32, DEVICE)
    target = k if where == "k" else v
    target[0, at, 1, 3] = bad  # kv head 1
    _, local = sliding_attention_triton_with_local(q, k, v, 40, sel_block=case.sel_block)
    o_local, lse_local = selected_attention_fwd(q, k, v, idx, case.sel_block, local=local)
    o_plain, lse_plain = selected_attention_fwd(q, k, v, idx, case.sel_block)
    assert not torch.isfinite(o_plain).all()
    for got, want in ((o_local, o_plain), (lse_local, lse_plain)):
        finite = torch.isfinite(want)
        assert torch.equal(torch.isfinite(got), finite)
        assert rel_err(got[finite], want[finite]) < BOUND[F32]


def test_a_local_softmax_needs_a_call_prepared_for_it() -> None:
    """The local softmax and the forced-block prologue cover the same blocks: forward refuses
    a launch whose config still has the prologue on (prepare(..., local=True) turns it off)."""
    from nsa_kernels.selected.forward import forward
    from nsa_kernels.selected.launch import prepare

    if not tma_available():
        pytest.skip("this triton has no triton.tools.tensor_descriptor (< 3.4)")
    assert DEVICE is not None
    case = Case("prologue", group=2, tq=40, n=3)
    q, k, v, idx, cu = make_inputs(case, torch.Generator().manual_seed(9), F32, DEVICE)
    info = prepare(q, k, v, idx, case.sel_block, None, 0, cu, SelConfig(tma=1), None)
    assert info.cfg.forced_tokens > 1
    with pytest.raises(ValueError, match="prepared with local=True"):
        forward(q, k, v, idx, info, local=local_of(q, k, v, case, cu))
