"""``nsa-bench cp``: a tiny CPU run over gloo (1 and 2 spawned ranks) and its failure rows."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from pathlib import Path

from nsa_bench import cp_bench
from nsa_bench.cli import COMMANDS, build_parser


def _args(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "cp",
        "--device",
        "cpu",
        "--heads",
        "4/2",
        "--head-dims",
        "16/8",
        "--cmp-block",
        "8",
        "--cmp-stride",
        "4",
        "--sel-block",
        "8",
        "--num-selected",
        "4",
        "--window",
        "16",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--comm-iters",
        "1",
        "--out",
        str(tmp_path / "out"),
        *extra,
    ]


def test_cli_lists_cp() -> None:
    assert COMMANDS["cp"][0] == "nsa_bench.cp_bench"
    args = build_parser().parse_args(["cp"])
    assert (args.world_sizes, args.seqlens, args.layout) == (
        [1, 2, 4, 8],
        [128 << 10, 256 << 10, 512 << 10, 1 << 20],
        "zigzag",
    )


def test_tiny_cpu_run_writes_every_row(tmp_path: Path) -> None:
    argv = _args(
        tmp_path,
        "--world-sizes",
        "1,2",
        "--seqlens",
        "37",
        "--sel-exchanges",
        "all_gather,prefix",
    )
    args = build_parser().parse_args(argv)
    assert cp_bench.run(args) == 0
    out = tmp_path / "out"
    with (out / "cp.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    recs = json.loads((out / "cp.json").read_text())
    assert [list(r) for r in recs] == [list(r) for r in rows]  # one schema for both files
    # W=1: the baseline and both exchanges; W=2: both exchanges.
    keys = [(r["world_size"], r["T"], r["method"], r["sel_exchange"]) for r in rows]
    assert keys == [
        ("1", "37", "single", "-"),
        ("1", "37", "cp", "all_gather"),
        ("1", "37", "cp", "prefix"),
        ("2", "37", "cp", "all_gather"),
        ("2", "37", "cp", "prefix"),
    ]
    for r in rows:
        assert r["status"] == "ok", r
        assert float(r["step_ms"]) > 0
        assert math.isclose(float(r["tokens_per_s"]), int(r["T"]) / (float(r["step_ms"]) / 1e3))
        assert float(r["vs_single"]) > 0
        assert r["memory"] == "cpu_max_rss"
        assert len(r["peak_mib_ranks"].split(";")) == int(r["world_size"])
        assert r["env_torch"]
        if r["method"] == "cp":
            assert float(r["comm_fwd_ms"]) > 0
            assert float(r["comm_bwd_ms"]) > 0
            assert 0 < float(r["comm_share"]) <= 1
        else:
            assert r["comm_fwd_ms"] == ""


def test_a_failed_case_names_its_reason_and_skips_the_rest(tmp_path: Path) -> None:
    args = build_parser().parse_args(_args(tmp_path, "--seqlens", "3,64"))
    s = cp_bench.settings(args)
    rows_path = tmp_path / "rows.jsonl"  # rank 0 wrote no row: the first case failed
    (tmp_path / "rows.jsonl.failed.1").write_text(
        json.dumps({"T": 3, "exchange": "all_gather", "status": "refused: ValueError: T"})
    )
    rows = cp_bench._failure_rows(s, 2, cp_bench._read_rows(rows_path), rows_path, "error: x")
    assert [(r.T, r.status.split(":")[0]) for r in rows] == [(3, "refused"), (64, "skipped")]


def test_more_ranks_than_gpus_are_skipped_rows(tmp_path: Path) -> None:
    args = build_parser().parse_args(_args(tmp_path, "--seqlens", "64"))
    s = cp_bench.settings(args)
    s = dataclasses.replace(s, device="cuda")
    rows = cp_bench.run_world(s, 10_000)
    assert [r.status.split(":")[0] for r in rows] == ["skipped"]
