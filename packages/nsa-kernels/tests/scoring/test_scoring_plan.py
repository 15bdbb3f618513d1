"""The host-side plan of block scoring: phase weights, tiles, head-dim chunks and varlen tiles.

Plain torch on CPU; no kernel runs here.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from nsa_core.blocks import cmp_block_overlap
from nsa_kernels.scoring.function import (
    PhaseWeights,
    ScoreConfig,
    _head_dim_chunks,
    parse_config,
    phase_weights,
    resolve_config,
    varlen_query_tiles,
)

GEOMETRIES = [
    (32, 16, 64),  # the paper: block j takes 4j-1 .. 4j+3 with weights 1, 2, 2, 2, 1
    (16, 16, 16),  # l = d = l'
    (32, 8, 16),  # l' < l: a block overlaps three selection blocks
    (64, 16, 16),  # l = 4 l'
    (12, 4, 12),  # r = 3 (not a power of two)
    (16, 4, 80),  # r = 20
    (8, 8, 64),  # l = d, r = 8
    (48, 16, 32),
]


@pytest.mark.parametrize(("l_cmp", "d", "l_sel"), GEOMETRIES)
def test_phase_weights_rebuild_the_overlap(l_cmp: int, d: int, l_sel: int) -> None:
    """w[q, m] placed at i = (j - q) r + m gives back c[i, j] of nsa_core.blocks exactly."""
    pw = phase_weights(l_cmp, d, l_sel)
    num_sel = 9
    num_cmp = num_sel * pw.ratio + 4
    want = cmp_block_overlap(num_cmp, num_sel, l_cmp, d, l_sel)
    got = torch.zeros_like(want)
    for j in range(num_sel):
        for q in range(pw.reach + 1):
            for m in range(pw.ratio):
                i = (j - q) * pw.ratio + m
                if 0 <= i < num_cmp:
                    got[i, j] = pw.weights[q, m]
    assert torch.equal(got, want)
    # Q is tight: the last row of weights is not all zero.
    assert pw.weights[pw.reach].abs().sum() > 0
    assert torch.all(pw.weights[:, pw.ratio :] == 0)


def test_paper_weights() -> None:
    pw = phase_weights(32, 16, 64)
    assert pw.ratio == 4
    assert pw.reach == 1
    assert pw.weights.tolist() == [[2.0, 2.0, 2.0, 1.0], [0.0, 0.0, 0.0, 1.0]]


def test_phase_weights_need_d_dividing_both() -> None:
    with pytest.raises(ValueError, match="divide"):
        phase_weights(32, 16, 40)


@pytest.mark.parametrize(
    ("dk", "chunks"),
    [(8, (16, 0)), (16, (16, 0)), (48, (32, 16)), (128, (128, 0)), (192, (128, 64)),
     (200, (128, 128)), (256, (256, 0))],
)  # fmt: skip
def test_head_dim_chunks(dk: int, chunks: tuple[int, int]) -> None:
    assert _head_dim_chunks(dk) == chunks


def _resolve(
    config: ScoreConfig | None,
    group: int,
    n: int,
    weights: PhaseWeights,
    tq: int,
    dtype: torch.dtype = torch.bfloat16,
    head_dim: int = 128,
) -> ScoreConfig:
    return resolve_config(
        config,
        group=group,
        num_selected=n,
        weights=weights,
        tq=tq,
        dtype=dtype,
        head_dim=head_dim,
    )


def test_resolve_config_defaults_and_floors() -> None:
    paper = phase_weights(32, 16, 64)
    cfg = _resolve(None, 16, 16, paper, 65536)
    # dk = 128: 64 dot columns, 16 selection blocks at l' = 4d (measured faster than 32).
    # Four warps on a 128 x 64 dot at dk <= 128 (three programs an SM); eight on a wider dot
    # or at dk = 192, where four spill.
    assert (cfg.block_rows, cfg.block_sel, cfg.block_lse, cfg.warps) == (128, 16, 64, 4)
    wide = _resolve(None, 16, 16, paper, 65536, head_dim=192)
    assert (wide.block_sel, wide.warps) == (32, 8)
    assert _resolve(ScoreConfig(block_sel=64), 16, 16, paper, 65536).warps == 8
    assert _resolve(ScoreConfig(block_rows=256), 16, 16, paper, 65536).warps == 8
    assert _resolve(ScoreConfig(block_rows=64), 16, 16, paper, 65536).warps == 4
    assert _resolve(None, 16, 16, paper, 65536, head_dim=256).block_sel == 16
    # float32 dots run on CUDA cores: smaller row tiles.
    assert _resolve(None, 16, 16, paper, 65536, torch.float32).block_rows == 32
    # G = 1: 128 tokens per tile, so 8 selection blocks would do; 16 is the floor.
    assert _resolve(None, 1, 4, paper, 65536).block_sel == 16
    # A decode row takes one token per tile; a group wider than the request is kept whole.
    assert _resolve(None, 16, 16, paper, 1).block_rows == 16
    assert _resolve(ScoreConfig(block_rows=32), 64, 16, paper, 100).block_rows == 64
    # block_sel holds n and the reach of a spill.
    assert _resolve(ScoreConfig(block_sel=16), 4, 40, paper, 100).block_sel == 64
    long_cmp = phase_weights(512, 16, 16)  # reach 31
    assert _resolve(ScoreConfig(block_sel=16), 1, 3, long_cmp, 9).block_sel == 32
    with pytest.raises(ValueError, match="power of two"):
        _resolve(ScoreConfig(block_sel=24), 1, 3, paper, 10)
    with pytest.raises(ValueError, match="shift"):
        _resolve(ScoreConfig(shift=3), 1, 3, paper, 10)
    assert parse_config("block_rows=64, warps=4") == ScoreConfig(block_rows=64, warps=4)
    with pytest.raises(ValueError, match="unknown"):
        parse_config("rows=64")


def test_varlen_query_tiles() -> None:
    cu = torch.tensor([0, 1, 1, 21, 30], dtype=torch.int32)  # lengths 1, 0, 20, 9
    table = varlen_query_tiles(cu, 30, 8)
    assert table.dtype == torch.int32
    assert table.shape == (-(-30 // 8) + 4, 2)
    real = [tuple(r) for r in table.tolist() if r[0] >= 0]
    # Every token of every sequence in exactly one tile, longest-reaching tiles first.
    assert sorted(real) == [(0, 0), (2, 0), (2, 8), (2, 16), (3, 0), (3, 8)]
    assert real[0] == (2, 16)
    assert all(r == [-1, 0] for r in table.tolist()[len(real) :])
