"""The runner: check and benchmark this host in one shot, into artifacts and a Markdown report.

    python ci/runner.py [--quick] [--tiers NAME,...] [--out DIR] [--skip-benches]

Run it from a checkout (it runs the checkout's tests) with a Python that has torch, triton and
the three packages installed; ``bash ci/runner.sh`` picks that Python. In order:

1. the torch/triton pairing, at once: a pair that the version table does not list prints a
   warning naming the install that fixes it, and the tiers that depend on it say so;
2. environment metadata and the routing report;
3. ``nsa-bench demo``: one NSA layer, prefill and decode, its routing and reads;
4. every test tier of ci/tiers.py (the CPU tiers everywhere, the GPU tiers where torch sees a
   CUDA GPU; elsewhere they are marked skipped with that reason), with progress while each runs;
   ``--quick`` runs each tier's smoke selection instead (a few of its tests, seconds each; the
   whole tiers are the README's test command's job);
5. the benches (decode; on a GPU also selection and FA-2), not with ``--quick``;
6. ``report.md``: a FAIL line names the step's first error.

Everything lands in ``artifacts/runner/<commit>/``. The exit code is non-zero when a step
failed; later steps still run, so one report shows everything.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# ci/ is a folder of scripts, not an installed package: make ``ci.tiers`` importable when this
# file runs as a script.
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from ci import tiers as tier_table  # noqa: E402  (needs ROOT on sys.path)

TIER_TIMEOUT_S = 3600.0
BENCH_TIMEOUT_S = 900.0
PROGRESS_EVERY_S = 20.0
DETAIL_CHARS = 300
_TIER_NAMES = tuple(t.name for t in tier_table.TIERS)


@dataclass
class StepResult:
    name: str
    status: str  # PASS, FAIL, SKIP
    seconds: float
    detail: str = ""
    files: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class HostPairing:
    """What the runner knows of torch/triton before any tier: the verdict and triton's import."""

    verdict: str
    reason: str
    torch: str | None
    triton: str | None
    cell: str | None
    # ``import triton.language`` under TRITON_INTERPRET=1: None when it works, else the error.
    interpreter_error: str | None = None

    @property
    def paired(self) -> bool:
        return self.verdict == "paired"


def pairing_warning(pairing: HostPairing) -> str | None:
    """One line that says what is wrong with the pair and how to fix it; None when paired."""
    if pairing.paired:
        return None
    fix = ""
    if pairing.cell is not None:
        fix = (
            f"; install the pair the table lists: pip install "
            f'"nsa-kernels[torch{pairing.cell.replace(".", "-")}]"'
        )
    return (
        f"WARNING: torch {pairing.torch} and triton {pairing.triton} are not a paired install "
        f"({pairing.verdict}: {pairing.reason}){fix}. Triton kernels may fail for that reason."
    )


_PROBE = """
import json, os
from nsa_kernels.pairing import installed_pairing
p = installed_pairing()
try:
    import triton.language
    error = None
except Exception as err:
    error = f"{type(err).__name__}: {err}"
print("NSA-PAIRING " + json.dumps({**p.__dict__, "interpreter_error": error}))
"""


def probe_pairing(python: str = sys.executable) -> HostPairing:
    """The pairing verdict of ``python``, and whether triton imports under the interpreter."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [python, "-c", _PROBE], env=env, capture_output=True, text=True, check=False, timeout=300
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("NSA-PAIRING ")]
    if not lines:
        why = first_error_in_log(proc.stderr) or f"exit {proc.returncode}"
        return HostPairing("unknown", f"could not ask {python}: {why}", None, None, None, why)
    found = json.loads(lines[-1].removeprefix("NSA-PAIRING "))
    return HostPairing(
        verdict=found["verdict"],
        reason=found["reason"],
        torch=found["torch"],
        triton=found["triton"],
        cell=found["cell"],
        interpreter_error=found["interpreter_error"],
    )


def _one_line(text: str, limit: int = DETAIL_CHARS) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def first_error_in_junit(path: Path) -> str | None:
    """``test id: message`` of the first failed or erroring test case in a JUnit XML report."""
    root = ET.parse(path).getroot()
    for case in root.iter("testcase"):
        for child in case:
            if child.tag in ("failure", "error"):
                test = f"{case.get('classname', '')}::{case.get('name', '')}"
                message = child.get("message") or ""
                if not message:
                    body = (child.text or "").strip().splitlines()
                    message = body[-1] if body else child.tag
                return _one_line(f"{test}: {message}")
    return None


_ERROR_LINE = re.compile(r"^E\s+(\S.*)$")


def first_error_in_log(text: str) -> str | None:
    """The first ``E   ...`` line pytest printed, else the last line that names an error."""
    for line in text.splitlines():
        m = _ERROR_LINE.match(line)
        if m:
            return _one_line(m[1])
    named = [ln for ln in text.splitlines() if re.search(r"(Error|Exception|error:)", ln)]
    return _one_line(named[-1]) if named else None


def junit_counts(path: Path) -> dict[str, int]:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for s in suites:
        for key in counts:
            counts[key] += int(s.get(key, 0))
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


_PERCENT = re.compile(r"\[\s*(\d+)%\]\s*$")


def _progress(log: Path) -> str:
    """The last ``[ NN%]`` pytest wrote to ``log``, or '' before it wrote one."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        m = _PERCENT.search(line)
        if m:
            return f"{m[1]}%"
    return ""


