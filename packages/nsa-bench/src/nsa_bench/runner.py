"""``nsa-bench runner``: validate and benchmark a host in one shot, into artifacts and a report.

Steps, in order: environment metadata, the routing report with the torch/triton pairing verdict,
each test tier (pass/fail/skip counts and runtime from pytest's JUnit XML), the benches, and a
Markdown report in the seeds' template. Everything lands in ``artifacts/runner/<commit>/``.
A failing step is recorded and makes the exit code non-zero; later steps still run, so one
report shows everything. On a host without CUDA the GPU tiers and GPU benches are marked
skipped with that reason.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nsa_bench.env import collect

REPO = Path(__file__).resolve().parents[4]


@dataclass(frozen=True)
class Tier:
    """One pytest invocation of the report: what it runs and what it needs."""

    name: str
    args: tuple[str, ...]
    needs_cuda: bool = False
    env: tuple[tuple[str, str], ...] = ()
    # The interpreter tier is how CPU hosts check kernel logic; a GPU host runs the same kernels
    # compiled in its GPU tiers instead.
    cpu_only: bool = False


TIERS = (
    Tier("Reference (CPU)", ("packages/nsa-core/tests",)),
    Tier(
        "Triton interpreter (CPU)",
        ("packages/nsa-kernels/tests", "-m", "triton and not gpu"),
        env=(("TRITON_INTERPRET", "1"),),
        cpu_only=True,
    ),
    Tier(
        "Kernel CPU logic",
        ("packages/nsa-kernels/tests", "-m", "not triton and not gpu and not fa2 and not cuda"),
    ),
    Tier("Bench CPU", ("packages/nsa-bench/tests",)),
    Tier(
        "Triton FWD parity",
        ("packages/nsa-kernels/tests/selected", "-m", "gpu", "-k", "not backward"),
        needs_cuda=True,
        env=(("NSA_USE_TRITON_SEL", "1"), ("NSA_TRITON_SEL_FORCE", "1")),
    ),
    Tier(
        "Triton BWD parity",
        ("packages/nsa-kernels/tests/selected", "-m", "gpu", "-k", "backward"),
        needs_cuda=True,
        env=(
            ("NSA_USE_TRITON_SEL", "1"),
            ("NSA_SEL_TRITON_ALLOW_GRAD", "1"),
            ("NSA_TRITON_SEL_FORCE", "1"),
        ),
    ),
    Tier(
        "FA-2 varlen",
        ("packages/nsa-kernels/tests", "-m", "fa2", "-k", "fa2_gpu_varlen"),
        needs_cuda=True,
        env=(("NSA_USE_FA2", "1"),),
    ),
    Tier(
        "FA-2 (all)",
        ("packages/nsa-kernels/tests", "-m", "fa2"),
        needs_cuda=True,
        env=(("NSA_USE_FA2", "1"),),
    ),
    Tier(
        "Grad/Train smokes",
        ("packages/nsa-core/tests", "--run-slow", "-m", "slow"),
        needs_cuda=True,
    ),
    Tier(
        "CUDA experiment",
        ("packages/nsa-kernels/tests", "-m", "cuda"),
        needs_cuda=True,
        env=(("NSA_USE_CUDA_SEL", "1"),),
    ),
)


@dataclass
class StepResult:
    name: str
    status: str  # PASS, FAIL, SKIP
    seconds: float
    detail: str = ""
    files: list[str] = field(default_factory=list)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out", default=None, help="artifact folder (default artifacts/runner/<commit>)"
    )
    parser.add_argument("--quick", action="store_true", help="small bench sizes (CPU hosts, CI)")
    parser.add_argument("--skip-benches", action="store_true")
    parser.add_argument("--workers", default="auto", help="pytest-xdist workers for CPU tiers")


def _run(
    cmd: list[str], log: Path, env: dict[str, str] | None = None, timeout: float = 3600
) -> int:
    """Run ``cmd`` with stdout+stderr teed to ``log``; returns the exit code."""
    print(f"$ {' '.join(cmd)}", flush=True)
    with log.open("w") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.run(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=timeout, check=False
        )
    return proc.returncode


def _junit_counts(path: Path) -> dict[str, int]:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for s in suites:
        for key in counts:
            counts[key] += int(s.get(key, 0))
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def run_tier(tier: Tier, out: Path, has_cuda: bool, workers: str, debug_log: bool) -> StepResult:
    slug = "".join(c if c.isalnum() else "_" for c in tier.name.lower()).strip("_")
    if tier.needs_cuda and not has_cuda:
        return StepResult(tier.name, "SKIP", 0.0, "no CUDA device visible to torch")
    if tier.cpu_only and has_cuda:
        return StepResult(tier.name, "SKIP", 0.0, "GPU host: the GPU tiers run these kernels")
    env = dict(os.environ)
    env.update(dict(tier.env))
    if debug_log:
        env.update({"NSA_DEBUG_LOG": "1", "NSA_LOG_LIMIT": "5"})
    junit = out / f"tests_{slug}.xml"
    log = out / f"tests_{slug}.log"
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", f"--junitxml={junit}", *tier.args]
    if not tier.needs_cuda and workers != "0":
        cmd += ["-n", workers]
    if debug_log:
        cmd += ["-o", "log_cli=true", "--log-cli-level=INFO"]
    start = time.perf_counter()
    code = _run(cmd, log, env)
    seconds = time.perf_counter() - start
    files = [log.name]
    if not junit.exists():
        return StepResult(tier.name, "FAIL", seconds, f"pytest exited {code}, no report", files)
    files.append(junit.name)
    c = _junit_counts(junit)
    detail = f"{c['passed']} passed, {c['failures'] + c['errors']} failed, {c['skipped']} skipped"
    if code == 5 and c["skipped"] > 0:
        # Everything selected skipped at collection (say, a module that needs flash_attn).
        reasons = sorted(
            {
                ln.split(": ", 1)[-1]
                for ln in log.read_text().splitlines()
                if ln.startswith("SKIPPED")
            }
        )
        return StepResult(tier.name, "SKIP", seconds, "; ".join(reasons) or detail, files)
    if code == 5 or c["tests"] == 0:
        return StepResult(tier.name, "FAIL", seconds, "no tests collected", files)
    if code != 0:
        return StepResult(tier.name, "FAIL", seconds, detail, files)
    status = "SKIP" if c["passed"] == 0 and c["skipped"] > 0 else "PASS"
    return StepResult(tier.name, status, seconds, detail, files)


def run_bench(name: str, argv: list[str], out: Path, args_timeout: float = 900) -> StepResult:
    log = out / f"bench_{name}.log"
    start = time.perf_counter()
    code = _run([sys.executable, "-m", "nsa_bench.cli", *argv], log, timeout=args_timeout)
    seconds = time.perf_counter() - start
    lines = log.read_text().strip().splitlines()
    tail = "\n".join(lines[-12:])
    return StepResult(name, "PASS" if code == 0 else "FAIL", seconds, tail, [log.name])


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(args: argparse.Namespace) -> int:
    commit = _commit()
    out = Path(args.out) if args.out else REPO / "artifacts" / "runner" / commit
    out.mkdir(parents=True, exist_ok=True)
    has_cuda = torch.cuda.is_available()
    results: list[StepResult] = []
    print(f"runner: artifacts in {out}", flush=True)

    # 1. environment
    start = time.perf_counter()
    env_info = collect()
    (out / "env.json").write_text(json.dumps(env_info, indent=2, default=str))
    env_files = ["env.json"]
    if shutil.which("nvidia-smi"):
        _run(["nvidia-smi"], out / "nvidia_smi.txt")
        env_files.append("nvidia_smi.txt")
    code = _run([sys.executable, "-m", "torch.utils.collect_env"], out / "collect_env.txt")
    env_files.append("collect_env.txt")
    results.append(
        StepResult(
            "Environment",
            "PASS" if code == 0 else "FAIL",
            time.perf_counter() - start,
            "",
            env_files,
        )
    )

    # 2. routing + pairing
    start = time.perf_counter()
    code = _run([sys.executable, "-m", "nsa_bench.cli", "routing"], out / "routing.txt")
    results.append(
        StepResult(
            "Routing report",
            "PASS" if code == 0 else "FAIL",
            time.perf_counter() - start,
            (out / "routing.txt").read_text().strip(),
            ["routing.txt"],
        )
    )

    # 3. test tiers (the first one also with structured debug logs)
    for i, tier in enumerate(TIERS):
        print(f"[tier {i + 1}/{len(TIERS)}] {tier.name}", flush=True)
        result = run_tier(tier, out, has_cuda, args.workers, debug_log=(i == 0))
        print(f"    {result.status} {result.detail} ({result.seconds:.1f} s)", flush=True)
        results.append(result)

    # 4. benches
    if not args.skip_benches:
        s_list = "512,1024,2048" if args.quick or not has_cuda else "512,1024,2048,4096,8192"
        iters = "8" if not has_cuda else "64"
        decode_csv = out / "decode.csv"
        results.append(
            run_bench(
                "decode",
                [
                    "decode",
                    "--S_list",
                    s_list,
                    "--iters",
                    iters,
                    "--warmup",
                    "2",
                    "--csv",
                    str(decode_csv),
                ],
                out,
            )
        )
        results.append(run_bench("decode_summary", ["summarize", str(decode_csv)], out))
        if has_cuda:
            sel_args = [
                "sel",
                "--L_list",
                "64,128,256,512,1024",
                "--iters",
                "20",
                "--csv",
                str(out / "sel.csv"),
            ]
            results.append(run_bench("sel", sel_args, out))
            fa2_args = [
                "fa2",
                "--T",
                "1024,4096,16384",
                "--D",
                "128",
                "--csv",
                str(out / "fa2.csv"),
            ]
            results.append(run_bench("fa2", fa2_args, out))
        else:
            for name in ("sel", "fa2"):
                results.append(StepResult(name, "SKIP", 0.0, "no CUDA device visible to torch"))

    report = render_report(results, env_info, commit, out)
    (out / "report.md").write_text(report)
    print("\n" + report)
    failed = [r.name for r in results if r.status == "FAIL"]
    print(f"runner: {len(failed)} failed step(s){': ' + ', '.join(failed) if failed else ''}")
    return 1 if failed else 0


def render_report(
    results: list[StepResult], env: Mapping[str, object], commit: str, out: Path
) -> str:
    """The seeds' report template, filled from this run."""
    lines = [
        f"GPU Host: {socket.gethostname()} / {env.get('gpu_name', 'none')} / "
        f"Driver {env.get('gpu_driver', 'none')}",
        f"Commit: {commit}",
        f"Torch/Triton/CUDA: torch {env.get('torch')}, triton {env.get('triton')}, "
        f"cuda {env.get('cuda')}",
        f"Pairing: {env.get('pairing', 'unknown')}",
        "",
        "Tests:",
    ]
    for r in results:
        if r.name.startswith(("Environment", "Routing")) or (
            r.files and r.files[0].startswith("bench_")
        ):
            continue
        if r.name in ("sel", "fa2") and r.status == "SKIP":
            continue
        lines.append(
            f"- {r.name}: {r.status} ({r.seconds:.1f} s){' - ' + r.detail if r.detail else ''}"
        )
    lines += ["", "Benches:"]
    for r in results:
        if (r.files and r.files[0].startswith("bench_")) or r.name in ("sel", "fa2"):
            lines.append(f"- {r.name}: {r.status} ({r.seconds:.1f} s)")
            if r.detail:
                lines += ["```", r.detail, "```"]
    routing = next((r for r in results if r.name == "Routing report"), None)
    if routing is not None:
        lines += ["", "Routing:", "```", routing.detail, "```"]
    lines += ["", "Artifacts:"]
    for path in sorted(out.iterdir()):
        if path.name != "report.md":
            lines.append(f"- {path.name}")
    return "\n".join(lines) + "\n"
