"""GPU parity of the cuDNN compressed backend at real shapes, and where the routing sends it.

Bounds from docs/spec.md: relative error against the reference in float32 on the same inputs,
1e-2 for bfloat16 (5e-3 float16), gradients twice that. Paper shapes: HQ=64, H=4 (G=16), l=32,
d=16. The backend is routed on sm_90 only, so the tests need one.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from kernel_testlib import BOUND, rel_err

from nsa_core import registry
from nsa_core.blocks import num_cmp_blocks
from nsa_core.ops import op_context
from nsa_core.reference.compressed_attention import compressed_attention
from nsa_core.toggles import Toggles
from nsa_kernels.common.op_calls import CompressedCall
from nsa_kernels.compressed.cudnn import (
    compressed_attention_cudnn_with_lse,
    cudnn_attend,
    cudnn_missing_reason,
    folded_attention,
)
from nsa_kernels.compressed.function import compressed_attention_triton_with_lse

L_CMP, D_CMP = 32, 16


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if torch.cuda.get_device_capability() < (9, 0):
        return "the cuDNN compressed backend is routed on sm_90 only"
    return cudnn_missing_reason()


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason())),
]


def _draw(
    request: pytest.FixtureRequest, tq: int, dk: int, dv: int, q_start: int, dtype: torch.dtype
) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(zlib.crc32(request.node.nodeid.encode()))
    n = num_cmp_blocks(q_start + tq, L_CMP, D_CMP)
    shapes = ((1, tq, 64, dk), (1, n, 4, dk), (1, n, 4, dv), (1, tq, 64, dv))
    return [torch.randn(s, device="cuda", generator=gen).to(dtype) for s in shapes]


def _lse_float32(q: torch.Tensor, k: torch.Tensor, q_start: int) -> torch.Tensor:
    """lse [1, Tq, HQ] of scale * q.k over the visible blocks, float32 (-inf: none)."""
    kf = k.float().repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    s = torch.einsum("bthd,bnhd->bthn", q.float(), kf) * q.shape[-1] ** -0.5
    pos = torch.arange(q_start, q_start + q.shape[1], device="cuda")
    last = torch.arange(k.shape[1], device="cuda") * D_CMP + L_CMP - 1
    seen = last[None, :] <= pos[:, None]
    return torch.logsumexp(s.masked_fill(~seen[None, :, None, :], float("-inf")), dim=-1)


@pytest.mark.parametrize(("dk", "dv"), [(128, 128), (192, 128)], ids=["d128", "dk192_dv128"])
def test_bf16_forward_and_lse_at_8k(dk: int, dv: int, request: pytest.FixtureRequest) -> None:
    q, k, v, _ = _draw(request, 8192, dk, dv, 0, torch.bfloat16)
    o, lse = compressed_attention_cudnn_with_lse(q, k, v, L_CMP, D_CMP)
    ref = compressed_attention(q.float(), k.float(), v.float(), L_CMP, D_CMP)
    assert o.dtype == torch.bfloat16
    assert lse.dtype == torch.float32
    err = rel_err(o, ref)
    assert err < BOUND[torch.bfloat16], f"o: relative error {err:.2e}"
    ref_lse = _lse_float32(q, k, 0)
    blind = torch.isinf(ref_lse)
    assert torch.equal(torch.isneginf(lse), blind)
    assert int(blind.sum()) == (L_CMP - 1) * 64, "the first l - 1 rows see nothing"
    assert torch.count_nonzero(o[blind]) == 0
    err = rel_err(lse[~blind], ref_lse[~blind])
    assert err < BOUND[torch.bfloat16], f"lse: relative error {err:.2e}"


@pytest.mark.parametrize(
    ("tq", "q_start", "dk", "dtype"),
    [
        (2048, 0, 128, torch.bfloat16),
        (2048, 0, 192, torch.bfloat16),
        (1500, 700, 128, torch.bfloat16),
        (1000, 0, 64, torch.float16),
    ],
    ids=["2k", "2k_dk192", "q_start700", "fp16_dk64"],
)
def test_gradients(
    tq: int, q_start: int, dk: int, dtype: torch.dtype, request: pytest.FixtureRequest
) -> None:
    q, k, v, do = _draw(request, tq, dk, 128 if dk == 192 else dk, q_start, dtype)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o, _ = compressed_attention_cudnn_with_lse(*leaves, L_CMP, D_CMP, q_start=q_start)
    o.backward(do)
    ref_leaves = [x.float().requires_grad_() for x in (q, k, v)]
    ref = compressed_attention(*ref_leaves, L_CMP, D_CMP, q_start=q_start)
    ref.backward(do.float())
    err = rel_err(o, ref)
    assert err < BOUND[dtype], f"o: relative error {err:.2e}"
    for name, a, b in zip("qkv", leaves, ref_leaves, strict=True):
        assert a.grad is not None
        assert b.grad is not None
        err = rel_err(a.grad, b.grad)
        assert err < 2 * BOUND[dtype], f"d{name}: relative error {err:.2e}"


def test_every_query_blind_keeps_a_zero_gradient(request: pytest.FixtureRequest) -> None:
    q, k, v, do = _draw(request, 20, 128, 128, 0, torch.bfloat16)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o, lse = compressed_attention_cudnn_with_lse(*leaves, L_CMP, D_CMP)
    o.backward(do)
    assert torch.count_nonzero(o) == 0
    assert bool(torch.isneginf(lse).all())
    assert all(x.grad is not None and torch.count_nonzero(x.grad) == 0 for x in leaves)


@pytest.mark.parametrize("bad", ["k", "v", "none"])
def test_forward_without_a_gradient_contains_non_finite_keys_on_the_device(
    bad: str, request: pytest.FixtureRequest
) -> None:
    """docs/spec.md, "Non-finite values", with no host sync: a NaN in k_cmp or v_cmp makes the
    backend's o and lse the Triton forward's, bit for bit (NaN only on the rows that see the
    block); finite keys leave cuDNN's own o and lse untouched."""
    q, k, v, _ = _draw(request, 2048, 128, 128, 0, torch.bfloat16)
    if bad != "none":
        (k if bad == "k" else v)[0, 40, 1, 7] = float("nan")
    with torch.no_grad():
        o, lse = compressed_attention_cudnn_with_lse(q, k, v, L_CMP, D_CMP)
        if bad == "none":
            call = CompressedCall(
                scale=128**-0.5, q_start=0, cu_seqlens=None, toggles=Toggles(),
                cmp_block=L_CMP, cmp_stride=D_CMP,
            )  # fmt: skip
            want_o, want_lse = folded_attention(q, k, v, call, cudnn_attend)
        else:
            want_o, want_lse = compressed_attention_triton_with_lse(q, k, v, L_CMP, D_CMP)
    assert torch.equal(o.isnan(), want_o.isnan())
    assert torch.equal(o.nan_to_num(), want_o.nan_to_num())
    assert torch.equal(lse.nan_to_num(), want_lse.nan_to_num())
    sees_bad = torch.tensor(
        [num_cmp_blocks(t + 1, L_CMP, D_CMP) > 40 for t in range(2048)], device="cuda"
    )
    assert torch.equal(o.isnan().flatten(2).any(-1)[0], sees_bad & (bad != "none"))


