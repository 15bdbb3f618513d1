"""The sanitize part: the sweep plainly and under each compute-sanitizer tool, every run split into
shards started together, and the verdict read back from their logs (the sweep's protocol lines,
the sanitizer's summaries and the kernel each error is in)."""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ci.robustness.children import Child, run_children, visible_gpus
from ci.robustness.common import SCRIPT
from ci.robustness.launches import KERNEL_EXEMPT
from ci.robustness.report import PartResult
from ci.robustness.runtime import environment

# compute-sanitizer's exit status when it found errors (the sweep's own failures exit 1).
SANITIZER_ERROR_EXIT = 86

_ERROR_SUMMARY = re.compile(r"ERROR SUMMARY:\s+(\d+)\s+errors?")
_RACECHECK_SUMMARY = re.compile(
    r"RACECHECK SUMMARY:\s+(\d+)\s+hazards?\s+displayed\s+\((\d+)\s+errors?,\s+(\d+)\s+warnings?\)"
)
_SANITIZER_LINE = re.compile(r"^=+ (\S.*)$")
_NOT_FINDINGS = ("COMPUTE-SANITIZER", "ERROR SUMMARY", "RACECHECK SUMMARY", "LEAK SUMMARY")
_FINDING_KERNEL = re.compile(r"\bat (.+?)\+0x[0-9a-fA-F]+")
_SWEEP_OK = re.compile(r"^SWEEP ok (\S+)")
_SWEEP_FAIL = re.compile(r"^SWEEP FAIL (\S+): (.*)$")
_SWEEP_KERNELS = re.compile(r"^SWEEP kernels (found|launched)=(\S*)$")


@dataclass(frozen=True)
class SweepSummary:
    """What one sweep process printed: cases passed and failed, and (when it ran the whole
    sweep or a shard of it) the kernels it found and those it launched, by qualified name."""

    ok: tuple[str, ...]
    failed: tuple[tuple[str, str], ...]
    found: frozenset[str] | None
    launched: frozenset[str]

    @staticmethod
    def merge(parts: Sequence[SweepSummary]) -> SweepSummary:
        """The summary of a sweep run as shards."""
        founds = [p.found for p in parts if p.found is not None]
        return SweepSummary(
            tuple(n for p in parts for n in p.ok),
            tuple(f for p in parts for f in p.failed),
            frozenset().union(*founds) if founds else None,
            frozenset().union(*(p.launched for p in parts)),
        )

    def missing(self, exempt: Sequence[str] = ()) -> list[str]:
        """Kernels found and never launched, except those whose function name is exempt."""
        if self.found is None:
            return []
        return sorted(k for k in self.found - self.launched if k.rsplit(".", 1)[-1] not in exempt)


def parse_sweep(text: str) -> SweepSummary:
    ok: list[str] = []
    failed: list[tuple[str, str]] = []
    kernels: dict[str, frozenset[str]] = {}
    for line in text.splitlines():
        if m := _SWEEP_OK.match(line):
            ok.append(m.group(1))
        elif m := _SWEEP_FAIL.match(line):
            failed.append((m.group(1), m.group(2)))
        elif m := _SWEEP_KERNELS.match(line):
            kernels[m.group(1)] = frozenset(filter(None, m.group(2).split(",")))
    return SweepSummary(
        tuple(ok), tuple(failed), kernels.get("found"), kernels.get("launched", frozenset())
    )


@dataclass(frozen=True)
class SanitizerSummary:
    """The verdict lines of one compute-sanitizer run.

    ``errors``: the sum of every "ERROR SUMMARY: N errors" line (one per process checked), else
    racecheck's summed "RACECHECK SUMMARY" errors, None when there is neither (the tool did not
    finish); ``race_errors``/``race_warnings``: racecheck's
    "RACECHECK SUMMARY" counts (None for other tools); ``first_finding``: the first report line.
    """

    errors: int | None
    race_errors: int | None
    race_warnings: int | None
    first_finding: str
    kernels: tuple[tuple[str, int], ...] = ()  # (kernel, errors reported in it), by name


def kernel_name(symbol: str) -> str:
    """``fmha_cutlassF_bf16(Params)`` / ``foo<int>`` / ``sel_fwd_kernel`` -> the bare name."""
    return re.split(r"[(<]", symbol, maxsplit=1)[0].strip()


