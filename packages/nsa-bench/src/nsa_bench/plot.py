"""Milliseconds against sequence length, log-log, for the benches (needs matplotlib:
``nsa-bench[plot]``). Importing this module raises ImportError when matplotlib is missing."""

from __future__ import annotations

from pathlib import Path

# The object API with the Agg canvas: no pyplot state, no display needed.
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def length_label(tokens: int) -> str:
    """8192 -> ``8k``; lengths that are not a multiple of 1024 stay as they are."""
    return f"{tokens >> 10}k" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)


def plot_ms_vs_t(
    series: dict[str, dict[str, list[tuple[int, float]]]], path: Path, title: str
) -> None:
    """Write a PNG with one log-log panel per key of ``series``.

    ``series[panel][label]`` is a list of (T, ms) points: one line per label (e.g. a method and
    mode), points sorted by T. Lines whose label ends in ``fwdbwd`` are dashed, so the two modes
    of one method share a colour and stay apart.
    """
    panels = sorted(series)
    fig = Figure(figsize=(6.5 * max(1, len(panels)), 5.0), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, max(1, len(panels)), squeeze=False)[0]
    methods = sorted({label.split()[0] for lines in series.values() for label in lines})
    colours = {m: f"C{i % 10}" for i, m in enumerate(methods)}
    for ax, panel in zip(axes, panels, strict=False):
        for label in sorted(series[panel]):
            points = sorted(series[panel][label])
            ax.plot(
                [t for t, _ in points],
                [ms for _, ms in points],
                marker="o",
                color=colours[label.split()[0]],
                linestyle="--" if label.endswith("fwdbwd") else "-",
                label=label,
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        lengths = sorted({t for points in series[panel].values() for t, _ in points})
        ax.set_xticks(lengths, [length_label(t) for t in lengths])
        ax.minorticks_off()
        ax.set_xlabel("T (tokens)")
        ax.set_ylabel("ms (median)")
        ax.set_title(panel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    if not panels:
        axes[0].text(0.5, 0.5, "no timed rows", ha="center", va="center")
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