@pytest.mark.parametrize("bad", ["k", "none"])
def test_with_a_gradient_non_finite_keys_take_the_triton_backward_without_a_host_sync(
    bad: str, request: pytest.FixtureRequest
) -> None:
    """docs/spec.md, "Non-finite values", with a gradient: the forward queues no host sync (sync
    debug mode), contains o and lse on the device, and the backward reads the finite flag on the
    host: a NaN in k_cmp gives the Triton Function's o and gradients (NaN exactly where it puts
    them; the rest within the bfloat16 bound, its tiles grouping rows run by run); finite keys
    give cuDNN's gradients, within the bound of the float32 reference."""
    q, k, v, do = _draw(request, 2048 + 3, 128, 128, 0, torch.bfloat16)
    if bad != "none":
        k[0, 40, 1, 7] = float("nan")

    def run(fn: object, sync_check: bool) -> list[torch.Tensor]:
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        if sync_check:
            torch.cuda.set_sync_debug_mode("error")
        try:
            o, _ = fn(*leaves, L_CMP, D_CMP)  # type: ignore[operator]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return [o.detach(), *torch.autograd.grad(o, leaves, do)]

    run(compressed_attention_cudnn_with_lse, sync_check=False)  # warm-up: first-use setup
    got = run(compressed_attention_cudnn_with_lse, sync_check=True)
    if bad == "none":
        ref = [x.float().requires_grad_() for x in (q, k, v)]
        o_ref = compressed_attention(*ref, L_CMP, D_CMP)
        want = [o_ref.detach(), *torch.autograd.grad(o_ref, ref, do.float())]
        for name, a, b in zip(["o", "dq", "dk", "dv"], got, want, strict=True):
            assert rel_err(a, b) < 2 * BOUND[torch.bfloat16], name
        return
    want = run(compressed_attention_triton_with_lse, sync_check=False)
    assert bool(got[0].isnan().any()), "the NaN reaches the rows that see its block"
    for name, a, b in zip(["o", "dq", "dk", "dv"], got, want, strict=True):
        assert torch.equal(a.isnan(), b.isnan()), name
        finite = ~a.isnan()
        assert rel_err(a[finite], b[finite]) < BOUND[torch.bfloat16], name