def finding_kernels(text: str) -> Counter[str]:
    """Errors per kernel: each report block that starts with an error line (not a warning, not a
    summary) counts once for the kernel named by its first ``at NAME+0x..`` location."""
    found: Counter[str] = Counter()
    open_block = False
    for line in text.splitlines():
        if not line.startswith("="):
            continue
        if m := _SANITIZER_LINE.match(line):  # a block's first line (details are indented)
            open_block = not m.group(1).startswith((*_NOT_FINDINGS, "Warning"))
        if open_block and (k := _FINDING_KERNEL.search(line)):
            found[kernel_name(k.group(1))] += 1
            open_block = False
    return found


def parse_sanitizer(text: str) -> SanitizerSummary:
    errors = race_errors = race_warnings = None
    first = ""
    for line in text.splitlines():
        if m := _ERROR_SUMMARY.search(line):
            errors = (errors or 0) + int(m.group(1))
        elif m := _RACECHECK_SUMMARY.search(line):
            race_errors = (race_errors or 0) + int(m.group(2))
            race_warnings = (race_warnings or 0) + int(m.group(3))
        elif (
            not first
            and (m := _SANITIZER_LINE.match(line))
            and not m.group(1).startswith(_NOT_FINDINGS)
        ):
            first = m.group(1).strip()
    if errors is None and race_errors is not None:
        # racecheck may end on its own summary alone (it exits with the error code on hazards):
        # that summary is its verdict, and the run finished.
        errors = race_errors
    kernels = tuple(sorted(finding_kernels(text).items()))
    return SanitizerSummary(errors, race_errors, race_warnings, first, kernels)


def find_sanitizer() -> str | None:
    """compute-sanitizer: $COMPUTE_SANITIZER, PATH, then the CUDA toolkit's usual homes."""
    candidates = [os.environ.get("COMPUTE_SANITIZER"), shutil.which("compute-sanitizer")]
    candidates.append("/usr/local/cuda/bin/compute-sanitizer")
    candidates += sorted(glob.glob("/usr/local/cuda-*/bin/compute-sanitizer"), reverse=True)
    for path in candidates:
        if path and os.access(path, os.X_OK):
            return path
    return None


def sanitizer_command(sanitizer: str, tool: str, target: Sequence[str]) -> list[str]:
    """compute-sanitizer running ``target`` under ``tool``; exit SANITIZER_ERROR_EXIT on errors."""
    return [
        sanitizer,
        "--tool",
        tool,
        "--error-exitcode",
        str(SANITIZER_ERROR_EXIT),
        "--print-limit",
        "100",
        *target,
    ]


def _named_counts(counts: Counter[str]) -> str:
    """``name xN`` for each, the name cut to 60 characters."""
    return ", ".join(f"{name[:60]} x{n}" for name, n in counts.most_common())


def tool_verdict(
    tool: str, runs: Sequence[Child], plain: SweepSummary
) -> tuple[str, dict[str, Any], list[str]]:
    """(summary line, details, failures) of one tool over its runs (one per shard)."""
    texts = [c.log_path.read_text(errors="replace") for c in runs]
    found = [parse_sanitizer(t) for t in texts]
    under = SweepSummary.merge([parse_sweep(t) for t in texts])
    finished = all(f.errors is not None for f in found) and not any(c.timed_out for c in runs)
    errors = sum(f.errors or 0 for f in found)
    # Errors inside kernels that are not this project's (torch's SDPA reached through the
    # sliding branch's SDPA route) are reported apart; an error in one of ours, or one the log
    # does not tie to a kernel, fails the part. Without the sweep's list of our kernels (a
    # --case run) every error counts.
    foreign: Counter[str] = Counter()
    if plain.found is not None:
        ours = {name.rsplit(".", 1)[-1] for name in plain.found}
        for f in found:
            for name, count in f.kernels:
                if name not in ours:
                    foreign[name] += count
    own = errors - min(errors, sum(foreign.values()))
    warnings = [f.race_warnings for f in found if f.race_warnings is not None]
    first = next((f.first_finding for f in found if f.first_finding), "")
    codes = sorted({c.returncode for c in runs}, key=lambda code: code == 0)
    wall = max(c.wall_s for c in runs)
    race = f" ({sum(warnings)} race warnings)" if warnings else ""
    ran = len(under.ok) + len(under.failed)
    elsewhere = (
        f" + {sum(foreign.values())} in kernels not ours ({_named_counts(foreign)})"
        if foreign
        else ""
    )
    line = (
        f"{tool} {own if finished else '?'} errors{elsewhere}{race}, exit {codes}, "
        f"sweep {len(under.ok)}/{ran} ok, {wall:.0f} s"
    )
    details = {
        "errors": own if finished else None,
        "errors_in_other_kernels": dict(foreign),
        "race_warnings": sum(warnings) if warnings else None,
        "first_finding": first,
        "exits": [c.returncode for c in runs],
        "timed_out": [c.name for c in runs if c.timed_out],
        "sweep_ok": len(under.ok),
        "sweep_failed": [f"{n}: {w}" for n, w in under.failed],
        "wall_s": round(wall, 1),
        "logs": [c.log_path.name for c in runs],
    }
    failures = []
    if not finished:
        unfinished = [c.log_path.name for c, f in zip(runs, found, strict=True) if f.errors is None]
        failures.append(f"{tool}: did not finish (no ERROR SUMMARY); see {', '.join(unfinished)}")
    # The tool exits with its error code on any error, ours or not: a non-zero exit fails the
    # part unless errors in other kernels account for it and every sweep case passed.
    exit_explained = bool(foreign) and not under.failed
    if own:
        failures.append(f"{tool}: {own} errors; first: {first}")
    elif finished and codes != [0] and not exit_explained:
        failed = [n for n, _ in under.failed]
        failures.append(f"{tool}: exit {codes}; sweep cases failed: {failed}")
    if finished and len(under.ok) != len(plain.ok):
        failures.append(
            f"{tool}: {len(under.ok)} sweep cases passed under the tool, {len(plain.ok)} without"
        )
    return line, details, failures


