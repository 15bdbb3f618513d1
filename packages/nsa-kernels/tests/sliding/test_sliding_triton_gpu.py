"""GPU parity of the Triton sliding branch at the paper's shapes, and its route when pinned.

Bounds from docs/spec.md: relative error against the reference in float32 on the same inputs,
1e-2 for bfloat16, gradients twice that. Shapes: HQ=64, H=4 (G=16), d=128, w=512.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from kernel_testlib import BOUND, assert_grads_close, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.triton]
pytest.importorskip("triton")

import nsa_core  # noqa: E402
from nsa_core.reference import sliding_attention  # noqa: E402
from nsa_core.registry import OpContext, resolve  # noqa: E402
from nsa_core.toggles import Toggles, reload_toggles  # noqa: E402
from nsa_kernels.sliding.triton_function import sliding_attention_triton  # noqa: E402

WINDOW = 512


def _gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.mark.parametrize(
    ("tq", "dk", "dv"),
    [(8192, 128, 128), (3001, 128, 128), (1000, 40, 24), (1000, 256, 256)],
    ids=["8192", "3001", "dk40_dv24", "d256"],
)
def test_bf16_paper_shapes_match_the_float32_reference(
    tq: int, dk: int, dv: int, request: pytest.FixtureRequest
) -> None:
    """The paper's heads at d = 128; also head dims off multiples of 16 (the forward once read
    out of bounds at dk = 40, dv = 24) and the widest, 256."""
    gen = _gen(request)
    q = torch.randn(1, tq, 64, dk, device="cuda", generator=gen).bfloat16()
    k = torch.randn(1, tq, 4, dk, device="cuda", generator=gen).bfloat16()
    v = torch.randn(1, tq, 4, dv, device="cuda", generator=gen).bfloat16()
    do = torch.randn(1, tq, 64, dv, device="cuda", generator=gen).bfloat16()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = sliding_attention_triton(*leaves, WINDOW)
    torch.autograd.backward(o, do)
    ref_leaves = [t.float().requires_grad_() for t in (q, k, v)]
    ref = sliding_attention(*ref_leaves, WINDOW)
    torch.autograd.backward(ref, do.float())
    assert rel_err(o, ref) < BOUND[torch.bfloat16]
    assert_grads_close(leaves, ref_leaves, 2 * BOUND[torch.bfloat16])


@pytest.mark.usefixtures("kernels_registered")
def test_pinned_route_serves_the_public_op(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = OpContext.for_config(
        nsa_core.NSAConfig(num_q_heads=64, num_kv_heads=4, head_dim_qk=128, head_dim_v=128),
        device=torch.device("cuda"),
        dtype=torch.bfloat16,
        seq_len=4096,
    )
    assert resolve("sliding_attention", ctx, Toggles(win_backend="triton_win")).backend.name == (
        "triton_win"
    )
    # By default it serves too, unless flash_attn is installed (FA-2 ranks above it).
    assert resolve("sliding_attention", ctx, Toggles()).backend.name in ("fa2", "triton_win")
    q = torch.randn(1, 300, 8, 64, device="cuda")
    kv = torch.randn(1, 300, 2, 64, device="cuda")
    monkeypatch.setenv("NSA_WIN_BACKEND", "triton_win")
    reload_toggles()
    try:
        got = nsa_core.sliding_attention(q, kv, kv, 37)
    finally:
        monkeypatch.delenv("NSA_WIN_BACKEND")
        reload_toggles()
    assert torch.equal(got, sliding_attention_triton(q, kv, kv, 37))
