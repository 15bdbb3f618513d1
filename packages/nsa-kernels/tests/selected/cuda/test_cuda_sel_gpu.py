"""The CUDA selection kernel on a GPU against the nsa-core reference (forward).

Same inputs and the same block indices; the reference runs in float32 on the upcast inputs.
Bounds: MAE < 1e-3 in fp16 (the Triton kernel's GPU parity bar) and docs/spec.md's relative
error 5e-3 (fp16) / 1e-2 (bf16).
"""

from __future__ import annotations

import pytest
import torch
from cuda_sel_testing import messy_indices, nsa_like_indices

from nsa_core.blocks import num_sel_blocks
from nsa_core.reference import selected_attention
from nsa_kernels.selected.cuda import (
    build_unavailable_reason,
    load_extension,
    selected_attention_cuda,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

REL_BOUND = {torch.float16: 5e-3, torch.bfloat16: 1e-2}
MAE_BOUND_FP16 = 1e-3


@pytest.fixture(scope="module", autouse=True)
def extension() -> None:
    reason = build_unavailable_reason()
    if reason is not None:
        pytest.skip(f"cuda_sel cannot be built: {reason}")
    load_extension(verbose=True)


def _rand(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", generator=gen).to(dtype)


def _compare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor,
    sel_block: int,
    q_start: int = 0,
    cu_seqlens: torch.Tensor | None = None,
) -> None:
    with torch.no_grad():
        out = selected_attention_cuda(
            q, k, v, idx, sel_block, q_start=q_start, cu_seqlens=cu_seqlens
        )
        ref = selected_attention(
            q.float(), k.float(), v.float(), idx, sel_block, q_start=q_start, cu_seqlens=cu_seqlens
        )
    assert out.dtype == q.dtype
    assert out.shape == ref.shape
    assert torch.isfinite(out).all()
    diff = (out.float() - ref).abs()
    mae = float(diff.mean())
    rel = float(diff.norm() / ref.norm().clamp_min(1e-30))
    print(f"cuda_sel {tuple(q.shape)} {q.dtype}: MAE {mae:.2e}, relative {rel:.2e}")
    if q.dtype == torch.float16:
        assert mae < MAE_BOUND_FP16
    assert rel < REL_BOUND[q.dtype]


SHAPES = [
    # (B, T, HQ, H, dk, dv, sel_block, n)
    (2, 300, 16, 4, 64, 64, 32, 4),
    (1, 1000, 64, 4, 192, 128, 64, 16),
    (2, 200, 4, 4, 256, 256, 16, 8),
    (1, 513, 32, 2, 128, 64, 64, 3),
    (1, 130, 6, 3, 40, 24, 8, 5),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_cuda_sel_parity(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    b, t, hq, h, dk, dv, sel_block, n = shape
    q = _rand(b, t, hq, dk, dtype=dtype, seed=1)
    k = _rand(b, t, h, dk, dtype=dtype, seed=2)
    v = _rand(b, t, h, dv, dtype=dtype, seed=3)
    idx = nsa_like_indices(b, t, h, n, sel_block, 0, num_sel_blocks(t, sel_block), "cuda")
    _compare(q, k, v, idx, sel_block)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cuda_sel_repeats_future_blocks_and_padding(dtype: torch.dtype) -> None:
    """Repeated indices count once, blocks after t add nothing, rows with nothing give 0."""
    b, t, hq, h, dk, dv, sel_block, n = 2, 257, 8, 2, 64, 64, 16, 7
    q = _rand(b, t, hq, dk, dtype=dtype, seed=4)
    k = _rand(b, t, h, dk, dtype=dtype, seed=5)
    v = _rand(b, t, h, dv, dtype=dtype, seed=6)
    idx = messy_indices(b, t, h, n, num_sel_blocks(t, sel_block), "cuda")
    _compare(q, k, v, idx, sel_block)
    with torch.no_grad():
        empty = selected_attention_cuda(q, k, v, torch.full_like(idx, -1), sel_block)
    assert torch.equal(empty, torch.zeros_like(empty))


@pytest.mark.parametrize("q_start", [0, 63, 64, 1000])
def test_cuda_sel_decode_step(q_start: int) -> None:
    dtype, hq, h, dk, dv, sel_block, n = torch.float16, 16, 4, 128, 128, 64, 16
    tk = q_start + 1
    q = _rand(2, 1, hq, dk, dtype=dtype, seed=7)
    k = _rand(2, tk, h, dk, dtype=dtype, seed=8)
    v = _rand(2, tk, h, dv, dtype=dtype, seed=9)
    idx = nsa_like_indices(2, 1, h, n, sel_block, q_start, num_sel_blocks(tk, sel_block), "cuda")
    _compare(q, k, v, idx, sel_block, q_start=q_start)


def test_cuda_sel_varlen() -> None:
    lengths = [100, 1, 0, 700, 33]
    cu = torch.tensor(
        [0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda"
    )
    total, hq, h, d, sel_block, n = sum(lengths), 16, 4, 64, 32, 6
    q = _rand(1, total, hq, d, dtype=torch.float16, seed=10)
    k = _rand(1, total, h, d, dtype=torch.float16, seed=11)
    v = _rand(1, total, h, d, dtype=torch.float16, seed=12)
    idx = torch.cat(
        [
            nsa_like_indices(
                1, length, h, n, sel_block, 0, max(1, num_sel_blocks(length, sel_block)), seed=s
            )
            for s, length in enumerate(lengths)
        ],
        dim=1,
    ).cuda()
    _compare(q, k, v, idx, sel_block, cu_seqlens=cu)


def test_cuda_sel_refuses_grad() -> None:
    q = _rand(1, 8, 2, 8, dtype=torch.float16, seed=0).requires_grad_(True)
    k = _rand(1, 8, 1, 8, dtype=torch.float16, seed=0)
    idx = torch.zeros(1, 8, 1, 1, dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="forward only"):
        selected_attention_cuda(q, k, k, idx, 4)