def run_sanitize(args: argparse.Namespace) -> PartResult:
    """The sweep without the sanitizer (results against the reference, kernel coverage) and
    under each tool, each split into ``--shards`` processes, all started together: Triton
    compiles on the CPU, so the shards compile their kernels side by side (each tool compiles
    the same kernels into the shared cache), and the wall time is about one compile pass of a
    shard plus the slowest tool's shard."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    env = dict(os.environ)
    # One cudaMalloc per tensor: inside the caching allocator's pooled blocks memcheck cannot
    # see an access past a tensor's end.
    env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    target = [sys.executable, str(SCRIPT), "sanitize-target"]
    target += ["--device", args.device] + (["--case", args.case] if args.case else [])
    shards = [[*target, "--shard", f"{i}/{args.shards}"] for i in range(args.shards)]
    sanitizer = find_sanitizer()
    runs: dict[str, list[Child]] = {
        "plain": [
            Child(f"plain {i}", shard, out / f"sanitize_plain_{i}.log", args.plain_timeout)
            for i, shard in enumerate(shards)
        ]
    }
    for tool in args.tools if sanitizer is not None else []:
        assert sanitizer is not None
        runs[tool] = [
            Child(
                f"{tool} {i}",
                sanitizer_command(sanitizer, tool, shard),
                out / f"sanitize_{tool}_{i}.log",
                args.tool_timeout,
            )
            for i, shard in enumerate(shards)
        ]
    children = [c for tool_children in runs.values() for c in tool_children]
    run_children(children, env, "sanitize", visible_gpus(args.device, env))

    plain = runs.pop("plain")
    sweep = SweepSummary.merge([parse_sweep(c.log_path.read_text(errors="replace")) for c in plain])
    missing = sweep.missing(sorted(KERNEL_EXEMPT))
    total = "?" if sweep.found is None else len(sweep.found)
    details: dict[str, Any] = {
        "sweep_cases": len(sweep.ok) + len(sweep.failed),
        "kernels": f"{len(sweep.launched)} of {total} kernels launched",
        "shards": args.shards,
    }
    failures = [f"sweep {name}: {why}" for name, why in sweep.failed]
    if missing:
        failures.append(f"kernels the sweep never launched: {', '.join(missing)}")
    for child in plain:
        if child.timed_out or (child.returncode != 0 and not sweep.failed):
            timeout = " (timeout)" if child.timed_out else ""
            failures.append(
                f"{child.name}: exit {child.returncode}{timeout}; see {child.log_path.name}"
            )
    if sanitizer is None:
        failures.append("compute-sanitizer not found ($COMPUTE_SANITIZER, PATH, /usr/local/cuda*)")
    else:
        details["sanitizer"] = sanitizer
    lines = []
    for tool, children in runs.items():
        line, tool_details, tool_failures = tool_verdict(tool, children, sweep)
        lines.append(line)
        details[tool] = tool_details
        failures += tool_failures
    details["tools"] = lines
    counts = "; ".join(line.split(", exit")[0] for line in lines) or "no sanitizer run"
    headline = (
        f"{counts}; sweep {len(sweep.ok)}/{details['sweep_cases']} cases ok, {details['kernels']}"
    )
    status = "FAIL" if failures else "PASS"
    wall = time.perf_counter() - start
    return PartResult("sanitize", status, headline, wall, details, failures, environment())
