"""Tokens read per decode step (docs/spec.md): the formula, the paper's Table 4, and the counts a
decode run actually reports."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from nsa_core import NSAAttention, NSACache, NSAConfig, expected_reads, selected_reads
from nsa_core.reference.selected_attention import selected_visibility

LayerFactory = Callable[..., NSAAttention]


def spec_reads(t: int, cfg: NSAConfig) -> int:
    """reads(t) = N_cmp(t+1) + sum_{j in I[t]} |block j ∩ [0, t]| + min(w, t+1), written out.

    I[t] holds min(n, t // l' + 1) distinct valid blocks and always the current block t // l'
    (forced); every other valid block lies wholly before t, so only the current one is partial.
    """
    lc, d, ls, n, w = cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, cfg.num_selected, cfg.window
    n_cmp = 0 if t + 1 < lc else (t + 1 - lc) // d + 1
    current = t // ls
    others = min(n, current + 1) - 1
    chosen = [current, *range(current - others, current)]  # the count does not depend on which
    selected = sum(len(range(j * ls, min((j + 1) * ls, t + 1))) for j in chosen)
    return n_cmp + selected + min(w, t + 1)


# Paper Table 4: context length -> expected tokens read per decode step, and L / reads.
TABLE_4 = [(8192, 2048, 4.0), (16384, 2560, 6.4), (32768, 3584, 9.1), (65536, 5632, 11.6)]


@pytest.mark.parametrize(("length", "paper_reads", "speedup"), TABLE_4)
def test_table4(length: int, paper_reads: int, speedup: float) -> None:
    """With paper defaults, the last step of an L-token context reads Table 4's count (±1)."""
    cfg = NSAConfig()
    reads = expected_reads(length - 1, cfg)
    assert abs(reads - paper_reads) <= 1, reads
    assert reads == spec_reads(length - 1, cfg)
    assert round(length / reads, 1) == speedup


def test_table4_breakdown_at_64k() -> None:
    """64k: 4095 compressed blocks + 16 full blocks of 64 + a window of 512."""
    assert expected_reads(65535, NSAConfig()) == 4095 + 16 * 64 + 512


@pytest.mark.parametrize(
    "cfg",
    [
        NSAConfig(),
        NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, num_selected=4, window=5),
        NSAConfig(cmp_block=16, cmp_stride=16, sel_block=32, num_selected=3, window=100),
    ],
    ids=["paper", "small", "d-equals-l"],
)
def test_expected_reads_matches_spec_everywhere(cfg: NSAConfig) -> None:
    """The formula at every position of the first 3000 (early positions, both saturations)."""
    for t in range(3000):
        assert expected_reads(t, cfg) == spec_reads(t, cfg), t


def test_expected_reads_early_positions_by_hand() -> None:
    """l=8, d=4, l'=8, n=4, w=5, counted by hand."""
    cfg = NSAConfig(cmp_block=8, cmp_stride=4, sel_block=8, num_selected=4, window=5)
    # t=0: no block, 1 selected token, window 1.
    assert expected_reads(0, cfg) == 0 + 1 + 1
    # t=7: block 0 complete (tokens 0..7); block 0 selected whole; window 5.
    assert expected_reads(7, cfg) == 1 + 8 + 5
    # t=8: still 1 block; blocks 0 (8 tokens) and 1 (1 token); window 5.
    assert expected_reads(8, cfg) == 1 + 9 + 5
    # t=11: blocks 0 and 1 complete; selection 8 + 4.
    assert expected_reads(11, cfg) == 2 + 12 + 5
    # t=40: 9 blocks; valid blocks 0..5, n=4 of them: 3 full + 1 token of block 5.
    assert expected_reads(40, cfg) == 9 + (3 * 8 + 1) + 5