def run_logged(
    cmd: Sequence[str],
    log: Path,
    env: Mapping[str, str] | None = None,
    timeout: float = TIER_TIMEOUT_S,
    progress_label: str | None = None,
) -> int:
    """Run ``cmd`` in the checkout with stdout+stderr into ``log``; returns the exit code.

    With ``progress_label``, a line every PROGRESS_EVERY_S seconds says how far pytest is. A run
    past ``timeout`` is killed and returns 124.
    """
    print(f"    $ {shlex.join(cmd)}", flush=True)
    start = time.monotonic()
    next_note = start + PROGRESS_EVERY_S
    with log.open("w") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(
            list(cmd), stdout=f, stderr=subprocess.STDOUT, env=dict(env or os.environ), cwd=ROOT
        )
        while True:
            try:
                return proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                if now - start > timeout:
                    proc.kill()
                    proc.wait()
                    f.write(f"\nkilled after {timeout:.0f} s\n")
                    return 124
                if progress_label is not None and now >= next_note:
                    done = _progress(log)
                    where = f"{done} done" if done else "collecting"
                    print(f"    ... {progress_label}: {where}, {now - start:.0f} s", flush=True)
                    next_note = now + PROGRESS_EVERY_S


def tier_slug(tier: tier_table.Tier) -> str:
    return tier.name.replace("-", "_")


def run_tier(
    tier: tier_table.Tier,
    out: Path,
    has_cuda: bool,
    pairing: HostPairing,
    workers: str = "auto",
    gpu_workers: str = "0",
    smoke: bool = False,
) -> StepResult:
    """One tier of ci/tiers.py as one pytest run (``smoke``: its smoke selection alone); the
    result names the first error on failure."""
    if tier.hardware == "cuda" and not has_cuda:
        return StepResult(tier.title, "SKIP", 0.0, "no CUDA device visible to torch")
    uses_interpreter = tier.env.get("TRITON_INTERPRET") == "1"
    if uses_interpreter and pairing.interpreter_error:
        # Every Triton test would skip: a tier that runs nothing must not pass.
        detail = (
            f"import triton.language with TRITON_INTERPRET=1 fails: {pairing.interpreter_error}"
        )
        return StepResult(tier.title, "FAIL", 0.0, _one_line(detail))
    env = dict(os.environ)
    env.update(tier.env)
    junit = out / f"tests_{tier_slug(tier)}.xml"
    log = out / f"tests_{tier_slug(tier)}.log"
    junit.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", f"--junitxml={junit}"]
    cmd += tier.smoke_args() if smoke else tier.pytest_args()
    n = gpu_workers if tier.hardware == "cuda" else workers
    # A smoke run is a few tests: starting workers would cost more than it saves.
    if tier.parallel and n not in ("", "0") and not smoke:
        cmd += ["-n", n]
    start = time.monotonic()
    code = run_logged(cmd, log, env, progress_label=tier.name)
    seconds = time.monotonic() - start
    files = [log.name]
    log_text = log.read_text(errors="replace")
    # A tier of Triton kernels on an unpaired install says so beside its own first error.
    unpaired = "" if pairing.paired or tier.name == "reference" else f"; {pairing_note(pairing)}"
    if code == 124:
        return StepResult(tier.title, "FAIL", seconds, f"timed out{unpaired}", files)
    if not junit.exists():
        first = first_error_in_log(log_text) or "no error printed"
        detail = f"pytest exited {code} without a report; first error: {first}{unpaired}"
        return StepResult(tier.title, "FAIL", seconds, detail, files)
    files.append(junit.name)
    c = junit_counts(junit)
    counts = f"{c['passed']} passed, {c['failures'] + c['errors']} failed, {c['skipped']} skipped"
    skip_reasons = sorted(
        {ln.split(": ", 1)[-1] for ln in log_text.splitlines() if ln.startswith("SKIPPED")}
    )
    if code == 5 and c["skipped"] > 0:
        # Everything selected skipped at collection (a module that needs flash_attn, say).
        return StepResult(tier.title, "SKIP", seconds, "; ".join(skip_reasons) or counts, files)
    if code == 5 or c["tests"] == 0:
        # pytest exits 5 when nothing was selected: a tier that runs nothing is broken.
        return StepResult(tier.title, "FAIL", seconds, f"no tests collected{unpaired}", files)
    if code != 0:
        first = first_error_in_junit(junit) or first_error_in_log(log_text) or f"exit {code}"
        return StepResult(
            tier.title, "FAIL", seconds, f"{counts}; first error: {first}{unpaired}", files
        )
    if c["passed"] == 0 and c["skipped"] > 0:
        return StepResult(tier.title, "SKIP", seconds, "; ".join(skip_reasons) or counts, files)
    return StepResult(tier.title, "PASS", seconds, counts, files)


