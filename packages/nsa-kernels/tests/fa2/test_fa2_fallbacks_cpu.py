"""The torch fallbacks (chunked SDPA, FlexAttention) against the nsa-core reference on CPU.

float32 inputs must land within docs/spec.md's 1e-5 of the float64 reference. FlexAttention runs
eagerly on CPU (forward only), which checks its mask_mod; the block tables it is compiled with on
GPU are checked in test_fa2_mapping.py.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from fa2_testing import FLOAT32_BOUND, cu_seqlens_of, randn, rel_err

from nsa_core.blocks import cmp_cu_seqlens, num_cmp_blocks
from nsa_core.reference import compressed_attention, sliding_attention
from nsa_kernels.common import flex
from nsa_kernels.common.flex import compressed_attention_flex, sliding_attention_flex
from nsa_kernels.common.intervals import compressed_intervals
from nsa_kernels.common.sdpa import (
    compressed_attention_sdpa,
    interval_attention_sdpa,
    sliding_attention_sdpa,
)

SLIDING = {"sdpa": sliding_attention_sdpa, "flex": sliding_attention_flex}
COMPRESSED = {"sdpa": compressed_attention_sdpa, "flex": compressed_attention_flex}


@pytest.fixture(autouse=True)
def _quiet_eager_flex() -> Any:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")
        yield


@pytest.mark.parametrize("name", ["sdpa", "flex"])
@pytest.mark.parametrize(
    ("tq", "q_start", "window"), [(150, 0, 16), (150, 0, 1), (40, 25, 9), (1, 70, 32), (70, 0, 500)]
)
def test_sliding_dense(name: str, tq: int, q_start: int, window: int) -> None:
    q = randn(2, tq, 8, 16, dtype=torch.float32)
    k = randn(2, q_start + tq + 3, 2, 16, dtype=torch.float32)
    v = randn(2, q_start + tq + 3, 2, 24, dtype=torch.float32)
    ref = sliding_attention(q.double(), k.double(), v.double(), window, q_start=q_start)
    out = SLIDING[name](q, k, v, window, q_start=q_start)
    assert out.shape == ref.shape
    assert out.dtype == q.dtype
    assert rel_err(out, ref) < FLOAT32_BOUND


@pytest.mark.parametrize("name", ["sdpa", "flex"])
def test_sliding_varlen(name: str) -> None:
    cu = cu_seqlens_of([40, 0, 1, 130, 9])
    total = int(cu[-1])
    q = randn(1, total, 4, 16, dtype=torch.float32)
    k = randn(1, total, 4, 16, dtype=torch.float32)
    v = randn(1, total, 4, 16, dtype=torch.float32)
    ref = sliding_attention(q.double(), k.double(), v.double(), 24, cu_seqlens=cu)
    assert rel_err(SLIDING[name](q, k, v, 24, cu_seqlens=cu), ref) < FLOAT32_BOUND


@pytest.mark.parametrize("name", ["sdpa", "flex"])
@pytest.mark.parametrize(("cl", "d"), [(32, 16), (8, 4), (4, 4)])
@pytest.mark.parametrize(("tq", "q_start"), [(300, 0), (50, 77), (1, 200), (1, 2), (10, 0)])
def test_compressed_dense(name: str, cl: int, d: int, tq: int, q_start: int) -> None:
    n = num_cmp_blocks(q_start + tq, cl, d) + 2
    q = randn(2, tq, 4, 32, dtype=torch.float32)
    kc = randn(2, n, 2, 32, dtype=torch.float32)
    vc = randn(2, n, 2, 16, dtype=torch.float32)
    ref = compressed_attention(q.double(), kc.double(), vc.double(), cl, d, q_start=q_start)
    out = COMPRESSED[name](q, kc, vc, cl, d, q_start=q_start)
    assert not torch.isnan(out).any()
    blind = torch.arange(q_start, q_start + tq) < cl - 1
    assert torch.equal(out[:, blind], torch.zeros_like(out[:, blind]))
    if ref.abs().sum() > 0:
        assert rel_err(out, ref) < FLOAT32_BOUND


@pytest.mark.parametrize("name", ["sdpa", "flex"])
def test_compressed_varlen(name: str) -> None:
    cl, d = 16, 8
    cu = cu_seqlens_of([5, 100, 0, 16, 200, 15])
    n = int(cmp_cu_seqlens(cu, cl, d)[-1])
    q = randn(1, int(cu[-1]), 4, 16, dtype=torch.float32)
    kc = randn(1, n, 1, 16, dtype=torch.float32)
    vc = randn(1, n, 1, 16, dtype=torch.float32)
    ref = compressed_attention(q.double(), kc.double(), vc.double(), cl, d, cu_seqlens=cu)
    out = COMPRESSED[name](q, kc, vc, cl, d, cu_seqlens=cu)
    assert rel_err(out, ref) < FLOAT32_BOUND


def test_sdpa_many_small_chunks() -> None:
    """A tiny budget forces chunks of a few queries, some of them entirely blind."""
    cl, d, tq = 8, 4, 90
    n = num_cmp_blocks(tq, cl, d)
    q = randn(1, tq, 2, 8, dtype=torch.float32)
    kc = randn(1, n, 1, 8, dtype=torch.float32)
    vc = randn(1, n, 1, 8, dtype=torch.float32)
    lo, hi = compressed_intervals(tq, 0, cl, d, q.device)
    out = interval_attention_sdpa(q, kc, vc, lo, hi, 8**-0.5, budget=100)
    ref = compressed_attention(q.double(), kc.double(), vc.double(), cl, d)
    assert rel_err(out, ref) < FLOAT32_BOUND


@pytest.mark.parametrize("name", ["sdpa", "flex"])
def test_compressed_with_no_visible_block_keeps_the_graph(name: str) -> None:
    """T < l: no query sees a compressed block (flex: not one block exists). The output is 0
    and, as in the reference, backward gives exact zero gradients instead of failing on a
    detached output; a NaN in q stays out of them (docs/spec.md, "Non-finite values")."""
    cl, d, tq = 8, 4, 6
    kv_len = 1 if name == "sdpa" else 0  # flex meets an empty K~, sdpa a block nobody sees
    q = randn(1, tq, 2, 8, dtype=torch.float32)
    q[0, 2, 0, 0] = float("nan")
    kc = randn(1, kv_len, 1, 8, dtype=torch.float32)
    vc = randn(1, kv_len, 1, 8, dtype=torch.float32)
    inputs = [t.clone().requires_grad_() for t in (q, kc, vc)]
    out = COMPRESSED[name](*inputs, cl, d)
    assert torch.equal(out, torch.zeros_like(out))
    grads = torch.autograd.grad(out, inputs, torch.ones_like(out))
    for grad, inp in zip(grads, inputs, strict=True):
        assert torch.equal(grad, torch.zeros_like(inp))


def _grad_case(
    fn: Callable[..., torch.Tensor],
    ref_fn: Callable[..., torch.Tensor],
    args: tuple[Any, ...],
    inputs: tuple[torch.Tensor, ...],
    kwargs: dict[str, Any],
) -> None:
    grad_out = torch.randn_like(ref_fn(*inputs, *args, **kwargs))
    got = torch.autograd.grad(fn(*inputs, *args, **kwargs), inputs, grad_out)
    want = torch.autograd.grad(ref_fn(*inputs, *args, **kwargs), inputs, grad_out)
    for a, b in zip(got, want, strict=True):
        assert not torch.isnan(a).any()
        assert rel_err(a, b) < 1e-12


def test_sdpa_gradients_match_reference() -> None:
    cu = cu_seqlens_of([13, 40, 2])
    total = int(cu[-1])

    def inputs(n: int) -> tuple[torch.Tensor, ...]:
        return (
            randn(1, total, 4, 8, dtype=torch.float64, grad=True),
            randn(1, n, 2, 8, dtype=torch.float64, grad=True),
            randn(1, n, 2, 4, dtype=torch.float64, grad=True),
        )

    _grad_case(sliding_attention_sdpa, sliding_attention, (7,), inputs(total), {"cu_seqlens": cu})
    _grad_case(sliding_attention_sdpa, sliding_attention, (5,), inputs(total), {"q_start": 0})
    n = int(cmp_cu_seqlens(cu, 8, 4)[-1])
    _grad_case(
        compressed_attention_sdpa, compressed_attention, (8, 4), inputs(n), {"cu_seqlens": cu}
    )
    n_dense = num_cmp_blocks(total, 8, 4)
    _grad_case(compressed_attention_sdpa, compressed_attention, (8, 4), inputs(n_dense), {})


@pytest.mark.parametrize("name", ["sdpa", "flex"])
def test_argument_errors(name: str) -> None:
    q = randn(2, 10, 4, 8, dtype=torch.float32)
    k = randn(2, 10, 3, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        SLIDING[name](q, k, k, 4)
    cu = cu_seqlens_of([4, 6])
    with pytest.raises(ValueError, match="B == 1"):
        SLIDING[name](q, q, q, 4, cu_seqlens=cu)
    with pytest.raises(ValueError, match="need keys"):
        SLIDING[name](q, q, q, 4, q_start=3)
    kc = randn(2, 1, 4, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="k_cmp holds"):
        COMPRESSED[name](q, kc, kc, 4, 2)


def _flex_cases() -> list[tuple[str, Callable[[], torch.Tensor], torch.Tensor]]:
    """Long enough for several 128-token query and key tiles: the block tables matter."""
    q = randn(1, 700, 4, 16, dtype=torch.float32)
    k = randn(1, 700, 2, 16, dtype=torch.float32)
    v = randn(1, 700, 2, 16, dtype=torch.float32)
    q64, k64, v64 = q.double(), k.double(), v.double()
    cu = cu_seqlens_of([300, 0, 5, 395])
    n = num_cmp_blocks(700, 4, 2)
    kc = randn(1, n, 2, 16, dtype=torch.float32)
    vc = randn(1, n, 2, 16, dtype=torch.float32)
    n_var = int(cmp_cu_seqlens(cu, 4, 2)[-1])
    kv, vv = kc[:, :n_var], vc[:, :n_var]
    return [
        (
            "sliding",
            lambda: sliding_attention_flex(q, k, v, 50),
            sliding_attention(q64, k64, v64, 50),
        ),
        (
            "sliding varlen",
            lambda: sliding_attention_flex(q, k, v, 130, cu_seqlens=cu),
            sliding_attention(q64, k64, v64, 130, cu_seqlens=cu),
        ),
        (
            "compressed",
            lambda: compressed_attention_flex(q, kc, vc, 4, 2),
            compressed_attention(q64, kc.double(), vc.double(), 4, 2),
        ),
        (
            "compressed varlen",
            lambda: compressed_attention_flex(q, kv, vv, 4, 2, cu_seqlens=cu),
            compressed_attention(q64, kv.double(), vv.double(), 4, 2, cu_seqlens=cu),
        ),
    ]


def test_flex_eager_over_many_tiles() -> None:
    for name, run, ref in _flex_cases():
        assert rel_err(run(), ref) < FLOAT32_BOUND, name


@pytest.mark.slow(reason="compiles FlexAttention on the CPU: about a minute")
def test_flex_compiled_on_cpu_honours_block_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled FlexAttention skips the key tiles the block tables leave out (eager does not), so
    this is the CPU check that the tables hold every visible key (about a minute of compiling)."""
    from torch.nn.attention.flex_attention import flex_attention

    from nsa_kernels.common import flex

    compiled = torch.compile(flex_attention)
    monkeypatch.setattr(flex, "_flex", lambda device: compiled)
    for name, run, ref in _flex_cases():
        assert rel_err(run(), ref) < FLOAT32_BOUND, name


