"""The bench gate (ci/bench_gate.py): its verdict rule, and a whole run driven by stand-in workers.

The GPU worker times real kernels; here a stand-in worker answers each request with times drawn
around a per-tree median, so the gate's protocol, rounds, statistics, outputs and exit codes run
on a CPU exactly as on a GPU.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
from ci.bench_gate import (  # noqa: E402
    CSV_COLUMNS,
    SLOWDOWN,
    TreeTimes,
    build_parser,
    judge,
    quantile,
    spread,
)
from ci.bench_gate_worker import ROWS, row_spec  # noqa: E402

SPEC = row_spec("selected_attention forward T=65536")


def steady(ms: float, rounds: int = 5, calls: int = 4) -> TreeTimes:
    return TreeTimes([[ms] * calls for _ in range(rounds)])


def test_quantiles_interpolate_like_numpy() -> None:
    values = [4.0, 1.0, 3.0, 2.0, 5.0]
    assert quantile(values, 0.5) == 3.0
    assert quantile(values, 0.2) == pytest.approx(1.8)
    assert quantile(values, 0.8) == pytest.approx(4.2)
    # The highest and the lowest round are left out: one stray round does not widen the limit.
    assert spread([9.0, 9.9, 10.0, 10.1, 30.0]) == pytest.approx(0.02)


def test_a_row_fails_only_past_five_percent_plus_the_noise() -> None:
    assert judge(SPEC, steady(10.0), steady(10.4)).status == "pass"
    assert judge(SPEC, steady(10.0), steady(10.6)).status == "FAIL"
    assert judge(SPEC, steady(10.0), steady(9.0)).status == "pass"  # faster never fails
    noisy = TreeTimes([[10.0], [10.2], [9.7], [10.0], [9.0]])  # 3% spread without the ends
    verdict = judge(SPEC, noisy, steady(10.7))
    assert verdict.noise == pytest.approx(0.03)
    assert verdict.limit == pytest.approx(1 + SLOWDOWN + 0.03)
    assert verdict.status == "pass"
    assert judge(SPEC, noisy, steady(10.9)).status == "FAIL"


def test_a_row_the_base_cannot_run_is_reported_and_one_the_head_cannot_run_fails() -> None:
    missing = TreeTimes([], error="AttributeError: no such API")
    assert judge(SPEC, missing, steady(10.0)).status == "no base"
    assert judge(SPEC, steady(10.0), missing).status == "FAIL"


def test_the_arguments_are_checked_by_the_parser(tmp_path: Path) -> None:
    parser = build_parser()
    for argv in (
        ["--base", str(ROOT), "--head", str(tmp_path)],  # not a checkout
        ["--base", str(ROOT), "--head", str(ROOT), "--rounds", "3"],  # under 5 rounds
        ["--base", str(ROOT), "--head", str(ROOT), "--rows", "bogus row"],
    ):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(argv)
        assert exc.value.code == 2


FAKE_WORKER = """
import argparse, json, random, sys
parser = argparse.ArgumentParser()
parser.add_argument("--tree")
tree = parser.parse_args().tree
median = json.load(open(tree + "/median.json"))
rng = random.Random(tree)
print("ready nsa_core=" + tree, flush=True)
for line in sys.stdin:
    request = json.loads(line)
    ms = median.get(request["row"])
    if ms is None:
        answer = {"row": request["row"], "error": "KeyError: not in this tree"}
        print(json.dumps(answer), flush=True)
        continue
    times = [ms * (1 + rng.uniform(-0.005, 0.005)) for _ in range(request["calls"])]
    print(json.dumps({"row": request["row"], "ms": times}), flush=True)
"""


def fake_tree(path: Path, medians: dict[str, float]) -> Path:
    (path / "packages" / "nsa-core" / "src").mkdir(parents=True)
    (path / "median.json").write_text(json.dumps(medians))
    return path


def run_gate(tmp_path: Path, head_factor: float, slowed: str) -> tuple[int, Path, str]:
    worker = tmp_path / "fake_worker.py"
    worker.write_text(textwrap.dedent(FAKE_WORKER))
    base_ms = {spec.name: 1.0 + i for i, spec in enumerate(ROWS)}
    head_ms = {name: ms * (head_factor if name == slowed else 1.0) for name, ms in base_ms.items()}
    del base_ms["decode_step step B=32"]  # a row the base tree predates
    base = fake_tree(tmp_path / "base", base_ms)
    head = fake_tree(tmp_path / "head", head_ms)
    out, summary = tmp_path / "out", tmp_path / "summary.md"
    cmd = [sys.executable, str(ROOT / "ci" / "bench_gate.py"), "--base", str(base)]
    cmd += ["--head", str(head), "--out", str(out), "--summary", str(summary)]
    cmd += ["--worker", str(worker)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=300)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, out, summary.read_text()


def test_an_unchanged_tree_passes_with_every_output_written(tmp_path: Path) -> None:
    code, out, summary = run_gate(tmp_path, 1.0, slowed="")
    assert code == 0
    record = json.loads((out / "gate.json").read_text())
    statuses = {f"{r['kernel']} {r['mode']} {r['x_name']}={r['x_value']}": r["status"]
                for r in record["rows"]}  # fmt: skip
    assert statuses.pop("decode_step step B=32") == "no base"
    assert set(statuses.values()) == {"pass"}
    assert all(len(r["head_ms"]) == 5 for r in record["rows"])  # five rounds per tree
    with (out / "gate.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == CSV_COLUMNS
    assert {r["kernel_provider"] for r in rows} == {"nsa@base", "nsa@head"}
    assert len(rows) == 2 * len(ROWS) - 1  # the row the base lacks has no base line
    assert "### Bench gate: pass" in summary
    assert summary == (out / "gate.md").read_text()


def test_a_tree_ten_percent_slower_on_one_row_fails_on_that_row(tmp_path: Path) -> None:
    code, out, summary = run_gate(tmp_path, 1.10, slowed=SPEC.name)
    assert code == 1
    record = json.loads((out / "gate.json").read_text())
    failed = [r for r in record["rows"] if r["status"] == "FAIL"]
    assert [(r["kernel"], r["mode"], r["x_value"]) for r in failed] == [
        ("selected_attention", "forward", 65536)
    ]
    assert failed[0]["ratio"] == pytest.approx(1.10, abs=0.01)
    assert "### Bench gate: FAIL" in summary
