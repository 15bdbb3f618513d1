"""What a needle run writes and prints: the training and accuracy tables, the heat maps, the
CSV and JSON files, and one report merged from runs that trained the variants apart."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

from nsa_bench.needle.evaluate import Cell
from nsa_bench.needle.model import VARIANTS
from nsa_bench.needle.settings import NeedleSettings
from nsa_bench.sel_stats import SelStats, format_stats_table


def accuracy_table(cells: list[Cell], variants: list[str]) -> str:
    """Markdown: one row per (length, depth), one exact-match column per model."""
    by_key = {(c.variant, c.length, c.depth): c for c in cells}
    keys = sorted({(c.length, c.depth) for c in cells})
    lines = ["| T | depth | " + " | ".join(variants) + " |", "|---|---|" + "---|" * len(variants)]
    for length, depth in keys:
        values = []
        for v in variants:
            cell = by_key.get((v, length, depth))
            values.append("-" if cell is None else f"{cell.exact:.2f}")
        lines.append(f"| {length} | {depth:.2f} | " + " | ".join(values) + " |")
    lines.append("")
    lines.append("| T | " + " | ".join(f"{v} (mean)" for v in variants) + " |")
    lines.append("|---|" + "---|" * len(variants))
    for length in sorted({c.length for c in cells}):
        values = []
        for v in variants:
            found = [c.exact for c in cells if c.variant == v and c.length == length]
            values.append(f"{sum(found) / len(found):.2f}" if found else "-")
        lines.append(f"| {length} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def write_heatmap(cells: list[Cell], variant: str, path: Path) -> str | None:
    """PNG: exact-match accuracy, depth (rows) x length (columns); a note when not written."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        return f"PNG not written: {exc} (install nsa-bench[plot] for matplotlib)"
    mine = [c for c in cells if c.variant == variant]
    lengths = sorted({c.length for c in mine})
    depths = sorted({c.depth for c in mine})
    grid = [[math.nan] * len(lengths) for _ in depths]
    for c in mine:
        grid[depths.index(c.depth)][lengths.index(c.length)] = c.exact
    fig = Figure(figsize=(1.2 * len(lengths) + 2.5, 0.6 * len(depths) + 1.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(t) for t in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            colour = "black" if value > 0.6 else "white"
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", color=colour, fontsize=8)
    ax.set_xlabel("context length T (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(f"passkey exact match: {variant}")
    fig.colorbar(image, ax=ax)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return None


def report(
    notes: list[str],
    cells: list[Cell],
    stats: list[SelStats],
    trained: dict[str, dict[str, Any]],
    variants: list[str],
) -> int:
    """The notes and the failed models on stderr, the tables on stdout; 1 if a model failed."""
    for note in notes:
        print(f"# {note}", file=sys.stderr)
    print(markdown(cells, stats, trained, variants))
    failed = [v for v in variants if "error" in trained.get(v, {})]
    if failed:
        print(f"# failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def markdown(
    cells: list[Cell],
    stats: list[SelStats],
    trained: dict[str, dict[str, Any]],
    variants: list[str],
) -> str:
    parts = [
        "## Training",
        "",
        "| model | steps | seconds | final loss | tokens/s |",
        "|---|---|---|---|---|",
    ]
    for v in variants:
        info = trained.get(v, {})
        if "error" in info:
            parts.append(f"| {v} | failed: {info['error'][:120]} | | | |")
            continue
        parts.append(
            f"| {v} | {info.get('steps', '-')} | {float(info.get('seconds', math.nan)):.1f} | "
            f"{float(info.get('final_loss', math.nan)):.4f} | "
            f"{float(info.get('tokens_per_s', math.nan)):.0f} |"
        )
    if stats:
        parts += ["", "## Selection statistics", "", format_stats_table(stats)]
    parts += ["", "## Passkey exact match", "", accuracy_table(cells, variants)]
    return "\n".join(parts)


def write_outputs(
    out: Path,
    cells: list[Cell],
    stats: list[SelStats],
    trained: dict[str, dict[str, Any]],
    variants: list[str],
    settings: NeedleSettings,
    devices: tuple[str, str],
    routes: str,
) -> list[str]:
    """needle.csv, sel_stats.csv, needle.json, the heat maps and needle.md under ``out``;
    ``devices``: (device, device_name) as :func:`device_names` gives them."""
    notes = []
    columns = [f.name for f in dataclasses.fields(Cell)]
    with open(out / "needle.csv", "w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=columns)
        writer.writeheader()
        writer.writerows(dataclasses.asdict(c) for c in cells)
    if stats:
        with open(out / "sel_stats.csv", "w", newline="") as stream:
            writer = csv.DictWriter(stream, fieldnames=list(stats[0].as_dict()))
            writer.writeheader()
            writer.writerows(s.as_dict() for s in stats)
    record = {
        "device": devices[0],
        "device_name": devices[1],
        "settings": dataclasses.asdict(settings),
        "routing": routes.splitlines(),
        "train": trained,
        "cells": [dataclasses.asdict(c) for c in cells],
        "sel_stats": [s.as_dict() for s in stats],
    }
    (out / "needle.json").write_text(json.dumps(record, indent=1))
    for variant in sorted({c.variant for c in cells}, key=variants.index):
        why_not = write_heatmap(cells, variant, out / f"needle_{variant}.png")
        if why_not:
            notes.append(why_not)
            break
    (out / "needle.md").write_text(markdown(cells, stats, trained, variants) + "\n")
    return notes


def device_names(device: torch.device) -> tuple[str, str]:
    """(device, device_name) as needle.json records them."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return str(device), name


def merge_runs(dirs: list[Path], out: Path) -> int:
    """One report from runs that trained the variants apart (``--variants nsa`` on one GPU,
    ``--variants window`` on another): their needle.json merged, in VARIANTS order.

    The runs must share every setting (the same task, model and seeds), or their accuracies
    would not be comparable; a variant in two runs is refused."""
    records = []
    for d in dirs:
        path = d / "needle.json"
        if not path.is_file():
            raise SystemExit(f"--merge: {path} not found (did that run finish?)")
        records.append(json.loads(path.read_text()))
    settings = records[0]["settings"]
    for d, record in zip(dirs[1:], records[1:], strict=True):
        if record["settings"] != settings:
            changed = sorted(k for k in settings if record["settings"].get(k) != settings[k])
            raise SystemExit(f"--merge: {d} ran with other settings ({', '.join(changed)})")
    trained: dict[str, dict[str, Any]] = {}
    cells: list[Cell] = []
    stats: list[SelStats] = []
    for d, record in zip(dirs, records, strict=True):
        twice = sorted(set(record["train"]) & set(trained))
        if twice:
            raise SystemExit(f"--merge: {d} repeats variants {twice}")
        trained.update(record["train"])
        cells += [Cell(**c) for c in record["cells"]]
        stats += [SelStats(**x) for x in record["sel_stats"]]
    variants = [v for v in VARIANTS if v in trained]
    devices = sorted({(r["device"], r["device_name"]) for r in records})
    device_names = (
        ", ".join(d for d, _ in devices),
        ", ".join(sorted({name for _, name in devices})),
    )
    out.mkdir(parents=True, exist_ok=True)
    notes = write_outputs(
        out,
        cells,
        stats,
        trained,
        variants,
        NeedleSettings(**settings),
        device_names,
        "\n".join(records[0]["routing"]),
    )
    return report(notes, cells, stats, trained, variants)