def test_flex_reuses_the_block_mask_of_a_dense_shape() -> None:
    flex.clear_block_mask_cache()
    q = randn(1, 70, 4, 8, dtype=torch.float32)
    k, v = randn(1, 90, 2, 8, dtype=torch.float32), randn(1, 90, 2, 8, dtype=torch.float32)
    first = sliding_attention_flex(q, k, v, 16, q_start=20)
    assert flex.block_mask_cache_keys() == [("sliding", 70, 20, 16, q.device)]
    second = sliding_attention_flex(q, k, v, 16, q_start=20)
    other = sliding_attention_flex(q, k, v, 17, q_start=20)
    assert torch.equal(first, second)
    assert rel_err(other, sliding_attention(q, k, v, 17, q_start=20)) < FLOAT32_BOUND
    assert len(flex.block_mask_cache_keys()) == 2


def test_flex_block_mask_cache_is_bounded_and_skips_varlen() -> None:
    flex.clear_block_mask_cache()
    q = randn(1, 40, 2, 8, dtype=torch.float32)
    kc, vc = randn(1, 20, 1, 8, dtype=torch.float32), randn(1, 20, 1, 8, dtype=torch.float32)
    for q_start in range(flex.BLOCK_MASK_CACHE_SIZE + 3):
        got = compressed_attention_flex(q[:, :1], kc, vc, 4, 2, q_start=q_start)
        want = compressed_attention(q[:, :1], kc, vc, 4, 2, q_start=q_start)
        assert rel_err(got, want) < FLOAT32_BOUND
    keys = flex.block_mask_cache_keys()
    assert len(keys) == flex.BLOCK_MASK_CACHE_SIZE
    assert keys[-1] == ("compressed", 1, flex.BLOCK_MASK_CACHE_SIZE + 2, 4, 2, 20, q.device)
    cu = cu_seqlens_of([15, 25])
    k, v = randn(1, 40, 1, 8, dtype=torch.float32), randn(1, 40, 1, 8, dtype=torch.float32)
    sliding_attention_flex(q, k, v, 8, cu_seqlens=cu)
    assert flex.block_mask_cache_keys() == keys


