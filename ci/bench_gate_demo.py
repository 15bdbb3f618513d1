"""Show that the bench gate passes an unchanged tree and fails a slowed one (GPU host).

    python ci/bench_gate_demo.py [--unchanged 5] [--slowdown 0.10] [--out DIR]

1. Runs ci/bench_gate.py ``--unchanged`` times with this checkout as both base and head: each
   run must pass.
2. Makes a slowed tree: a copy of this checkout's packages whose selected-attention forward
   (nsa_kernels/selected/forward.py) waits on the GPU, after its kernels, for ``--slowdown`` of
   that forward's own time at the gate's 64k row (measured here first, with
   ``torch.cuda._sleep`` calibrated in cycles per ms on this GPU).
3. Runs the gate with this checkout as base and the slowed tree as head: it must fail, on the
   selected forward row.

Prints one line per gate run and a table last; exits 1 unless every run went as it must.
Each gate run's outputs land under ``--out`` (run_1 ... run_N, slowed).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from ci.bench_gate_worker import (  # noqa: E402
    register_kernels,
    row_spec,
    selected_row,
    time_calls,
)

SLOWED_ROW = "selected_attention forward T=65536"
FORWARD = Path("packages/nsa-kernels/src/nsa_kernels/selected/forward.py")
# The end of the selected forward's launch function; the wait goes right before its return.
ANCHOR = "    return o, lse\n\n\ndef check_local("


def forward_ms() -> float:
    """Median ms of the gate's selected forward row on this GPU (this checkout's packages)."""
    import torch

    register_kernels()
    call = selected_row(row_spec(SLOWED_ROW))
    time_calls(call, 2, 1)
    ms = statistics.median(time_calls(call, 10, 1))
    del call
    torch.cuda.empty_cache()
    return ms


def sleep_cycles_per_ms() -> float:
    import torch

    cycles = 10_000_000
    torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]  # loads the kernel
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    torch.cuda._sleep(cycles)  # type: ignore[no-untyped-call]
    end.record()
    torch.cuda.synchronize()
    return cycles / float(start.elapsed_time(end))


def slowed_tree(dest: Path, cycles: int) -> Path:
    """A copy of this checkout's packages with the selected forward's wait added."""
    shutil.rmtree(dest, ignore_errors=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    shutil.copytree(ROOT / "packages", dest / "packages", ignore=ignore)
    path = dest / FORWARD
    text = path.read_text()
    if text.count(ANCHOR) != 1:
        raise SystemExit(f"{FORWARD} no longer ends its forward launch with the expected return")
    wait = f"    torch.cuda._sleep({cycles})  # bench gate demo: a deliberate slowdown\n"
    path.write_text(text.replace(ANCHOR, wait + ANCHOR))
    return dest


def gate(base: Path, head: Path, out: Path) -> tuple[int, float, dict[str, str]]:
    start = time.monotonic()
    cmd = [sys.executable, str(ROOT / "ci" / "bench_gate.py"), "--base", str(base)]
    cmd += ["--head", str(head), "--out", str(out)]
    code = subprocess.run(cmd, check=False).returncode
    rows = json.loads((out / "gate.json").read_text())["rows"] if code in (0, 1) else []
    names = [f"{r['kernel']} {r['mode']} {r['x_name']}={r['x_value']}" for r in rows]
    statuses = {name: r["status"] for name, r in zip(names, rows, strict=True)}
    return code, time.monotonic() - start, statuses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--unchanged", type=int, default=5, help="gate runs on an unchanged tree")
    parser.add_argument("--slowdown", type=float, default=0.10, help="the slowed forward's share")
    parser.add_argument("--out", type=Path, default=ROOT / "artifacts" / "gate_demo")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    print("demo: timing the selected forward at 64k on this checkout", flush=True)
    ms = forward_ms()
    per_ms = sleep_cycles_per_ms()
    cycles = round(args.slowdown * ms * per_ms)
    print(
        f"demo: selected forward at 64k {ms:.3f} ms; torch.cuda._sleep {per_ms:.0f} cycles/ms; "
        f"the slowed tree waits {cycles} cycles ({args.slowdown:.0%}, "
        f"{cycles / per_ms:.3f} ms) after each selected forward",
        flush=True,
    )
    lines = ["| run | head | exit | s | failed rows | as it must |", "|---|---|---:|---:|---|---|"]
    ok = True
    for i in range(1, args.unchanged + 1):
        code, seconds, statuses = gate(ROOT, ROOT, args.out / f"run_{i}")
        failed = [name for name, status in statuses.items() if status == "FAIL"]
        good = code == 0
        ok &= good
        lines.append(f"| {i} | unchanged | {code} | {seconds:.0f} | {', '.join(failed)} | {good} |")
        print(f"demo: unchanged run {i}: exit {code} in {seconds:.0f} s", flush=True)
    slowed = slowed_tree(args.out / "slowed_tree", cycles)
    code, seconds, statuses = gate(ROOT, slowed, args.out / "slowed")
    failed = [name for name, status in statuses.items() if status == "FAIL"]
    good = code == 1 and SLOWED_ROW in failed
    ok &= good
    lines.append(
        f"| {args.unchanged + 1} | selected forward +{args.slowdown:.0%} | {code} | {seconds:.0f} "
        f"| {', '.join(failed)} | {good} |"
    )
    shutil.rmtree(slowed, ignore_errors=True)
    table = "\n".join(lines) + "\n"
    (args.out / "demo.md").write_text(table)
    print(table)
    print("demo: every run went as it must" if ok else "demo: a run did not go as it must")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
