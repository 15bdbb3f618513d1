"""The bench regression gate: time a fixed set of rows on two trees in one job; fail on a slowdown.

    python ci/bench_gate.py --base BASE_CHECKOUT --head HEAD_CHECKOUT [--rounds 5] [--out DIR]
        [--summary FILE] [--rows NAME,...]

Both trees are timed on this host's GPU in the same run, by the same worker code
(ci/bench_gate_worker.py, this checkout's), one worker process per tree, each running its own
tree's packages. The rows are the worker's ``ROWS``: the attention core forward and
forward+backward at 16k and 64k, the decode step at B=1 and B=32 over 64k cached tokens, the
selected branch forward and forward+backward at 64k.

For every row, ``--rounds`` rounds (at least 5) alternate the trees (base then head, then head
then base, ...), so a drift of the clock or the temperature falls on both alike. A round is
``calls`` timed calls, as many as fill about ``ROUND_MS`` (at least ``MIN_CALLS``); the tree's
p20/p50/p80 are over all its calls. The run-to-run noise of a row is the larger of the two trees'
spreads of round medians, the highest and the lowest round left out (:func:`spread`). A row fails
when

    head p50 / base p50 > 1 + SLOWDOWN + noise      (SLOWDOWN = 5%)

A row the base tree cannot run (it predates the row's API) is reported and does not fail; one
the head tree cannot run fails. Outputs under ``--out``: ``gate.csv`` (columns of Liger-Kernel's
bench schema: kernel, provider, mode, metric, unit, x name, x value, p20/p50/p80, GPU name,
commit; then noise, ratio and verdict), ``gate.json`` and ``gate.md``; ``--summary`` appends the
markdown table to a file (a GitHub job summary). Exit 0 when every row passed, 1 when one failed,
2 on bad arguments.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from ci.bench_gate_worker import ROWS, RowSpec, row_spec  # noqa: E402  (needs ROOT on sys.path)

SLOWDOWN = 0.05
MIN_ROUNDS = 5
ROUND_MS = 150.0
MIN_CALLS, MAX_CALLS = 3, 40
PACKAGES = ("nsa-core", "nsa-kernels", "nsa-bench")
WORKER = ROOT / "ci" / "bench_gate_worker.py"


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile of ``values`` by linear interpolation (numpy's default)."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def spread(round_medians: Sequence[float]) -> float:
    """Relative range of a tree's round medians without the highest and the lowest one:
    (second largest - second smallest) / median.

    One round that met a clock change or another process costs no more than one sample: with the
    plain range, one such round in five widened a row's limit to 1.9 in the H200 trial.
    """
    ordered = sorted(round_medians)
    return (ordered[-2] - ordered[1]) / statistics.median(ordered)


@dataclass
class TreeTimes:
    """One tree's calls of one row, grouped by round (ms)."""

    rounds: list[list[float]]
    error: str | None = None

    @property
    def calls(self) -> list[float]:
        return [ms for one in self.rounds for ms in one]

    def p(self, q: float) -> float:
        return quantile(self.calls, q)

    @property
    def noise(self) -> float:
        return spread([statistics.median(one) for one in self.rounds])


@dataclass
class Verdict:
    spec: RowSpec
    base: TreeTimes
    head: TreeTimes
    ratio: float
    noise: float
    limit: float
    status: str  # pass, FAIL, no base

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"


def judge(spec: RowSpec, base: TreeTimes, head: TreeTimes, slowdown: float = SLOWDOWN) -> Verdict:
    """The row's verdict: FAIL when head's median exceeds base's by more than slowdown + noise."""
    if head.error is not None:
        return Verdict(spec, base, head, math.nan, math.nan, math.nan, "FAIL")
    if base.error is not None:
        return Verdict(spec, base, head, math.nan, head.noise, math.nan, "no base")
    noise = max(base.noise, head.noise)
    ratio = head.p(0.5) / base.p(0.5)
    limit = 1.0 + slowdown + noise
    return Verdict(spec, base, head, ratio, noise, limit, "FAIL" if ratio > limit else "pass")