def test_selected_count_is_distinct_visible_tokens() -> None:
    """Decode counts the selected branch's reads from its visibility mask: -1 is padding, a
    repeated index counts once, the current block counts up to t."""
    ls = 8
    t = 20  # current block 2 holds tokens 16..20: 5 visible
    idx = torch.tensor(
        [
            [[[0, 1, 2, -1]]],  # 8 + 8 + 5
            [[[2, -1, -1, -1]]],  # 5
            [[[0, 0, 2, 2]]],  # repeats: 8 + 5
            [[[-1, -1, -1, -1]]],  # nothing
        ],
        dtype=torch.int32,
    )  # [B=4, Tq=1, H=1, n=4]
    visible = selected_visibility(idx, ls, t, t + 1)
    assert visible.shape == (4, 1, 1, t + 1)
    counts = visible.sum(-1)[:, 0, 0]
    assert counts.tolist() == [21, 5, 13, 0]
    for b in range(4):
        assert selected_reads(t, idx[b, 0, 0].tolist(), ls) == counts[b]
    # Token p is visible iff its block is selected and p <= t.
    assert visible[0, 0, 0].all()
    assert visible[1, 0, 0].tolist() == [False] * 16 + [True] * 5


def decode_run(
    layer: NSAAttention, x: torch.Tensor
) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]]:
    """Decode x [B, T, hidden] from an empty cache; per step the stats' fields."""
    cfg = layer.config
    cache = NSACache.empty(cfg, x.shape[0], capacity=x.shape[1], dtype=x.dtype)
    rows = []
    with torch.no_grad():
        for t in range(x.shape[1]):
            _, s = layer.decode(x[:, t : t + 1], cache)
            rows.append((s.position, s.reads_cmp, s.reads_sel, s.reads_win, s.reads_actual,
                         s.reads_expected))  # fmt: skip
    return rows


def check_run(cfg: NSAConfig, layer: NSAAttention, x: torch.Tensor) -> None:
    batch, h = x.shape[0], cfg.num_kv_heads
    lc, d, ls, n, w = cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, cfg.num_selected, cfg.window
    for t, r_cmp, r_sel, r_win, r_all, r_exp in decode_run(layer, x):
        assert r_all.shape == (batch, h)
        n_cmp = 0 if t + 1 < lc else (t + 1 - lc) // d + 1
        blocks = min(n, t // ls + 1)
        assert r_exp == expected_reads(t, cfg) == spec_reads(t, cfg)
        assert (r_cmp == n_cmp).all(), t
        assert (r_sel == (t % ls + 1) + (blocks - 1) * ls).all(), t
        assert (r_win == min(w, t + 1)).all(), t
        assert (r_all == r_exp).all(), (t, r_all.tolist(), r_exp)


def test_measured_reads_equal_formula_paper_geometry(make_layer: LayerFactory,
                                                     gen: torch.Generator) -> None:  # fmt: skip
    """l=32, d=16, l'=64, n=16, w=512 (tiny heads): every step of a 1200-token decode reports the
    formula; the window saturates at t=511 and the selection at t=960 (16 valid blocks)."""
    cfg = NSAConfig(num_q_heads=2, num_kv_heads=1, head_dim_qk=4, head_dim_v=4)
    t = 1200
    assert t - 1 >= cfg.window
    assert (t - 1) // cfg.sel_block + 1 > cfg.num_selected
    layer = make_layer(cfg, 8, torch.float32)
    x = torch.randn(2, t, 8, generator=gen)
    check_run(cfg, layer, x)


@pytest.mark.parametrize(
    "cfg",
    [
        NSAConfig(num_q_heads=4, num_kv_heads=2, head_dim_qk=4, head_dim_v=6,
                  cmp_block=8, cmp_stride=4, sel_block=8, num_selected=4, window=5),
        NSAConfig(num_q_heads=3, num_kv_heads=3, head_dim_qk=4, head_dim_v=4,
                  cmp_block=8, cmp_stride=2, sel_block=16, num_selected=3, window=20),
    ],
    ids=["l8-d4-ls8-n4-w5", "l8-d2-ls16-n3-w20"],
)  # fmt: skip
def test_measured_reads_equal_formula_small_geometry(
    make_layer: LayerFactory, gen: torch.Generator, cfg: NSAConfig
) -> None:
    """Every early position (before the first block, before l', before w) and saturation."""
    layer = make_layer(cfg, 8, torch.float32)
    x = torch.randn(3, 100, 8, generator=gen)
    check_run(cfg, layer, x)
