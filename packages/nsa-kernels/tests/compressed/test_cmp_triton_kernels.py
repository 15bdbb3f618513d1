"""Triton compressed attention vs the nsa_core reference, forward, lse and backward, small shapes.

Runs on CPU under TRITON_INTERPRET=1 (CI) or on a CUDA GPU. Kernels run in float32 against the
float64 reference, held to docs/spec.md's float32 bound (1e-5; gradients 2e-5); the
half-precision test uses the float16 bound against a float32 reference on the same inputs.
Tiles are small here (16 rows x 16 blocks) so that one tile holds few tokens and the masked and
unmasked key walks, the head chunks and the split dk/dv segments all run on short sequences.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from cmp_triton_testlib import (
    Case,
    backprop,
    blind_rows,
    grads,
    leaves,
    make_inputs,
    reference,
    reference_lse,
    unseen_blocks,
)
from kernel_testlib import (
    BF16_DOT_REFUSAL,
    BOUND,
    CMP_SMALL_TILES,
    CMP_SPLIT_TILES,
    DEVICE,
    SKIP_REASON,
    refused_here,
    rel_err,
)

pytestmark = [pytest.mark.triton, pytest.mark.skipif(DEVICE is None, reason=SKIP_REASON)]
pytest.importorskip("triton")

from nsa_kernels.compressed.function import (  # noqa: E402
    CmpConfig,
    compressed_attention_fwd,
    compressed_attention_triton,
    compressed_attention_triton_with_lse,
)

SMALL, SPLIT = CMP_SMALL_TILES, CMP_SPLIT_TILES

CASES = [
    # The paper's l=32, d=16; T a multiple of neither; dk != dv; two batch rows.
    Case("g1_paper_ld", batch=2, tq=83, h=2, group=1, dk=16, dv=32, cmp_block=32, cmp_stride=16,
         config=SMALL),
    # 74 blocks: the forward and dq walk whole 16-block tiles unmasked, dk/dv tiles are seen
    # whole by the later rows; split dk/dv segments.
    Case("g1_many_blocks", tq=150, h=1, group=1, cmp_block=4, cmp_stride=2, config=SPLIT),
    # l = d; G = 3 does not divide the 16 rows of a tile (5 tokens x 3 heads + 1 padding row).
    Case("g3_l_eq_d", tq=45, h=2, group=3, dk=32, dv=16, cmp_block=2, cmp_stride=2,
         config=SPLIT),
    # G = 16: one token per 16-row tile.
    Case("g16", tq=37, h=1, group=16, dk=16, dv=16, cmp_block=4, cmp_stride=2, config=SPLIT),
    # G = 20 > 16 rows: each group is two head chunks (16 + 4); head dims not powers of two.
    Case("g20_chunks_odd_dims", tq=21, h=1, group=20, dk=24, dv=40, cmp_block=8, cmp_stride=2,
         config=SMALL),
    # Queries start late; k_cmp holds 3 blocks nobody sees (zero gradient).
    Case("q_start", tq=30, q_start=37, extra_blocks=3, h=2, group=2, cmp_block=8, cmp_stride=4,
         config=SPLIT),
    # Packed: a length-1 sequence, an empty one, one shorter than l, two long ones.
    Case("varlen", tq=88, seqlens=[1, 40, 0, 7, 33, 7], h=1, group=2, dk=32, dv=16,
         cmp_block=8, cmp_stride=2, config=SPLIT),
    # The paper's dk = 192, dv = 128 (dk padded to 256) with the default tiles.
    Case("dk192_default_tiles", tq=40, h=1, group=2, dk=192, dv=128, cmp_block=8,
         cmp_stride=4),
]  # fmt: skip
IDS = [c.name for c in CASES]


def _gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def _run(
    case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor | None
) -> torch.Tensor:
    return compressed_attention_triton(
        q,
        k,
        v,
        case.cmp_block,
        case.cmp_stride,
        q_start=case.q_start,
        cu_seqlens=cu,
        config=CmpConfig(**case.config),
    )


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward_and_lse_match_reference(case: Case, request: pytest.FixtureRequest) -> None:
    assert DEVICE is not None
    q, k, v, cu = make_inputs(case, _gen(request), torch.float32, DEVICE)
    o, lse = compressed_attention_fwd(
        q,
        k,
        v,
        case.cmp_block,
        case.cmp_stride,
        q_start=case.q_start,
        cu_seqlens=cu,
        config=CmpConfig(**case.config),
    )
    ref = reference(q, k, v, case, cu)
    assert o.dtype == q.dtype
    assert o.shape == ref.shape
    assert rel_err(o, ref) < BOUND[torch.float32]

    ref_lse = reference_lse(q, k, case)
    assert lse.dtype == torch.float32
    assert lse.shape == ref_lse.shape
    lse = lse.double().cpu()
    empty = torch.isinf(ref_lse)
    blind = blind_rows(case)
    assert torch.equal(empty, blind[None, :, None].expand_as(empty))
    assert torch.equal(torch.isinf(lse), empty), "rows that see nothing must have lse = -inf"
    assert torch.all(lse[empty] < 0)
    assert rel_err(lse[~empty], ref_lse[~empty]) < BOUND[torch.float32]
    assert torch.count_nonzero(o.cpu()[:, blind]) == 0, "rows that see nothing must output 0"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_backward_matches_reference(case: Case, request: pytest.FixtureRequest) -> None:
    assert DEVICE is not None
    gen = _gen(request)
    q, k, v, cu = make_inputs(case, gen, torch.float32, DEVICE)
    do = torch.randn((*q.shape[:3], case.dv), generator=gen).to(DEVICE)
    ql, kl, vl = leaves(q, k, v)
    backprop(_run(case, ql, kl, vl, cu), do)
    qr, kr, vr = leaves(q, k, v, torch.float64)
    backprop(reference(qr, kr, vr, case, cu), do.double())
    got, want = grads(ql, kl, vl), grads(qr, kr, vr)
    for name, g, w in zip("qkv", got, want, strict=True):
        assert g.dtype == torch.float32
        assert rel_err(g, w) < 2 * BOUND[torch.float32], f"d{name}"
    dq, dk, dv = (g.cpu() for g in got)
    assert torch.count_nonzero(dq[:, blind_rows(case)]) == 0, "blind rows must get no gradient"
    unseen = unseen_blocks(case)
    assert torch.count_nonzero(dk[:, unseen]) == 0
    assert torch.count_nonzero(dv[:, unseen]) == 0


@pytest.mark.parametrize(
    ("tq", "q_start", "seqlens"),
    [(7, 0, None), (3, 2, None), (9, 0, [3, 6])],
    ids=["shorter_than_l", "q_start_before_l", "varlen_all_short"],
)
def test_no_block_anywhere_gives_zeros(
    tq: int, q_start: int, seqlens: list[int] | None, request: pytest.FixtureRequest
) -> None:
    """k_cmp without any block (every query before its first block ends): zeros, no NaN."""
    assert DEVICE is not None
    case = Case("none", tq=tq, q_start=q_start, seqlens=seqlens, h=1, group=2, config=SMALL)
    assert case.num_blocks == 0
    q, k, v, cu = make_inputs(case, _gen(request), torch.float32, DEVICE)
    ql, kl, vl = leaves(q, k, v)
    o, lse = compressed_attention_triton_with_lse(
        ql, kl, vl, case.cmp_block, case.cmp_stride, q_start=q_start, cu_seqlens=cu
    )
    assert o.shape == (1, tq, 2, case.dv)
    assert torch.count_nonzero(o) == 0
    assert torch.all(lse == float("-inf"))
    backprop(o, torch.ones_like(o))
    dq, dk, dv = grads(ql, kl, vl)
    assert torch.count_nonzero(dq) == 0
    assert dk.shape == k.shape
    assert dv.shape == v.shape


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_precision_within_spec(dtype: torch.dtype, request: pytest.FixtureRequest) -> None:
    """Within the spec's bound; bfloat16 under the interpreter, whose bfloat16 tl.dot is wrong, is
    refused with the reason (on a GPU it runs here)."""
    assert DEVICE is not None
    case = Case("half", tq=50, h=1, group=4, dk=32, dv=32, cmp_block=8, cmp_stride=4)
    gen = _gen(request)
    q, k, v, cu = make_inputs(case, gen, dtype, DEVICE)
    do = torch.randn((*q.shape[:3], case.dv), generator=gen).to(DEVICE, dtype)
    ql, kl, vl = leaves(q, k, v)
    if refused_here(dtype):
        with pytest.raises(TypeError, match=BF16_DOT_REFUSAL):
            _run(case, ql, kl, vl, cu)
        return
    o = _run(case, ql, kl, vl, cu)
    backprop(o, do)
    qr, kr, vr = leaves(q, k, v, torch.float32)
    ref = reference(qr, kr, vr, case, cu, dtype=torch.float32)
    backprop(ref, do.float())
    assert o.dtype == dtype
    assert rel_err(o, ref) < BOUND[dtype]
    for name, g, w in zip("qkv", grads(ql, kl, vl), grads(qr, kr, vr), strict=True):
        assert g.dtype == dtype
        assert rel_err(g, w) < 2 * BOUND[dtype], f"d{name}"


@pytest.mark.parametrize("config", [SMALL, SPLIT], ids=["whole_tiles", "split_tiles"])
def test_backward_is_bitwise_deterministic(
    config: dict[str, int], request: pytest.FixtureRequest
) -> None:
    assert DEVICE is not None
    case = Case("det", tq=40, h=1, group=3, config=config)
    gen = _gen(request)
    q, k, v, cu = make_inputs(case, gen, torch.float32, DEVICE)
    do = torch.randn((*q.shape[:3], case.dv), generator=gen).to(DEVICE)
    runs = []
    for _ in range(2):
        ql, kl, vl = leaves(q, k, v)
        backprop(_run(case, ql, kl, vl, cu), do)
        runs.append(grads(ql, kl, vl))
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def test_no_grad_and_grad_paths_agree(request: pytest.FixtureRequest) -> None:
    assert DEVICE is not None
    case = Case("paths", tq=30, h=1, group=2, config=SMALL)
    q, k, v, cu = make_inputs(case, _gen(request), torch.float32, DEVICE)
    with torch.no_grad():
        plain = _run(case, q, k, v, cu)
    o, lse = compressed_attention_triton_with_lse(
        q.requires_grad_(), k, v, case.cmp_block, case.cmp_stride, config=CmpConfig(**SMALL)
    )
    assert o.requires_grad
    assert not lse.requires_grad
    assert torch.equal(plain, o.detach())


def test_gradients_flow_through_the_compression(request: pytest.FixtureRequest) -> None:
    """k_cmp, v_cmp = phi(k, v) with phi = mean over each block: d/dk reaches the raw keys."""
    from nsa_core.reference.compress import compress

    assert DEVICE is not None
    gen = _gen(request)
    l_cmp, d, tq, h, group, dk, dv = 8, 4, 35, 1, 2, 16, 16
    q = torch.randn(1, tq, h * group, dk, generator=gen).to(DEVICE)
    k = torch.randn(1, tq, h, dk, generator=gen).to(DEVICE)
    v = torch.randn(1, tq, h, dv, generator=gen).to(DEVICE)
    do = torch.randn(1, tq, h * group, dv, generator=gen).to(DEVICE)

    def run(dtype: torch.dtype, triton: bool) -> list[torch.Tensor]:
        ql, kl, vl = leaves(q, k, v, dtype)
        k_cmp = compress(kl, l_cmp, d)
        v_cmp = compress(vl, l_cmp, d)
        if triton:
            o = compressed_attention_triton(ql, k_cmp, v_cmp, l_cmp, d, config=CmpConfig(**SMALL))
        else:
            o = reference(ql, k_cmp, v_cmp, Case("phi", cmp_block=l_cmp, cmp_stride=d), None)
        backprop(o, do.to(dtype))
        return grads(ql, kl, vl)

    got, want = run(torch.float32, True), run(torch.float64, False)
    for name, a, b in zip(("q", "k", "v"), got, want, strict=True):
        assert float(b.abs().max()) > 0, f"d{name} of the reference is zero: nothing was checked"
        assert rel_err(a, b) < 2 * BOUND[torch.float32], f"d{name}"


def test_unsupported_inputs_are_refused() -> None:
    assert DEVICE is not None
    q = torch.zeros(1, 8, 2, 16, dtype=torch.float64, device=DEVICE)
    k = torch.zeros(1, 1, 1, 16, dtype=torch.float64, device=DEVICE)
    with pytest.raises(TypeError, match="supports"):
        compressed_attention_triton(q, k, k, 8, 4)
    wide = torch.zeros(1, 8, 1, 272, device=DEVICE)
    kw = torch.zeros(1, 1, 1, 272, device=DEVICE)
    with pytest.raises(ValueError, match="exceed 256"):
        compressed_attention_triton(wide, kw, kw, 8, 4)
    with pytest.raises(ValueError, match="power of two"):
        compressed_attention_triton(
            q.float(), k.float(), k.float(), 8, 4, config=CmpConfig(block_m=24)
        )


def test_tile_table_lists_every_tile_once_longest_first() -> None:
    from nsa_kernels.common.tile_table import tile_table

    lengths = torch.tensor([5, 0, 1, 12, 4])
    per_tile, bound = 4, -(-22 // 4) + 5
    table = tile_table(lengths, per_tile, bound, lambda seq, first: lengths[seq] - first)
    assert table.dtype == torch.int32
    assert table.shape == (bound, 2)
    expected = {(s, f) for s, n in enumerate(lengths.tolist()) for f in range(0, n, per_tile)}
    rows = [tuple(r) for r in table.tolist()]
    real = [r for r in rows if r[0] >= 0]
    assert sorted(real) == sorted(expected)
    assert rows[len(real) :] == [(-1, 0)] * (bound - len(real)), "padding rows come last"
    work = [int(lengths[s]) - f for s, f in real]
    assert work == sorted(work, reverse=True)


def test_segment_rows_splits_long_problems_only() -> None:
    from nsa_kernels.common.interval_launch import IntervalLaunch
    from nsa_kernels.compressed.config import resolve_config
    from nsa_kernels.compressed.tiles import segment_rows

    def launch(tq: int) -> IntervalLaunch:
        return IntervalLaunch(
            batch=1, tq=tq, hq=64, h=4, dk=128, dv=128, num_blocks=(tq - 32) // 16 + 1,
            cmp_block=32, cmp_stride=16, q_start=0, scale=1.0, cu_seqlens=None, cmp_cu=None,
        )  # fmt: skip

    # Key tiles of 64 blocks (the default is 128 since it measured faster; the split rule is the
    # same): 2 rows per step (G = 16 on 32 rows): segments are whole steps, at least 512 rows;
    # an H100's 132 SMs cut the 64 key tiles x 4 heads of T = 64k into about 528 programs.
    cfg = resolve_config(CmpConfig(dkv_block_n=64), 128, 128, torch.bfloat16)
    long = segment_rows(launch(65536), cfg, 2, 132)
    assert long % 2 == 0
    assert 8192 <= long <= 32768
    assert segment_rows(launch(400), cfg, 2, 132) == 400, "a short problem is not split"
    assert segment_rows(launch(65536), replace_segment(cfg, 100), 2, 132) == 100
    # The sliding branch (l = d = 1, a window) never splits by default: a key tile meets at most
    # dkv_block_n + w - 1 rows, and a split would allocate partials for every (tile, segment).
    windowed = IntervalLaunch(
        batch=1, tq=131072, hq=64, h=4, dk=128, dv=128, num_blocks=131072, cmp_block=1,
        cmp_stride=1, q_start=0, scale=1.0, cu_seqlens=None, cmp_cu=None, window=512,
    )  # fmt: skip
    assert windowed.windowed
    win_cfg = resolve_config(None, 128, 128, torch.bfloat16, windowed=True)
    assert segment_rows(windowed, win_cfg, 2, 132) == 131072
    assert segment_rows(windowed, replace_segment(win_cfg, 640), 2, 132) == 640


def replace_segment(cfg: CmpConfig, rows: int) -> CmpConfig:
    from dataclasses import replace

    return replace(cfg, dkv_segment=rows)


def test_default_tiles_follow_the_branch_and_the_device() -> None:
    from nsa_kernels.compressed.config import resolve_config

    def tiles(cfg: CmpConfig) -> tuple[int, ...]:
        return (cfg.fwd_stages, cfg.dkv_block_n, cfg.dkv_block_m, cfg.dkv_stages)

    bf16 = torch.bfloat16
    # The compressed branch: 128-block dk/dv tiles on 64-row steps; the sliding branch's short
    # dk/dv walks take 32-row steps on three stages.
    assert tiles(resolve_config(None, 128, 128, bf16)) == (2, 128, 64, 2)
    assert tiles(resolve_config(None, 128, 128, bf16, windowed=True)) == (2, 128, 32, 3)
    # The compressed forward's 128-block key tiles where their two stages fit (Hopper), 64
    # blocks on three stages on an A100; the sliding branch always walks 64-key tiles.
    assert resolve_config(None, 128, 128, bf16).block_n == 128
    assert resolve_config(None, 128, 128, bf16, shared_bytes=232_448).block_n == 128
    a100 = resolve_config(None, 128, 128, bf16, shared_bytes=166_912)
    assert (a100.block_n, a100.fwd_stages) == (64, 3)
    # The sliding forward walks w + a few keys per tile: 64-row tiles on one warp group, on
    # every device (two stages ask 80 KiB).
    for shared in (None, 101_376):
        win = resolve_config(None, 128, 128, bf16, windowed=True, shared_bytes=shared)
        assert (win.block_m, win.block_n, win.fwd_warps, win.fwd_stages) == (64, 64, 4, 2)
        # Its dq too: 64 rows x 64 keys on one warp group, two stages.
        assert (win.dq_block_m, win.dq_block_n, win.dq_warps, win.dq_stages) == (64, 64, 4, 2)
    # A device with 99 KiB per block (sm_89) runs the forward on two stages
    # (tests/test_small_shared_memory.py); a field the caller set is kept.
    assert (
        resolve_config(CmpConfig(fwd_stages=3), 128, 128, bf16, shared_bytes=101_376).fwd_stages
        == 3
    )
    assert tiles(resolve_config(None, 192, 128, bf16)) == (2, 128, 64, 2)
    assert tiles(resolve_config(None, 192, 128, bf16, windowed=True)) == (2, 128, 32, 2)
    # The sliding dq at D = 256: 128-row tiles on two warp groups where their three stages fit
    # (Hopper; on sm_80 and sm_89 the tile spills), else 64 x 32.
    for shared, dq in ((None, (128, 32, 8, 3)), (232_448, (128, 32, 8, 3)),
                       (166_912, (64, 32, 8, 3)), (101_376, (64, 32, 8, 2))):  # fmt: skip
        win = resolve_config(None, 192, 128, bf16, windowed=True, shared_bytes=shared)
        assert (win.dq_block_m, win.dq_block_n, win.dq_warps, win.dq_stages) == dq, shared
        plain = resolve_config(None, 192, 128, bf16, shared_bytes=shared)
        assert (plain.dq_block_m, plain.dq_block_n, plain.dq_warps) == (64, 32, 8)
    assert tiles(resolve_config(None, 128, 128, torch.float32, windowed=True)) == (2, 16, 16, 2)


def test_values_256_wide_take_tiles_that_fit() -> None:
    """dv = 256: the dk/dv kernel's 128 x 64 tile asks more shared memory than an H100 has, so
    such values walk 128 x 32 there, 64 x 64 on an A100 (166,912 B), 32 x 32 on 99 KiB, where the
    forward also takes 32-key tiles on one stage and dq one stage."""
    from nsa_kernels.compressed.config import resolve_config

    def tiles(shared: int | None) -> tuple[int, ...]:
        cfg = resolve_config(None, 256, 256, torch.bfloat16, shared_bytes=shared)
        fwd = (cfg.block_m, cfg.block_n, cfg.fwd_stages)
        return (*fwd, cfg.dq_stages, cfg.dkv_block_n, cfg.dkv_block_m)

    assert tiles(None) == (128, 64, 2, 3, 128, 32)
    assert tiles(232_448) == (128, 64, 2, 3, 128, 32)
    assert tiles(166_912) == (128, 64, 2, 3, 64, 64)
    assert tiles(101_376) == (128, 32, 1, 1, 32, 32)
    # Values up to 128 wide keep the dk = 192 tiles.
    keys192 = resolve_config(None, 192, 128, torch.bfloat16, shared_bytes=232_448)
    assert (keys192.dkv_block_n, keys192.dkv_block_m) == (128, 64)