class Worker:
    """A worker process running ``tree``'s packages (ci/bench_gate_worker.py)."""

    def __init__(self, label: str, tree: Path, python: str, script: Path = WORKER) -> None:
        self.label, self.tree = label, tree
        src = os.pathsep.join(str(tree / "packages" / p / "src") for p in PACKAGES)
        env = dict(os.environ, PYTHONPATH=src, PYTHONUNBUFFERED="1")
        cmd = [python, str(script), "--tree", str(tree)]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=tree
        )
        self.where = self._line().removeprefix("ready ").strip()

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise RuntimeError(f"the {self.label} worker ({self.tree}) exited {code}")
        return line

    def time(self, row: str, calls: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"row": row, "calls": calls}) + "\n")
        self.proc.stdin.flush()
        answer: dict[str, Any] = json.loads(self._line())
        return answer

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def measure_row(spec: RowSpec, workers: dict[str, Worker], rounds: int) -> dict[str, TreeTimes]:
    """Both trees' calls of ``spec``, rounds alternating which tree goes first."""
    times = {label: TreeTimes([]) for label in workers}
    # The first request builds the row's inputs and compiles; it also sizes the rounds.
    probe = {label: w.time(spec.name, 1) for label, w in workers.items()}
    estimates = []
    for label, answer in probe.items():
        if "error" in answer:
            times[label].error = answer["error"]
        else:
            estimates.append(answer["ms"][0])
    if not estimates:
        return times
    calls = max(MIN_CALLS, min(MAX_CALLS, round(ROUND_MS / max(estimates))))
    labels = [label for label in workers if times[label].error is None]
    for i in range(rounds):
        for label in labels if i % 2 == 0 else labels[::-1]:
            answer = workers[label].time(spec.name, calls)
            if "error" in answer:  # a row that ran once and then failed: report it
                times[label].error = answer["error"]
                break
            times[label].rounds.append(answer["ms"])
    return times


def gpu_name() -> str:
    try:
        proc = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True, text=True, check=True, timeout=60,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else "unknown"