@pytest.mark.usefixtures("kernels_registered")
def test_routed_from_16k() -> None:
    def chosen(tq: int, q_start: int, grad: bool) -> str:
        q = torch.empty(1, tq, 64, 128, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
        k = torch.empty(1, 8, 4, 128, device="cuda", dtype=torch.bfloat16)
        ctx = op_context(q, k, k, q_start + tq, varlen=False, q_start=q_start)
        return registry.resolve("compressed_attention", ctx, Toggles()).backend.name

    assert chosen(16384, 0, grad=False) == "cudnn"
    assert chosen(16384, 0, grad=True) == "cudnn"
    assert chosen(8192, 0, grad=False) != "cudnn"
    assert chosen(8192, 0, grad=True) != "cudnn"
    assert chosen(16384, 16384, grad=False) != "cudnn"


@pytest.mark.parametrize("tq", [16384, 16384 + 7], ids=["tail_1", "tail_8"])
def test_runs_are_cudnns_own_output_and_the_one_tensor_route_bit_for_bit(
    tq: int, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a gradient the runs route leaves o where cuDNN wrote it: each run is a view of
    the output of its cuDNN call (torch allocates that output in q's layout, so the folded rows
    flatten without a copy), and together they are the one-tensor route's o, bit for bit. The
    lse too, but for a tail of one query: cuDNN's kernel for a single query row is not bitwise
    reproducible in its lse from call to call (2 or 3 of 64 heads differ by up to 4.8e-7 over
    three repeats of the same call, docs/results/2026-11-26-h100-layer-9.md), so that row is
    held to float32 rounding (2^-20 relative)."""
    from nsa_kernels.compressed import cudnn

    outputs: list[torch.Tensor] = []

    def recording(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        o, lse = cudnn_attend(*args)  # type: ignore[arg-type]
        outputs.append(o)
        return o, lse

    q, k, v, _ = _draw(request, tq, 128, 128, 0, torch.bfloat16)
    want_o, want_lse = compressed_attention_cudnn_with_lse(q, k, v, L_CMP, D_CMP)
    monkeypatch.setattr(cudnn, "cudnn_attend", recording)
    runs, lse = cudnn.compressed_attention_cudnn_runs_with_lse(q, k, v, L_CMP, D_CMP)
    assert runs.start == L_CMP - 1
    assert len(runs.runs) == len(outputs) == 2, "the full rows and the tail"
    for run, out in zip(runs.runs, outputs, strict=True):
        assert run.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
    assert torch.equal(runs.assemble(), want_o)
    one_query_tail = tq - (L_CMP - 1) - runs.runs[0].shape[1] == 1
    assert torch.equal(lse[:, :-1], want_lse[:, :-1])
    if one_query_tail:
        torch.testing.assert_close(lse[:, -1], want_lse[:, -1], rtol=2**-20, atol=0)
    else:
        assert torch.equal(lse[:, -1], want_lse[:, -1])
