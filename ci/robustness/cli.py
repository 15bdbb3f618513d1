"""The command line: one sub-command per part, plus the sweep the sanitizer runs, the parity plan
and the report (``python ci/gpu_robustness.py --help``)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import ci.robustness
from ci.robustness.children import parse_shard
from ci.robustness.common import BOUNDS, DEFAULT_OUT, PARTS
from ci.robustness.long import run_long
from ci.robustness.parity import run_parity
from ci.robustness.plan import (
    DEFAULT_CASES,
    DEFAULT_SEED,
    GPU_LIMITS,
    describe_plan,
    limits_for,
    make_plan,
)
from ci.robustness.report import summary_lines, write_part, write_report
from ci.robustness.sanitize import run_sanitize
from ci.robustness.sweep import run_sweep

# The first paragraph of the package's docstring: what the whole check is.
DESCRIPTION = (ci.robustness.__doc__ or "").split("\n\n")[0]


def _add_common(p: argparse.ArgumentParser, device: bool = True) -> None:
    p.add_argument(
        "--out", default=DEFAULT_OUT, help=f"folder for the JSON and logs (default {DEFAULT_OUT})"
    )
    if device:
        p.add_argument(
            "--device",
            default="cuda",
            choices=("cuda", "cpu"),
            help="cpu: tiny shapes under TRITON_INTERPRET=1",
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "sanitize", help="the kernel sweep under compute-sanitizer memcheck and racecheck"
    )
    _add_common(p)
    p.add_argument("--case", default=None, help="only the sweep cases whose name contains this")
    p.add_argument("--shards", type=int, default=3, help="processes per tool (and without one)")
    p.add_argument(
        "--tools",
        nargs="+",
        default=["memcheck", "racecheck"],
        choices=("memcheck", "racecheck", "synccheck", "initcheck"),
    )
    p.add_argument(
        "--plain-timeout",
        type=float,
        default=300.0,
        help="seconds for the sweep without the sanitizer",
    )
    p.add_argument(
        "--tool-timeout", type=float, default=420.0, help="seconds for each sanitizer run"
    )

    p = sub.add_parser("sanitize-target", help="the sweep itself (run by the sanitizer)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--shard", default="0/1", help="I/N: run the I-th of N slices of the sweep")
    p.add_argument("--case", default=None, help="run only the sweep cases whose name contains this")

    p = sub.add_parser("long", help="T = 128k, 256k: selected branch and attention core")
    _add_common(p)
    p.add_argument("--lengths", default="128k,256k", help="sequence lengths (k = 1024)")
    p.add_argument("--hq", type=int, default=64)
    p.add_argument("--h", type=int, default=4)
    p.add_argument("--dim", type=int, default=128, help="dk = dv")
    p.add_argument("--dtype", default="bfloat16", choices=tuple(BOUNDS))
    p.add_argument(
        "--rows", type=int, default=64, help="sampled rows checked against the reference"
    )
    p.add_argument(
        "--pieces", nargs="+", default=["selected", "core"], choices=("selected", "core")
    )

    p = sub.add_parser("parity", help="random cases, every GPU backend against the reference")
    _add_common(p)
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--cases", type=int, default=DEFAULT_CASES)
    p.add_argument("--case", type=int, default=None, help="replay only case N of the seed")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="processes, each owning whole geometries (default: one per geometry; 1 on cpu)",
    )
    p.add_argument("--shard", default=None, help=argparse.SUPPRESS)  # I/N: one worker's share
    p.add_argument(
        "--dtype", nargs="+", default=None, choices=tuple(BOUNDS), help="only these dtypes"
    )
    p.add_argument(
        "--flex-geometries",
        type=int,
        default=2,
        help="geometries on which compiled FlexAttention runs (each compiles)",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=0.0,
        help="stop (and fail) after this many seconds; 0: none",
    )

    p = sub.add_parser("plan", help="print the parity cases of a seed")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--cases", type=int, default=DEFAULT_CASES)
    p.add_argument(
        "--device", default="cuda", choices=("cuda", "cpu"), help="the limits of that device"
    )

    p = sub.add_parser("report", help="merge the parts' JSON into report.json and report.md")
    _add_common(p, device=False)
    p.add_argument("--sections", default=" ".join(PARTS), help="the parts that were asked for")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "plan":
        print(describe_plan(make_plan(args.seed, args.cases, limits_for(args.device))))
        return 0
    if args.command == "sanitize-target":
        return run_sweep(args.device, args.case, parse_shard(args.shard))
    if args.command == "report":
        return write_report(Path(args.out), args.sections.split())
    if args.command == "parity" and args.workers is None:
        args.workers = GPU_LIMITS.geometries if args.device == "cuda" else 1
    runners = {"sanitize": run_sanitize, "long": run_long, "parity": run_parity}
    result = runners[args.command](args)
    write_part(Path(args.out), result)
    if not result.part.startswith("parity_shard"):  # a worker's share has no verdict of its own
        print("\n".join(summary_lines([result])))
    return 0 if result.status == "PASS" else 1
