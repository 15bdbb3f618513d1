"""``nsa-bench sel``: index generators, the threshold rule, the packed-SDPA peer, and a CPU run."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch

from nsa_bench import sel_bench
from nsa_bench.cases import Shape
from nsa_bench.cli import build_parser
from nsa_bench.sel_bench import (
    Row,
    dist_block_indices,
    gathered_sdpa,
    nsa_block_indices,
    recommend_min_l,
    visible_keys,
)
from nsa_core.reference.selected_attention import selected_attention


def _check_rows(idx: torch.Tensor, q_start: int, sel_block: int) -> None:
    """Every row: ascending distinct valid blocks, then only -1."""
    for r in range(idx.shape[1]):
        jt = (q_start + r) // sel_block
        for row in idx[:, r].reshape(-1, idx.shape[-1]).tolist():
            valid = [j for j in row if j >= 0]
            assert row == valid + [-1] * (len(row) - len(valid))
            assert valid == sorted(set(valid))
            assert all(0 <= j <= jt for j in valid)


def test_nsa_indices_force_first_and_local_blocks() -> None:
    gen = torch.Generator().manual_seed(1)
    n, sel_block, tq = 6, 4, 50
    idx = nsa_block_indices(2, tq, 3, n, sel_block, generator=gen, chunk=16)
    assert idx.shape == (2, tq, 3, n)
    assert idx.dtype == torch.int32
    _check_rows(idx, 0, sel_block)
    for r in range(tq):
        jt = r // sel_block
        forced = {0, jt, max(jt - 1, 0)}
        for row in idx[:, r].reshape(-1, n).tolist():
            assert forced <= set(row)
            assert len([j for j in row if j >= 0]) == min(n, jt + 1)


def test_nsa_indices_are_random_beyond_the_forced_ones() -> None:
    idx = nsa_block_indices(1, 1, 64, 8, 4, q_start=400, generator=torch.Generator().manual_seed(2))
    rows = {tuple(r) for r in idx[0, 0].tolist()}
    assert len(rows) > 32  # 64 heads drawing 5 of 97 free blocks: repeats would be suspicious


@pytest.mark.parametrize("dist", ["few", "many", "mixed"])
def test_dist_indices(dist: str) -> None:
    idx = dist_block_indices(
        1, 40, 2, 5, 8, dist, q_start=30, generator=torch.Generator().manual_seed(3)
    )
    _check_rows(idx, 30, 8)
    if dist == "few":
        for r in range(40):
            jt = (30 + r) // 8
            run = [j for j in range(jt - 4, jt + 1) if j >= 0]
            assert idx[0, r, 0].tolist() == run + [-1] * (5 - len(run))


def test_visible_keys_counts_causal_tokens() -> None:
    idx = torch.tensor([[[[0, 1]], [[1, -1]]]], dtype=torch.int32)  # rows at t = 5, 6; l' = 4
    # t=5 sees 0..3 and 4..5 (6 keys); t=6 sees 4..6 (3 keys).
    assert visible_keys(idx, 4, 5, 16) == 9


def test_gathered_sdpa_matches_the_reference() -> None:
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 12, 4, 16, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 20, 2, 16, generator=gen, dtype=torch.float64)
    v = torch.randn(1, 20, 2, 8, generator=gen, dtype=torch.float64)
    idx = dist_block_indices(1, 12, 2, 3, 4, "mixed", q_start=8, generator=gen)
    idx[0, 0, 0] = -1  # a row that sees nothing gives 0 in both
    ref = selected_attention(q, k, v, idx, 4, q_start=8)
    out = gathered_sdpa(q, k, v, idx, 4, 8)
    torch.testing.assert_close(out, ref)


def _row(length: int, speedup: float, method: str = "triton") -> Row:
    return Row("rows", "fwd", method, "fp16", 1, length, 8, 8, 1, 8, 64, 64, 1, 64, "many",
               speedup=speedup)  # fmt: skip


def test_threshold_is_smallest_l_from_which_triton_stays_ahead() -> None:
    rows = [_row(64, 0.8), _row(128, 1.3), _row(256, 1.1), _row(512, 1.5), _row(1024, 2.0)]
    assert recommend_min_l(rows, 1.2) == 512
    rows = [_row(96, 1.25), _row(192, 1.4)]
    assert recommend_min_l(rows, 1.2) == 128  # 96 rounded up to a power of two
    assert recommend_min_l([_row(64, 1.0), _row(128, math.nan)], 1.2) is None
    assert recommend_min_l([_row(64, 3.0, method="sdpa")], 1.2) is None


def test_cli_rows_mode_on_cpu_writes_csv(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sel.csv"
    argv = ["sel", "--query-rows", "16", "--heads", "2", "--dk", "16", "--dv", "16",
            "--seqlens", "64,128", "--sel-block", "16", "--num-selected", "4", "--dist", "mixed",
            "--methods", "sdpa,reference", "--iters", "1", "--warmup", "0",
            "--csv", str(out)]  # fmt: skip
    args = build_parser().parse_args(argv)
    assert sel_bench.run(args) == 0
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 4
    assert {r["method"] for r in rows} == {"sdpa", "reference"}
    assert {r["mode"] for r in rows} == {"rows"}
    assert all(r["status"] == "ok" and float(r["ms"]) > 0 for r in rows)
    assert "env_torch" in rows[0] or "env_error" in rows[0]
    printed = capsys.readouterr().out
    assert "recommended NSA_SEL_TRITON_MIN_LEN" in printed.splitlines()[-1]


def test_mode_seeds_is_the_deprecated_name_of_rows(tmp_path: Path) -> None:
    out = tmp_path / "sel.csv"
    argv = ["sel", "--mode", "seeds", "--query-rows", "8", "--heads", "2", "--dk", "16",
            "--dv", "16", "--seqlens", "64", "--sel-block", "16", "--num-selected", "2",
            "--methods", "reference", "--iters", "1", "--warmup", "0",
            "--csv", str(out)]  # fmt: skip
    args = build_parser().parse_args(argv)
    with pytest.warns(DeprecationWarning, match="--mode seeds is deprecated; use --mode rows"):
        assert sel_bench.run(args) == 0
    assert [r["mode"] for r in csv.DictReader(out.open())] == ["rows"]


def test_mode_resolution() -> None:
    assert sel_bench.resolve_mode(None, False) == "rows"
    assert sel_bench.resolve_mode(None, True) == "prefill"
    assert sel_bench.resolve_mode("prefill", False) == "prefill"
    with pytest.raises(ValueError, match="--prefill contradicts --mode rows"):
        sel_bench.resolve_mode("rows", True)


def test_forward_only_methods_report_their_backward_as_not_applicable() -> None:
    shape = Shape(1, 64, 2, 1, 16, 16, "fp32")
    p = sel_bench.make_problem(shape, 8, 2, 16, torch.device("cpu"), "many", 0)
    ms, status = sel_bench.time_method("cuda", p, "fwd_bwd", lambda fn: 1.0)
    assert math.isnan(ms)
    assert status == "n/a: cuda is forward only"


def test_cuda_method_on_cpu_is_reported_not_raised() -> None:
    shape = Shape(1, 64, 2, 1, 16, 16, "fp32")
    p = sel_bench.make_problem(shape, 8, 2, 16, torch.device("cpu"), "many", 0)
    ms, status = sel_bench.time_method("cuda", p, "fwd", lambda fn: 1.0)
    assert math.isnan(ms)
    assert status.startswith("error: ")
