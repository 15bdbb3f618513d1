"""The layer bench's PNG: ms against T, log-log, one line per method and mode, one panel per
head-dim pair (needs matplotlib, ``nsa-bench[plot]``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from nsa_bench.layer.rows import Row


def write_plot(rows: Sequence[Row], path: Path) -> str | None:
    """layer.png, or why it was not written."""
    try:
        from nsa_bench.plot import plot_ms_vs_t
    except ImportError as exc:
        return f"PNG not written: {exc} (install nsa-bench[plot] for matplotlib)"
    series: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for r in rows:
        if r.kind == "method" and r.ok:
            panel = f"dk/dv = {r.dk}/{r.dv}"
            series.setdefault(panel, {}).setdefault(f"{r.method} {r.mode}", []).append((r.T, r.ms))
    first = next((r for r in rows if r.kind == "method"), None)
    title = "NSA layer vs peers"
    if first is not None:
        title += f" ({first.dtype}, HQ={first.HQ}, H={first.H}, B={first.B})"
    plot_ms_vs_t(series, path, title)
    return None
