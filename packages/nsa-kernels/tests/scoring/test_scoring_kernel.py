"""Triton block scoring + top-n vs the nsa_core reference under the index contract.

Runs on CPU under TRITON_INTERPRET=1 (CI) or on a CUDA GPU, on small shapes. Inputs are float32
(float16 in one test; the interpreter multiplies bfloat16 dots wrongly, so the kernel refuses
bfloat16 there (test_bad_input_kernels.py) and test_scoring_gpu.py checks it on the GPU).
Configs use small tiles so that rows span several query tiles and several selection tiles; the
interpreter's time grows with the number of programs, so most cases take large row tiles.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from kernel_testlib import DEVICE, SKIP_REASON
from scoring_testlib import (
    Case,
    check,
    make_inputs,
    reference_lse,
    reference_selection,
    run_select_blocks_triton,
)

pytestmark = [pytest.mark.triton, pytest.mark.skipif(DEVICE is None, reason=SKIP_REASON)]
pytest.importorskip("triton")

from nsa_core.reference.selection import block_scores, topn_blocks  # noqa: E402
from nsa_kernels.scoring.contract import row_blocks, row_positions, score_boundary  # noqa: E402
from nsa_kernels.scoring.function import ScoreConfig, select_blocks_triton  # noqa: E402

TILES = {"block_rows": 128, "block_sel": 16}

CASES = [
    # The paper's l=32, d=16, l'=64 (block j takes compressed blocks 4j-1 .. 4j+3), G = 16.
    Case("paper_g16", tq=700, h=1, group=16, dk=32, cmp_block=32, cmp_stride=16,
         sel_block=64, n=5, config={"block_rows": 256, "block_sel": 16}),
    # Paper ratios on small blocks: two selection tiles, G = 3 (padded to 4), dk = 24 (16 + 16).
    Case("ratio4_g3_two_tiles", tq=300, h=2, group=3, dk=24, n=6,
         config={"block_rows": 64, "block_sel": 16, "block_lse": 16}),
    # l = d = l': s = p_cmp, no spill into later selection blocks.
    Case("equal_blocks_g1", tq=200, h=2, group=1, dk=16, cmp_block=8, cmp_stride=8,
         sel_block=8, n=5, config={"block_rows": 32, "block_sel": 16}),
    # l' < l: a compressed block spills into the next two selection blocks (reach 2).
    Case("sel_shorter_than_cmp", tq=250, h=1, group=2, dk=16, cmp_block=16, cmp_stride=4,
         sel_block=8, n=6, config=TILES),
    # r = l'/d = 3: phases padded to 4 and masked; dk = 48 (32 + 16).
    Case("ratio3_dk48", tq=230, h=1, group=4, dk=48, cmp_block=12, cmp_stride=4,
         sel_block=12, n=4, config=TILES),
    Case("dk8_padded", tq=90, h=2, group=2, dk=8, n=4, config=TILES),
    Case("batch2", batch=2, tq=100, h=2, group=2, dk=16, cmp_block=8, cmp_stride=4,
         sel_block=8, n=4, config=TILES),
    # Chunked prefill: rows at 170 .. 259, k_cmp longer than they see.
    Case("q_start_chunk", tq=90, q_start=170, extra_cmp=7, h=2, group=2, dk=16, n=5,
         config=TILES),
    # One decode row at t = 333.
    Case("decode_row", tq=1, q_start=333, h=2, group=4, dk=16, n=6, config=TILES),
    Case("varlen", tq=217, seqlens=[1, 77, 0, 130, 9], h=2, group=2, dk=16, n=5,
         config={"block_rows": 64, "block_sel": 16}),
    # n above the valid blocks of every row: all valid blocks, -1 after.
    Case("n_exceeds_blocks", tq=100, h=1, group=2, dk=16, n=16, config=TILES),
    # The spill shifts as a one-hot contraction (the path of Triton < 3.2).
    Case("one_hot_shift", tq=250, h=1, group=2, dk=16, cmp_block=16, cmp_stride=4,
         sel_block=8, n=6, config={**TILES, "shift": 2}),
]  # fmt: skip
IDS = [c.name for c in CASES]


def _gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def _run(
    case: Case,
    q: torch.Tensor,
    k: torch.Tensor,
    cu: torch.Tensor | None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return run_select_blocks_triton(case, q, k, cu, lse, ScoreConfig(**case.config))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_matches_reference(case: Case, request: pytest.FixtureRequest) -> None:
    assert DEVICE is not None
    q, k, cu = make_inputs(case, _gen(request), torch.float32, DEVICE)
    got = _run(case, q, k, cu)
    report = check(case, got, reference_selection(case, q, k, cu), cu)
    assert report.tolerance_rows <= max(1, report.rows // 50), report


@pytest.mark.parametrize("case", [CASES[1], CASES[7], CASES[9]], ids=lambda c: c.name)
def test_lse_given(case: Case, request: pytest.FixtureRequest) -> None:
    """The compressed branch's lse replaces the first pass: same contract, same selection."""
    assert DEVICE is not None
    q, k, cu = make_inputs(case, _gen(request), torch.float32, DEVICE)
    lse = reference_lse(case, q, k, cu)
    got = _run(case, q, k, cu, lse=lse)
    check(case, got, reference_selection(case, q, k, cu), cu)
    own = _run(case, q, k, cu)
    differ = (got[0] != own[0]).any(dim=-1)
    assert int(differ.sum()) <= max(1, differ.numel() // 100)


def test_lse_weighs_each_head(request: pytest.FixtureRequest) -> None:
    """lse is read per query head: shifting head g's lse by -a scales its probabilities by e^a.

    The expected scores sum the reference's per-head scores with those weights.
    """
    case = Case("lse_weights", tq=160, h=2, group=3, dk=16, n=5, config=TILES)
    assert DEVICE is not None
    gen = _gen(request)
    q, k, cu = make_inputs(case, gen, torch.float32, DEVICE)
    shift = torch.rand(1, 1, case.h * case.group, generator=gen) * 4 - 2  # [-2, 2) per head
    lse = reference_lse(case, q, k, cu) - shift.to(DEVICE)
    got = _run(case, q, k, cu, lse=lse)
    args = (case.cmp_block, case.cmp_stride, case.sel_block)
    expected = block_scores(q, k, *args).zero_()
    for head in range(case.h * case.group):
        kv = head // case.group
        s = block_scores(q[:, :, head : head + 1], k[:, :, kv : kv + 1], *args)
        expected[:, :, kv] += s[:, :, 0] * float(torch.exp(shift[0, 0, head]))
    ref_idx, ref_cnt = topn_blocks(expected, case.n, case.sel_block)
    check(case, got, (ref_idx, ref_cnt, expected), cu)
    # Not the plain selection: the weights change some rows.
    plain = reference_selection(case, q, k, cu)[0]
    assert (got[0] != plain).any()


@pytest.mark.parametrize("lse_given", [False, True], ids=["own_lse", "lse_given"])
@pytest.mark.parametrize(
    "case",
    [
        Case("ties_ratio4", tq=400, h=2, group=2, dk=16, n=7, keys="palette_grid",
             config={"block_rows": 64, "block_sel": 16}),
        Case("ties_sel_shorter", tq=300, h=1, group=3, dk=16, cmp_block=16, cmp_stride=4,
             sel_block=8, n=9, keys="palette_grid", config={**TILES, "shift": 2}),
        Case("ties_paper", tq=1100, h=1, group=4, dk=32, cmp_block=32, cmp_stride=16,
             sel_block=64, n=6, keys="palette_grid", config={"block_rows": 256, "block_sel": 16}),
    ],
    ids=lambda c: c.name,
)  # fmt: skip
def test_exact_ties_follow_lower_j(
    case: Case, lse_given: bool, request: pytest.FixtureRequest
) -> None:
    """Equal compressed keys: bit-equal scores wherever the blocks sit, ties to the lower j.

    The palette makes every third selection block's band equal, so rows hold many exactly tied
    candidates across selection tiles; the kernel must return the reference's indices exactly.
    """
    assert DEVICE is not None
    q, k, cu = make_inputs(case, _gen(request), torch.float32, DEVICE)
    lse = reference_lse(case, q, k, cu) if lse_given else None
    got = _run(case, q, k, cu, lse=lse)
    ref = reference_selection(case, q, k, cu)
    check(case, got, ref, cu, exact_ties=True)
    assert torch.equal(got[0], ref[0])
    assert torch.equal(got[1], ref[1])
    # The inputs did tie: many rows hold equal scores at their top-n boundary.
    scores = ref[2].double().cpu()
    assert _tied_boundaries(case, scores) > scores.shape[1] // 4


def _tied_boundaries(case: Case, scores: torch.Tensor) -> int:
    """Rows (b, t, h) whose n-th and (n+1)-th best non-forced scores are exactly equal."""
    batch, tq, h, n_sel = scores.shape
    jt = row_blocks(row_positions(tq, case.q_start), case.sel_block, batch, h)
    boundary = score_boundary(scores.reshape(-1, n_sel), jt, case.n)
    return int((boundary.exists & (boundary.last_kept == boundary.first_left)).sum())


def test_rows_without_visible_blocks(request: pytest.FixtureRequest) -> None:
    """l > l' + d: early rows see no compressed block but have non-forced valid blocks, all of
    score 0: the reference takes them by lower j, and so must the kernel (bit-exact zeros)."""
    case = Case("no_visible", tq=150, h=1, group=2, dk=16, cmp_block=32, cmp_stride=8,
                sel_block=8, n=6, config=TILES)  # fmt: skip
    assert DEVICE is not None
    q, k, cu = make_inputs(case, _gen(request), torch.float32, DEVICE)
    for lse in (None, reference_lse(case, q, k, cu)):
        got = _run(case, q, k, cu, lse=lse)
        ref = reference_selection(case, q, k, cu)
        check(case, got, ref, cu, exact_ties=True)
        early = row_positions(case.tq) < case.cmp_block - 1
        assert torch.equal(got[0][:, early], ref[0][:, early])
        # Rows at 24 .. 30 have jt = 3: forced {0, 2, 3} and block 1 at score 0.
        assert int(got[1][0, 30, 0]) == 4


def test_float16(request: pytest.FixtureRequest) -> None:
    case = Case("fp16", tq=200, h=2, group=4, dk=32, n=5, config=TILES)
    assert DEVICE is not None
    q, k, cu = make_inputs(case, _gen(request), torch.float16, DEVICE)
    got = _run(case, q, k, cu)
    check(case, got, reference_selection(case, q, k, cu), cu)


def test_empty_query_and_deterministic(request: pytest.FixtureRequest) -> None:
    case = Case("small", tq=60, h=2, group=2, dk=16, n=4, config=TILES)
    assert DEVICE is not None
    q, k, cu = make_inputs(case, _gen(request), torch.float32, DEVICE)
    first = _run(case, q, k, cu)
    second = _run(case, q, k, cu)
    assert torch.equal(first[0], second[0])
    assert torch.equal(first[1], second[1])
    idx, cnt = _run(case, q[:, :0], k, cu)
    assert idx.shape == (1, 0, 2, 4)
    assert cnt.shape == (1, 0, 2)


def test_rejects_bad_arguments() -> None:
    case = Case("bad", tq=40, h=1, group=2, dk=16)
    assert DEVICE is not None
    q, k, cu = make_inputs(case, torch.Generator().manual_seed(0), torch.float32, DEVICE)
    with pytest.raises(TypeError, match="float32"):
        _run(case, q, k, cu, lse=torch.zeros(1, 40, 2, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match=r"\[B, Tq, HQ\]"):
        _run(case, q, k, cu, lse=torch.zeros(1, 40, 3, device=DEVICE))
    with pytest.raises(TypeError, match="supports"):
        _run(case, q.double(), k.double(), cu)
    with pytest.raises(ValueError, match="divide"):
        select_blocks_triton(q, k, 8, 4, 10, 4)
    with pytest.raises(ValueError, match="power of two"):
        select_blocks_triton(q, k, 8, 4, 16, 4, config=ScoreConfig(block_rows=48))