def pairing_note(pairing: HostPairing) -> str:
    return f"torch {pairing.torch} / triton {pairing.triton} not paired: {pairing.reason}"


def run_bench(name: str, argv: Sequence[str], out: Path) -> StepResult:
    log = out / f"bench_{name}.log"
    start = time.monotonic()
    code = run_logged([sys.executable, "-m", "nsa_bench.cli", *argv], log, timeout=BENCH_TIMEOUT_S)
    seconds = time.monotonic() - start
    text = log.read_text(errors="replace")
    tail = "\n".join(text.strip().splitlines()[-12:])
    if code == 0:
        return StepResult(name, "PASS", seconds, tail, [log.name])
    first = first_error_in_log(text) or f"exit {code}"
    return StepResult(name, "FAIL", seconds, f"first error: {first}\n{tail}", [log.name])


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _timed(name: str, cmd: Sequence[str], log: Path) -> StepResult:
    start = time.monotonic()
    code = run_logged(cmd, log, timeout=600)
    seconds = time.monotonic() - start
    text = log.read_text(errors="replace").strip()
    if code == 0:
        return StepResult(name, "PASS", seconds, "", [log.name])
    first = first_error_in_log(text) or f"exit {code}"
    return StepResult(name, "FAIL", seconds, f"first error: {first}", [log.name])


def selected_tiers(names: str | None) -> tuple[tier_table.Tier, ...]:
    if not names:
        return tier_table.TIERS
    return tuple(tier_table.tier(n.strip()) for n in names.split(",") if n.strip())


def run(args: argparse.Namespace) -> int:
    # The pair first: a wrong triton explains most kernel failures, so it is said before them.
    pairing = probe_pairing()
    warning = pairing_warning(pairing)
    print(f"runner: {sys.executable}")
    print(f"runner: torch {pairing.torch}, triton {pairing.triton}: {pairing.verdict}")
    if warning:
        print(warning, flush=True)
    if pairing.interpreter_error:
        print(
            f"WARNING: import triton.language fails under TRITON_INTERPRET=1: "
            f"{pairing.interpreter_error}",
            flush=True,
        )
    tiers = selected_tiers(args.tiers)

    import torch

    from nsa_bench.env import collect

    commit = _commit()
    out = Path(args.out) if args.out else ROOT / "artifacts" / "runner" / commit
    out.mkdir(parents=True, exist_ok=True)
    has_cuda = torch.cuda.is_available()
    results: list[StepResult] = []
    print(f"runner: artifacts in {out}", flush=True)

    print("[environment]", flush=True)
    start = time.monotonic()
    env_info = collect(repo=ROOT)
    (out / "env.json").write_text(json.dumps(env_info, indent=2, default=str))
    env_files = ["env.json"]
    if shutil.which("nvidia-smi"):
        run_logged(["nvidia-smi"], out / "nvidia_smi.txt", timeout=60)
        env_files.append("nvidia_smi.txt")
    collect_env = _timed(
        "Environment", [sys.executable, "-m", "torch.utils.collect_env"], out / "collect_env.txt"
    )
    results.append(
        StepResult(
            "Environment",
            collect_env.status,
            time.monotonic() - start,
            collect_env.detail,
            [*env_files, "collect_env.txt"],
        )
    )

    print("[routing]", flush=True)
    routing = _timed(
        "Routing report", [sys.executable, "-m", "nsa_bench.cli", "routing"], out / "routing.txt"
    )
    routing.detail = (out / "routing.txt").read_text(errors="replace").strip()
    results.append(routing)

    print("[demo]", flush=True)
    results.append(run_bench("demo", ["demo"], out))
    print(f"    {results[-1].status} ({results[-1].seconds:.1f} s)", flush=True)

    what = "smoke run" if args.quick else "tier"
    for i, tier in enumerate(tiers):
        print(f"[{what} {i + 1}/{len(tiers)}] {tier.name}: {tier.title}", flush=True)
        result = run_tier(
            tier, out, has_cuda, pairing, args.workers, args.gpu_workers, smoke=args.quick
        )
        print(f"    {result.status} ({result.seconds:.1f} s) {result.detail}", flush=True)
        results.append(result)

    if not args.skip_benches and not args.quick:
        results += run_benches(out, has_cuda)

    report = render_report(results, env_info, commit, out, warning)
    (out / "report.md").write_text(report)
    print("\n" + report)
    failed = [r.name for r in results if r.status == "FAIL"]
    print(f"runner: {len(failed)} failed step(s){': ' + ', '.join(failed) if failed else ''}")
    return 1 if failed else 0


