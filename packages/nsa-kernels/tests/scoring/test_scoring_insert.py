"""The running top-n's two merges (ScoreConfig.insert_max) select the same blocks, bit for bit.

insert_max = -1 merges every tile that has a beating key by the full sort and bitonic merge;
k >= 1 inserts up to k keys per token one by one and takes the full merge only for tiles with
more; 64 (above the 16 keys a tile holds here) inserts every time. Keys are unique, so each
token's n best form one set: every setting must return equal indices and counts, and they must
meet the reference under the index contract. The shapes walk many selection tiles per row
(late rows, short l') over keys whose strength comes in waves (:func:`_waves`), so that tiles
with no, a few and many beating keys follow each other and every way runs, and they take the
cases the index contract names: groups of 1, 3 and 16, the paper's l=32, d=16, l'=64 and
l = d = l', Tq a multiple of no block, q_start > 0, a decode row, varlen with sequences of one
token, exact ties, NaN and +inf scores. Runs on CPU under TRITON_INTERPRET=1 or on a GPU.
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

from nsa_core.blocks import cmp_cu_seqlens  # noqa: E402
from nsa_kernels.scoring.function import (  # noqa: E402
    INSERT_MAX_DEFAULT,
    ScoreConfig,
    phase_weights,
    resolve_config,
)

# -1: the full merge alone (the kernel before insertion); 64: insertion on every tile.
SETTINGS = (-1, 1, 2, 64)

CASES = [
    # The paper's geometry and n at G = 16: rows at 9000 .. 9004 walk nine selection tiles,
    # one token a program.
    Case("paper_g16_late", tq=5, q_start=9000, h=1, group=16, dk=16, cmp_block=32,
         cmp_stride=16, sel_block=64, n=16, config={"block_rows": 16, "block_sel": 16}),
    # l = d = l' (no spill), G = 1: rows at 700 .. 744, twelve tiles.
    Case("equal_blocks_g1", tq=45, q_start=700, h=1, group=1, dk=16, cmp_block=4,
         cmp_stride=4, sel_block=4, n=5, config={"block_rows": 16, "block_sel": 16}),
    # G = 3 (padded to 4), dk = 24 (16 + 16), a spill into the next block; 75 rows end at
    # 1074: T = 1075 is a multiple of no block or tile.
    Case("g3_sel8", tq=75, q_start=1000, h=1, group=3, dk=24, cmp_block=8, cmp_stride=4,
         sel_block=8, n=6, config={"block_rows": 64, "block_sel": 16}),
    # One decode row at t = 2500: 313 selection blocks, one token a program.
    Case("decode_row", tq=1, q_start=2500, h=2, group=4, dk=16, sel_block=8, n=6,
         config={"block_rows": 16, "block_sel": 16}),
    # Varlen: sequences of one token at both ends, an empty one.
    Case("varlen", tq=139, seqlens=[1, 90, 0, 47, 1], h=2, group=2, dk=16, sel_block=8,
         n=5, config={"block_rows": 32, "block_sel": 16}),
]  # fmt: skip
IDS = [c.name for c in CASES]


def _gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def _waves(case: Case, k: torch.Tensor, cu: torch.Tensor | None) -> torch.Tensor:
    """k_cmp [B, N, H, dk] scaled by ``1 + 3 exp(-(j % 40) / 6)``, j the selection block its
    block starts in (local to its sequence when varlen).

    Each wave's first blocks take the strongest logits, so along a wave fewer and fewer keys
    of a tile beat the kept ones (none, or a few: insertion), as late in a long sequence; the
    next wave's first tile beats many of a run that insertion left unsorted (the full merge).
    """
    i = torch.arange(k.shape[1])
    if cu is not None:
        starts = cmp_cu_seqlens(cu.cpu(), case.cmp_block, case.cmp_stride).long()
        i = i - starts[torch.searchsorted(starts[1:], i, right=True)]
    j = i * case.cmp_stride // case.sel_block
    return k * (1 + 3 * torch.exp(-(j % 40) / 6.0)).to(k)[None, :, None, None]


def _every_setting(
    case: Case,
    q: torch.Tensor,
    k: torch.Tensor,
    cu: torch.Tensor | None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices, counts) of the kernel at every insert_max of SETTINGS, asserted equal."""
    full = None
    for setting in SETTINGS:
        config = ScoreConfig(**case.config, insert_max=setting)
        got = run_select_blocks_triton(case, q, k, cu, lse, config)
        if full is None:
            full = got
            continue
        assert torch.equal(got[0], full[0]), f"insert_max={setting}: other indices"
        assert torch.equal(got[1], full[1]), f"insert_max={setting}: other counts"
    assert full is not None
    return full


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_insertion_selects_as_the_full_merge(case: Case, request: pytest.FixtureRequest) -> None:
    assert DEVICE is not None
    q, k, cu = make_inputs(case, _gen(request), torch.float32, DEVICE)
    k = _waves(case, k, cu)
    got = _every_setting(case, q, k, cu)
    report = check(case, got, reference_selection(case, q, k, cu), cu)
    assert report.tolerance_rows <= max(1, report.rows // 50), report


def test_exact_ties(request: pytest.FixtureRequest) -> None:
    """Every third selection block's band is equal: many exactly tied keys enter and leave the
    running top-n in every tile, and the lower j must win in each setting."""
    case = Case("ties", tq=250, h=1, group=3, dk=16, cmp_block=8, cmp_stride=4, sel_block=8,
                n=7, keys="palette_grid", config={"block_rows": 64, "block_sel": 16})  # fmt: skip
    assert DEVICE is not None
    q, k, cu = make_inputs(case, _gen(request), torch.float32, DEVICE)
    got = _every_setting(case, q, k, cu)
    ref = reference_selection(case, q, k, cu)
    check(case, got, ref, cu, exact_ties=True)
    assert torch.equal(got[0], ref[0])
    assert torch.equal(got[1], ref[1])


def test_nan_scores(request: pytest.FixtureRequest) -> None:
    """A NaN in one query head (its token scores NaN on every block) and in a compressed key
    only the last rows see: those tokens take the reference's fallback, the others, whose tiles
    they share (and whose merge they steer), keep their own selection."""
    case = Case("nan", tq=23, q_start=900, extra_cmp=5, h=2, group=2, dk=16, sel_block=8,
                n=5, config={"block_rows": 16, "block_sel": 16})  # fmt: skip
    assert DEVICE is not None
    q, k, cu = make_inputs(case, _gen(request), torch.float32, DEVICE)
    k = _waves(case, k, cu)
    q[0, 5, 1, 5] = float("nan")  # kv head 0, token 905
    k[0, 227, 1, 3] = float("nan")  # kv head 1, seen from t = 227 * 4 + 7 = 915
    got = _every_setting(case, q, k, cu)
    ref = reference_selection(case, q, k, cu)
    bad = ~torch.isfinite(ref[2]).all(dim=-1)  # [B, Tq, H]
    assert 0 < int(bad.sum()) < bad.numel() // 4
    assert torch.equal(got[0][bad], ref[0][bad])
    check(case, got, ref, cu)


def test_inf_scores(request: pytest.FixtureRequest) -> None:
    """A given lse 92 below the true one on some query heads makes their rows' largest
    probabilities overflow to +inf (the others stay finite): such scores pack below every
    finite one (docs/spec.md, "Non-finite values") and must order alike in every setting. The
    reference computes its own normaliser, so the settings are compared with each other, and
    with the true lse: only the groups of a shifted head may change."""
    case = Case("inf", tq=24, q_start=900, h=2, group=2, dk=16, sel_block=8, n=6,
                config={"block_rows": 16, "block_sel": 16})  # fmt: skip
    assert DEVICE is not None
    gen = _gen(request)
    q, k, cu = make_inputs(case, gen, torch.float32, DEVICE)
    k = _waves(case, k, cu)
    lse = reference_lse(case, q, k, cu)
    shifted = torch.rand(lse.shape, generator=gen) < 0.25  # [B, Tq, HQ]
    got = _every_setting(case, q, k, cu, lse=torch.where(shifted.to(lse.device), lse - 92, lse))
    clean = run_select_blocks_triton(case, q, k, cu, lse, ScoreConfig(**case.config))
    differ = (got[0] != clean[0]).any(dim=-1).cpu()  # [B, Tq, H]
    in_group = shifted.view(*differ.shape, case.group).any(dim=-1)
    assert differ.any()
    assert not (differ & ~in_group).any()


def test_resolve_insert_max() -> None:
    paper = phase_weights(32, 16, 64)

    def resolve(config: ScoreConfig) -> int:
        cfg = resolve_config(
            config, group=16, num_selected=16, weights=paper, tq=4096,
            dtype=torch.bfloat16, head_dim=128,
        )  # fmt: skip
        return cfg.insert_max

    assert resolve(ScoreConfig()) == INSERT_MAX_DEFAULT
    assert resolve(ScoreConfig(insert_max=-1)) == -1
    assert resolve(ScoreConfig(insert_max=5)) == 5
    assert ScoreConfig.parse("insert_max=-1") == ScoreConfig(insert_max=-1)
    with pytest.raises(ValueError, match="insert_max"):
        resolve(ScoreConfig(insert_max=-2))
