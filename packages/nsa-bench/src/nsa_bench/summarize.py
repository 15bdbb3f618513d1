"""``nsa-bench summarize decode.csv``: per-branch shares of a decode step and its reads."""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

from nsa_bench.cli_args import UsageError, existing_file
from nsa_bench.decode_module_bench import CSV_COLUMNS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "csv", type=existing_file, help="a CSV written by `nsa-bench decode-module`"
    )


def check_arguments(args: argparse.Namespace) -> None:
    """The CSV's header holds every column the summary reads (another CSV is refused here)."""
    try:
        with open(args.csv, newline="") as f:
            header = next(csv.reader(f), [])
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"csv: cannot read {args.csv!r} as text: {exc}") from None
    missing = [c for c in CSV_COLUMNS if c not in header]
    if missing:
        raise UsageError(
            f"csv: {args.csv!r} is not a decode-module CSV: no column {', '.join(missing)}"
        )


def run(args: argparse.Namespace) -> int:
    path = Path(args.csv)
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        print(f"{path}: no rows")
        return 1
    dense: dict[int, float] = {}
    sidecar = path.with_suffix(".json")
    if sidecar.exists():
        for row in json.loads(sidecar.read_text()).get("rows", []):
            dense[int(row["S"])] = float(row["ms_dense"])
    print(
        f"{'S':>7} {'total ms':>9} {'cmp %':>6} {'sel %':>6} {'win %':>6} {'other %':>7} "
        f"{'reads':>7} {'formula':>7} {'S/reads':>7} {'dense ms':>9} {'vs dense':>8}"
    )
    for row in rows:
        s = int(row["S"])
        total = float(row["ms_total"])
        parts = [float(row[k]) for k in ("ms_cmp", "ms_sel", "ms_win")]
        shares = [100.0 * p / total for p in parts]
        other = 100.0 - sum(shares)
        reads, formula = int(row["reads_actual"]), int(row["reads_expected"])
        d = dense.get(s)
        dense_cols = f"{d:9.3f} {d / total:7.2f}x" if d is not None else f"{'-':>9} {'-':>8}"
        print(
            f"{s:7d} {total:9.3f} {shares[0]:6.1f} {shares[1]:6.1f} {shares[2]:6.1f} "
            f"{other:7.1f} {reads:7d} {formula:7d} {(s + 1) / reads:7.2f} {dense_cols}"
        )
    print(
        "shares are each branch timed alone over the whole step; 'other' is projections, "
        "cache update and combine (negative when the isolated branches overlap less well)"
    )
    return 0