def run_benches(out: Path, has_cuda: bool) -> list[StepResult]:
    results: list[StepResult] = []
    s_list = "512,1024,2048" if not has_cuda else "512,1024,2048,4096,8192"
    iters = "8" if not has_cuda else "64"
    decode_csv = out / "decode.csv"
    print("[bench] decode", flush=True)
    decode_args = ["decode-module", "--seqlens", s_list, "--iters", iters, "--warmup", "2"]
    results.append(run_bench("decode", [*decode_args, "--csv", str(decode_csv)], out))
    results.append(run_bench("decode_summary", ["summarize", str(decode_csv)], out))
    if has_cuda:
        print("[bench] sel", flush=True)
        sel_args = ["sel", "--seqlens", "64,128,256,512,1024", "--iters", "20"]
        results.append(run_bench("sel", [*sel_args, "--csv", str(out / "sel.csv")], out))
        print("[bench] fa2", flush=True)
        fa2_args = ["fa2", "--seqlens", "1024,4096,16384", "--head-dims", "128"]
        results.append(run_bench("fa2", [*fa2_args, "--csv", str(out / "fa2.csv")], out))
    else:
        for name in ("sel", "fa2"):
            results.append(StepResult(name, "SKIP", 0.0, "no CUDA device visible to torch"))
    return results


def _is_bench(result: StepResult) -> bool:
    return bool(result.files and result.files[0].startswith("bench_")) or result.name in (
        "sel",
        "fa2",
    )


def render_report(
    results: Sequence[StepResult],
    env: Mapping[str, object],
    commit: str,
    out: Path,
    warning: str | None = None,
) -> str:
    """The report: a pairing warning first where there is one, then the seeds' template."""
    failed = [r for r in results if r.status == "FAIL"]
    lines = [warning, ""] if warning else []
    lines += [
        f"GPU Host: {socket.gethostname()} / {env.get('gpu_name', 'none')} / "
        f"Driver {env.get('gpu_driver', 'none')}",
        f"Commit: {commit}",
        f"Torch/Triton/CUDA: torch {env.get('torch')}, triton {env.get('triton')}, "
        f"cuda {env.get('cuda')}",
        f"Pairing: {env.get('pairing', 'unknown')}",
        f"Result: {'FAIL, ' + ', '.join(r.name for r in failed) if failed else 'PASS'}",
        "",
        "Tests:",
    ]
    for r in results:
        if r.name in ("Environment", "Routing report") or _is_bench(r):
            continue
        lines.append(
            f"- {r.name}: {r.status} ({r.seconds:.1f} s){' - ' + r.detail if r.detail else ''}"
        )
    environment = next((r for r in results if r.name == "Environment"), None)
    if environment is not None and environment.status == "FAIL":
        lines.append(f"- Environment: FAIL - {environment.detail}")
    lines += ["", "Benches:"]
    for r in results:
        if _is_bench(r):
            lines.append(f"- {r.name}: {r.status} ({r.seconds:.1f} s)")
            if r.detail:
                lines += ["```", r.detail, "```"]
    routing = next((r for r in results if r.name == "Routing report"), None)
    if routing is not None:
        lines += ["", f"Routing: {routing.status}", "```", routing.detail, "```"]
    lines += ["", "Artifacts:"]
    for path in sorted(out.iterdir()):
        if path.name != "report.md":
            lines.append(f"- {path.name}")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ci/runner.py",
        description="Check and benchmark this host: pairing, environment, every test tier, "
        "benches, and a report under artifacts/runner/<commit>/.",
    )
    parser.add_argument(
        "--out", default=None, help="artifact folder (default artifacts/runner/<commit>)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the demo, the routing and a smoke run of each tier; no benches (minutes on a CPU)",
    )
    parser.add_argument("--skip-benches", action="store_true", help="tests only")
    parser.add_argument(
        "--tiers",
        default=None,
        help=f"comma-separated tiers to run (default all: {', '.join(_TIER_NAMES)})",
    )
    parser.add_argument("--workers", default="auto", help="pytest-xdist workers of the CPU tiers")
    parser.add_argument(
        "--gpu-workers", default="0", help="pytest-xdist workers of the GPU tiers (0: none)"
    )
    args = parser.parse_args(argv)
    try:
        selected_tiers(args.tiers)
    except KeyError as err:
        parser.error(str(err.args[0]))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