def test_head_chunks_keep_every_operand_under_int32_offsets() -> None:
    # One range when everything fits (the usual call: no copy).
    assert flex.head_chunks(1, 2**17, 2**17, 64, 4, 128) == [(0, 64)]
    # 256k tokens, HQ=64, H=4, head dim 192: 3 * 2^31 elements; ranges of whole groups of 16.
    assert flex.head_chunks(1, 2**18, 2**18, 64, 4, 192) == [(0, 32), (32, 64)]
    # Exactly 2^31 elements is one too many (offsets run to 2^31 - 1).
    assert flex.head_chunks(1, 2**18, 2**18, 64, 4, 128) == [(0, 48), (48, 64)]
    # Fewer heads fit than a group holds: parts of a group, a divisor of G, never two kv heads.
    chunks = flex.head_chunks(1, 2**22, 2**22, 8, 2, 128)
    assert chunks == [(0, 2), (2, 4), (4, 6), (6, 8)]
    for batch, t, hq, h, d in [
        (1, 2**18, 64, 4, 192),
        (2, 2**21, 12, 2, 96),
        (1, 2**20, 6, 1, 640),
    ]:
        chunks = flex.head_chunks(batch, t, t, hq, h, d)
        assert [s for s, _ in chunks] == [0, *(e for _, e in chunks[:-1])]  # they tile 0..HQ
        assert chunks[-1][1] == hq
        for start, end in chunks:
            assert batch * t * d * (end - start) < flex.INT32_OFFSETS
            assert start // (hq // h) == (end - 1) // (hq // h) or (end - start) % (hq // h) == 0
    with pytest.raises(ValueError, match="one head of B=1 x 16777216 tokens x head dim 128"):
        flex.head_chunks(1, 2**24, 2**24, 8, 2, 128)


@pytest.mark.parametrize("group", [1, 4])
def test_flex_in_head_chunks_equals_one_call(group: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Forward only: FlexAttention has no CPU backward (the GPU tier checks the gradients).
    tq, window, h, dk, dv = 96, 20, 2, 16, 8
    q = randn(1, tq, h * group, dk, dtype=torch.float32)
    k = randn(1, tq, h, dk, dtype=torch.float32)
    v = randn(1, tq, h, dv, dtype=torch.float32)
    whole = sliding_attention_flex(q, k, v, window)
    # A limit that lets one head through at a time: every head its own call.
    monkeypatch.setattr(flex, "INT32_OFFSETS", tq * dk + 1)
    assert len(flex.head_chunks(1, tq, tq, h * group, h, dk)) == h * group
    flex.clear_block_mask_cache()
    chunked = sliding_attention_flex(q, k, v, window)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-6)
    ref = sliding_attention(q.double(), k.double(), v.double(), window)
    assert rel_err(chunked, ref) < FLOAT32_BOUND
