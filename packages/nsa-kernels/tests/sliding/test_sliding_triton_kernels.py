"""Triton sliding-window attention vs the float64 reference: forward and gradients, small shapes.

The sliding branch runs the compressed branch's kernels with l = d = 1 and a window
(nsa_kernels.sliding.triton_function). Runs on CPU under TRITON_INTERPRET=1 (CI) or on a CUDA GPU,
in float32 against the float64 reference, held to docs/spec.md's float32 bound (1e-5; gradients
2e-5). Tiles are small (16 rows x 16 keys), so that the windows start inside tiles, one tile's
rows have windows that start in different tiles, and the split dk/dv segments run on short
sequences.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import pytest
import torch
from kernel_testlib import (
    BOUND,
    CMP_SMALL_TILES,
    CMP_SPLIT_TILES,
    DEVICE,
    SKIP_REASON,
    KernelCase,
    assert_grads_close,
    rel_err,
)

from nsa_core.reference import sliding_attention
from nsa_kernels.common.local_softmax import local_softmax_reference

pytestmark = [pytest.mark.triton, pytest.mark.skipif(DEVICE is None, reason=SKIP_REASON)]
pytest.importorskip("triton")

from nsa_kernels.compressed.config import CmpConfig  # noqa: E402
from nsa_kernels.sliding.triton_function import (  # noqa: E402
    sliding_attention_triton,
    sliding_attention_triton_with_local,
)

SMALL, SPLIT = CMP_SMALL_TILES, CMP_SPLIT_TILES


@dataclass
class Case(KernelCase):
    """One sliding call over ``q_start + tq`` keys with a window of ``window`` keys (and, for
    the local softmax, selection blocks of ``sel_block`` tokens)."""

    window: int = 8
    dv: int = 16
    sel_block: int = 4


CASES = [
    # G = 1: a 16-row tile is 16 tokens whose windows start in two key tiles; dk != dv.
    Case("g1_window_in_tile", window=7, tq=83, batch=2, h=2, dk=16, dv=32, config=SMALL),
    # Windows longer than a tile: unmasked key tiles between the masked first and last ones.
    Case("g1_long_window", window=37, tq=150, config=SPLIT),
    # G = 3 does not divide the 16 rows of a tile (5 tokens x 3 heads + 1 padding row).
    Case("g3", window=5, tq=45, h=2, group=3, dk=32, dv=16, config=SPLIT),
    # G = 16: one token per 16-row tile; w = 1 sees the token alone.
    Case("g16_w1", window=1, tq=37, group=16, config=SPLIT),
    # G = 20 > 16 rows: two head chunks; head dims that are not powers of two.
    Case("g20_chunks_odd_dims", window=9, tq=21, group=20, dk=24, dv=40, config=SMALL),
    # Queries start late: their windows reach back past q_start.
    Case("q_start", window=11, tq=30, q_start=37, h=2, group=2, config=SPLIT),
    # Packed: a length-1 sequence, an empty one, one shorter than the window, two long ones.
    Case("varlen", window=6, tq=88, seqlens=[1, 40, 0, 3, 37, 7], group=2, dk=32, config=SPLIT),
    # A window as long as the keys: plain causal attention, through the unwindowed kernels.
    Case("window_covers_all", window=64, tq=50, group=2, config=SMALL),
    # The default tiles; the paper's dk = 192, dv = 128.
    Case("dk192_default_tiles", window=13, tq=40, group=2, dk=192, dv=128),
]  # fmt: skip
IDS = [c.name for c in CASES]


def inputs(
    case: Case, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """q [B, Tq, HQ, dk], k [B, Tk, H, dk], v [B, Tk, H, dv] float32 on DEVICE, cu_seqlens."""
    assert DEVICE is not None
    keys = case.q_start + case.tq
    q = torch.randn(case.batch, case.tq, case.hq, case.dk, generator=gen)
    k = torch.randn(case.batch, keys, case.h, case.dk, generator=gen)
    v = torch.randn(case.batch, keys, case.h, case.dv, generator=gen)
    cu = None
    if case.seqlens is not None:
        assert sum(case.seqlens) == case.tq, case
        assert case.batch == 1, case
        cu = torch.tensor([0, *torch.tensor(case.seqlens).cumsum(0).tolist()], dtype=torch.int32)
        cu = cu.to(DEVICE)
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cu


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward_and_gradients_match_reference(case: Case, request: pytest.FixtureRequest) -> None:
    gen = torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
    q, k, v, cu = inputs(case, gen)
    do = torch.randn(case.batch, case.tq, case.hq, case.dv, generator=gen).to(q.device)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = sliding_attention_triton(
        *leaves, case.window, q_start=case.q_start, cu_seqlens=cu, config=CmpConfig(**case.config)
    )
    torch.autograd.backward(o, do)
    ref_leaves = [t.double().cpu().requires_grad_() for t in (q, k, v)]
    ref = sliding_attention(
        *ref_leaves,
        case.window,
        q_start=case.q_start,
        cu_seqlens=None if cu is None else cu.cpu(),
    )
    torch.autograd.backward(ref, do.double().cpu())

    assert o.dtype == q.dtype
    assert o.shape == ref.shape
    assert rel_err(o, ref) < BOUND[torch.float32]
    assert_grads_close(leaves, ref_leaves, 2 * BOUND[torch.float32])


# The local softmax (cmp_fwd_kernel's LOCAL): w >= 2 l' or a window over all keys.
LOCAL_CASES = [
    # G = 1: a 16-row tile is 16 tokens over two 8-token blocks, so its rows' local keys start
    # at two places; batch 2.
    Case("g1_tile_over_two_blocks", window=20, sel_block=8, tq=83, batch=2, h=2, config=SMALL),
    # G = 3 (padding rows), l' = 4 < a 16-key tile; dk != dv.
    Case("g3", window=16, sel_block=4, tq=45, h=2, group=3, dk=32, config=SPLIT),
    # G = 16: one token per tile; w = 2 l' exactly, and l' = a key tile.
    Case("g16_w_is_2_sel", window=32, sel_block=16, tq=70, group=16, config=SPLIT),
    # Queries start late, off the block grid.
    Case("q_start", window=24, sel_block=8, tq=30, q_start=37, h=2, group=2, config=SPLIT),
    # Packed: a length-1 sequence, an empty one, one shorter than a block.
    Case("varlen", window=12, sel_block=4, tq=88, seqlens=[1, 40, 0, 3, 37, 7], group=2,
         dk=32, config=SPLIT),
    # A window over all keys (w < 2 l' then bounds nothing): the unwindowed kernels.
    Case("window_covers_all", window=64, sel_block=48, tq=50, group=2, config=SMALL),
    # The default tiles, l' = 64 as in the paper, G = 4.
    Case("default_tiles", window=160, sel_block=64, tq=230, group=4, dk=32, dv=32),
    # Block 0 over two key tiles (l' = 20), in a tile whose first rows (t < 2 l') hold it among
    # their local keys and whose others take it apart.
    Case("initial_block_in_a_mixed_tile", window=40, sel_block=20, tq=40, q_start=33, h=2,
         config=SMALL),
]  # fmt: skip


@pytest.mark.parametrize("case", LOCAL_CASES, ids=[c.name for c in LOCAL_CASES])
def test_local_softmax_and_window_match_reference(
    case: Case, request: pytest.FixtureRequest
) -> None:
    """The sliding call that also hands out each row's softmax over its forced blocks' keys,
    ``[0, l')`` and ``[max(t // l' - 1, 0) l', t]``: o and its gradients as the reference's
    sliding attention, the local o and lse as the float64 definition, all within the float32
    bound."""
    gen = torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
    q, k, v, cu = inputs(case, gen)
    do = torch.randn(case.batch, case.tq, case.hq, case.dv, generator=gen).to(q.device)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, local = sliding_attention_triton_with_local(
        *leaves, case.window, sel_block=case.sel_block, q_start=case.q_start, cu_seqlens=cu,
        config=CmpConfig(**case.config),
    )  # fmt: skip
    torch.autograd.backward(o, do)
    cu_cpu = None if cu is None else cu.cpu()
    ref_leaves = [t.double().cpu().requires_grad_() for t in (q, k, v)]
    ref = sliding_attention(*ref_leaves, case.window, q_start=case.q_start, cu_seqlens=cu_cpu)
    torch.autograd.backward(ref, do.double().cpu())
    want = local_softmax_reference(
        *(t.detach() for t in ref_leaves), case.sel_block, q_start=case.q_start,
        cu_seqlens=cu_cpu,
    )  # fmt: skip

    assert rel_err(o, ref) < BOUND[torch.float32]
    assert_grads_close(leaves, ref_leaves, 2 * BOUND[torch.float32])
    assert local.sel_block == case.sel_block
    assert local.o.dtype == q.dtype
    assert local.lse.dtype == torch.float32
    assert not local.o.requires_grad
    assert rel_err(local.o, want.o) < BOUND[torch.float32]
    # Every row sees its own key: the lse is finite everywhere.
    assert torch.isfinite(local.lse).all()
    assert (local.lse.double().cpu() - want.lse).abs().max().item() < BOUND[torch.float32]


def test_local_softmax_needs_a_window_that_holds_the_local_blocks() -> None:
    assert DEVICE is not None
    q = torch.zeros(1, 40, 2, 16, device=DEVICE)
    kv = torch.zeros(1, 40, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="does not hold every row's local blocks"):
        sliding_attention_triton_with_local(q, kv, kv, 15, sel_block=8)


def test_backward_is_bitwise_reproducible(request: pytest.FixtureRequest) -> None:
    case = CASES[1]
    gen = torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))
    q, k, v, _ = inputs(case, gen)
    do = torch.randn(case.batch, case.tq, case.hq, case.dv, generator=gen).to(q.device)

    def gradients() -> list[torch.Tensor]:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = sliding_attention_triton(*leaves, case.window, config=CmpConfig(**case.config))
        return list(torch.autograd.grad(o, leaves, do))

    first, second = gradients(), gradients()
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_refuses_a_bad_window_and_float64() -> None:
    assert DEVICE is not None
    q = torch.zeros(1, 4, 2, 16, device=DEVICE)
    kv = torch.zeros(1, 4, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="window must be >= 1"):
        sliding_attention_triton(q, kv, kv, 0)
    # float64 is the reference's: the Triton kernels refuse it rather than round it.
    with pytest.raises(TypeError, match="Triton sliding attention supports"):
        sliding_attention_triton(q.double(), kv.double(), kv.double(), 2)
