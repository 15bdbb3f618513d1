"""``nsa-bench fa2`` on CPU: the sweep runs, rows carry speedups and env columns, cutoff rule."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
import torch

from nsa_bench import fa2_bench
from nsa_bench.cli import build_parser


def _row(
    branch: str, t: int, d: int, method: str, ms: float | str, mode: str = "fwd"
) -> dict[str, Any]:
    return {"branch": branch, "mode": mode, "T": t, "dk": d, "method": method, "ms": ms}


def test_cutoff_is_the_smallest_t_from_which_fa2_stays_ahead() -> None:
    rows = []
    # D=64: FA-2 1.3x ahead from T=512; D=128: from T=1024 (and a dip at 256 for both).
    for t, (fa2_64, fa2_128) in {
        256: (1.0, 1.0),
        512: (1.3, 1.1),
        1024: (1.5, 1.25),
        2048: (2.0, 2.0),
    }.items():
        rows += [
            _row("sliding", t, 64, "fa2", 1.0),
            _row("sliding", t, 64, "sdpa", fa2_64),
            _row("sliding", t, 64, "flex", 9.0),
        ]
        rows += [
            _row("sliding", t, 128, "fa2", 1.0),
            _row("sliding", t, 128, "sdpa", fa2_128),
            _row("sliding", t, 128, "flex", ""),
        ]
    rec = fa2_bench.recommend(rows, 1.2)["sliding/fwd"]
    assert rec["fa2_min_len"] == 1024
    assert rec["flex_min_len"] is None  # flex slower than sdpa wherever both ran

    # A dip at a larger T moves the cutoff past it.
    rows.append(_row("sliding", 4096, 64, "fa2", 1.0))
    rows.append(_row("sliding", 4096, 64, "sdpa", 1.1))
    assert fa2_bench.recommend(rows, 1.2)["sliding/fwd"]["fa2_min_len"] is None


def test_cutoff_uses_the_best_fallback() -> None:
    rows = [
        _row("compressed", 1024, 64, "fa2", 1.0),
        _row("compressed", 1024, 64, "sdpa", 5.0),
        _row("compressed", 1024, 64, "flex", 1.1),
    ]
    rec = fa2_bench.recommend(rows, 1.2)["compressed/fwd"]
    assert rec["fa2_min_len"] is None
    assert rec["flex_min_len"] == 1024
    assert rec["median_fa2_vs_best_fallback"] == {1024: 1.1}


def test_measure_on_cpu_fills_rows() -> None:
    cases = [
        fa2_bench.Case(branch, mode, torch.float32, 1, 64, 4, 2, 16, 16, 8, 4)
        for branch in fa2_bench.BRANCHES
        for mode in fa2_bench.MODES
    ]
    rows = fa2_bench.measure(
        cases,
        ["fa2", "sdpa", "reference"],
        torch.device("cpu"),
        warmup=1,
        rep=1,
        seed=0,
        log=lambda line: None,
    )
    assert len(rows) == 3 * len(cases)
    for row in rows:
        if row["method"] == "fa2":
            assert row["status"].startswith("unavailable: FA-2 needs a CUDA device")
            assert row["ms"] == ""
        else:
            assert row["status"] == "ok", row
            assert float(row["ms"]) > 0
            assert row["fa2_speedup"] == ""  # no FA-2 time to compare with
    table = fa2_bench.summary_table(rows, ["fa2", "sdpa", "reference"])
    assert "compressed" in table
    assert "sliding" in table


def test_write_csv_has_env_columns(tmp_path: Path) -> None:
    rows = [{**dict.fromkeys(fa2_bench.CSV_COLUMNS, ""), "branch": "sliding", "ms": 1.5}]
    path = tmp_path / "out.csv"
    fa2_bench.write_csv(path, rows, {"gpu": "H100", "torch": "2.11"})
    with path.open() as f:
        (got,) = list(csv.DictReader(f))
    assert got["env_gpu"] == "H100"
    assert got["env_torch"] == "2.11"
    assert got["ms"] == "1.5"


def test_cli_end_to_end_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "fa2.csv"
    args = build_parser().parse_args(
        [
            "fa2",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--seqlens",
            "64,128",
            "--head-dims",
            "16",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--window",
            "16",
            "--cmp-block",
            "8",
            "--cmp-stride",
            "4",
            "--methods",
            "fa2,sdpa",
            "--modes",
            "fwd",
            "--csv",
            str(out),
        ]
    )
    assert fa2_bench.run(args) == 0
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 2 * 2
    env_keys = [key for key in rows[0] if key.startswith("env_")]
    assert "env_torch" in env_keys
    assert rows[0]["env_torch"] == torch.__version__
    printed = capsys.readouterr().out
    assert "sliding/fwd" in printed
    assert "no FA-2/fallback pair was timed" in printed


def test_unknown_method_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["fa2", "--methods", "fa2,cudnn"])
    assert exit_info.value.code == 2
    assert "argument --methods: unknown 'cudnn'" in capsys.readouterr().err