def commit_of(tree: Path) -> str:
    try:
        proc = subprocess.run(
            ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True, timeout=60,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    dirty = subprocess.run(
        ["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True, text=True, check=False, timeout=60,
    ).stdout.strip()  # fmt: skip
    return proc.stdout.strip() + ("+changes" if dirty else "")


CSV_COLUMNS = (
    "kernel_name", "kernel_provider", "kernel_operation_mode", "metric_name", "metric_unit",
    "x_name", "x_value", "y_value_20", "y_value_50", "y_value_80", "gpu_name", "commit",
    "calls", "noise", "ratio_head_over_base", "limit", "verdict",
)  # fmt: skip


def csv_rows(
    verdicts: Sequence[Verdict], gpu: str, commits: dict[str, str]
) -> list[dict[str, Any]]:
    rows = []
    for v in verdicts:
        for label, times in (("base", v.base), ("head", v.head)):
            if times.error is not None or not times.calls:
                continue
            rows.append({
                "kernel_name": v.spec.kernel, "kernel_provider": f"nsa@{label}",
                "kernel_operation_mode": v.spec.mode, "metric_name": "time", "metric_unit": "ms",
                "x_name": v.spec.x_name, "x_value": v.spec.x_value,
                "y_value_20": f"{times.p(0.2):.6g}", "y_value_50": f"{times.p(0.5):.6g}",
                "y_value_80": f"{times.p(0.8):.6g}", "gpu_name": gpu, "commit": commits[label],
                "calls": len(times.calls), "noise": f"{times.noise:.4f}",
                "ratio_head_over_base": f"{v.ratio:.4f}", "limit": f"{v.limit:.4f}",
                "verdict": v.status,
            })  # fmt: skip
    return rows


def _ms(times: TreeTimes) -> str:
    return "error" if times.error is not None else f"{times.p(0.5):.4g}"


def markdown(verdicts: Sequence[Verdict], gpu: str, commits: dict[str, str], rounds: int) -> str:
    failed = [v for v in verdicts if v.failed]
    lines = [
        f"### Bench gate: {'FAIL' if failed else 'pass'} ({gpu})",
        "",
        f"base `{commits['base']}`, head `{commits['head']}`; {rounds} rounds per tree, "
        f"alternating; a row fails when head p50 / base p50 > 1 + {SLOWDOWN:.0%} + noise, "
        "noise = the larger of the two trees' spreads of round medians, (second largest - "
        "second smallest) / median.",
        "",
        "| row | base p50 ms | head p50 ms | head / base | noise | limit | verdict |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for v in verdicts:
        ratio = "" if math.isnan(v.ratio) else f"{v.ratio:.3f}"
        noise = "" if math.isnan(v.noise) else f"{v.noise:.1%}"
        limit = "" if math.isnan(v.limit) else f"{v.limit:.3f}"
        lines.append(
            f"| {v.spec.name} | {_ms(v.base)} | {_ms(v.head)} | {ratio} | {noise} | {limit} "
            f"| {v.status} |"
        )
    for v in verdicts:
        for label, times in (("base", v.base), ("head", v.head)):
            if times.error is not None:
                lines.append(f"\n{v.spec.name}, {label}: {times.error}")
    return "\n".join(lines) + "\n"


def positive_rounds(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < MIN_ROUNDS:
        raise argparse.ArgumentTypeError(f"at least {MIN_ROUNDS} rounds, got {value}")
    return value


def checkout(text: str) -> Path:
    path = Path(text)
    if not (path / "packages" / "nsa-core" / "src").is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a checkout of this repository")
    return path.resolve()


def row_names(text: str) -> list[RowSpec]:
    try:
        return [row_spec(name.strip()) for name in text.split(",") if name.strip()]
    except KeyError as err:
        raise argparse.ArgumentTypeError(str(err.args[0])) from None


def run(args: argparse.Namespace, log: IO[str] = sys.stdout) -> int:
    gpu = gpu_name()
    commits = {"base": commit_of(args.base), "head": commit_of(args.head)}
    specs = args.rows or list(ROWS)
    start = time.monotonic()
    workers: dict[str, Worker] = {}
    try:
        for label, tree in (("base", args.base), ("head", args.head)):
            workers[label] = Worker(label, tree, args.python, args.worker)
            print(f"gate: {label} worker: {workers[label].where}", file=log, flush=True)
        verdicts = []
        for i, spec in enumerate(specs):
            times = measure_row(spec, workers, args.rounds)
            verdict = judge(spec, times["base"], times["head"])
            verdicts.append(verdict)
            print(
                f"gate: [{i + 1}/{len(specs)}] {spec.name}: base {_ms(verdict.base)} ms, "
                f"head {_ms(verdict.head)} ms, ratio {verdict.ratio:.3f}, noise "
                f"{verdict.noise:.1%}: {verdict.status} ({time.monotonic() - start:.0f} s)",
                file=log, flush=True,
            )  # fmt: skip
    finally:
        for worker in workers.values():
            worker.close()
    table = markdown(verdicts, gpu, commits, args.rounds)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    with (out / "gate.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(csv_rows(verdicts, gpu, commits))
    record = {
        "gpu": gpu, "commits": commits, "rounds": args.rounds, "slowdown": SLOWDOWN,
        "rows": [
            {**asdict(v.spec), "status": v.status, "ratio": v.ratio, "noise": v.noise,
             "base_ms": v.base.rounds, "head_ms": v.head.rounds,
             "base_error": v.base.error, "head_error": v.head.error}
            for v in verdicts
        ],
    }  # fmt: skip
    (out / "gate.json").write_text(json.dumps(record, indent=1))
    (out / "gate.md").write_text(table)
    if args.summary is not None:
        with args.summary.open("a") as f:
            f.write(table)
    print(table, file=log)
    return 1 if any(v.failed for v in verdicts) else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ci/bench_gate.py", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--base", type=checkout, required=True, help="the merge base's checkout")
    parser.add_argument("--head", type=checkout, required=True, help="the pull request's checkout")
    parser.add_argument(
        "--rounds", type=positive_rounds, default=MIN_ROUNDS, help="rounds per tree (>= 5)"
    )
    parser.add_argument("--rows", type=row_names, default=None, help="comma-separated row names")
    parser.add_argument("--out", type=Path, default=ROOT / "artifacts" / "gate")
    parser.add_argument("--summary", type=Path, default=None, help="append the table to this file")
    parser.add_argument("--python", default=sys.executable, help="the workers' Python")
    # Tests drive the gate on a CPU with a stand-in worker that answers with given times.
    parser.add_argument("--worker", type=Path, default=WORKER, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
