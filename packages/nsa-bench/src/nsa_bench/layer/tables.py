"""The layer bench's closing Markdown: the methods with their ratios, where the core's time goes
step by step, and the rows without a time with their reasons."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from nsa_bench.layer.rows import COMPILED_METHODS, METHODS, MODES, PEERS, Row
from nsa_bench.layer.steps import STEPS
from nsa_bench.tables import finite_or_dash


def _ms(row: Row | None) -> str:
    if row is None:
        return "-"
    if not row.ok:
        return row.status.split(":", 1)[0]
    return f"{row.ms:.3f}"


def _fmt(value: float, spec: str = ".3f") -> str:
    return finite_or_dash(value, spec)


def methods_table(rows: Sequence[Row]) -> list[str]:
    """One line per (head dims, mode, T): every method's ms, nsa_core's ratios and memory."""
    if not rows:
        return []
    first = rows[0]
    hidden = max(r.hidden_size for r in rows)
    lines = [
        f"### NSA layer: {first.dtype}, B={first.B}, HQ={first.HQ}, H={first.H}, "
        f"l={first.cmp_block}, d={first.cmp_stride}, l'={first.sel_block}, "
        f"n={first.num_selected}, w={first.window}"
        + (f"; nsa_module at hidden size {hidden}" if hidden else ""),
        "",
        "Medians in ms; `core vs X` is X's ms over nsa_core's (> 1: NSA is faster); "
        "`X_compiled vs eager` is X's eager ms over its compiled ms (> 1: compiled is faster).",
        "",
        "| dk/dv | mode | T | "
        + " | ".join(f"{m} ms" for m in METHODS)
        + " | core vs fla | core vs sdpa | core vs fa2 | core peak MiB | "
        + " | ".join(f"{m} vs eager" for m in COMPILED_METHODS)
        + " |",
        "|---|---|---:|" + "---:|" * (len(METHODS) + 4 + len(COMPILED_METHODS)),
    ]
    by_case: dict[tuple[Any, ...], dict[str, Row]] = {}
    for r in rows:
        by_case.setdefault(r.case_key(), {})[r.method] = r
    for key in sorted(by_case, key=lambda k: (k[4], k[5], MODES.index(k[6]), k[7])):
        case = by_case[key]
        core = case.get("nsa_core")
        cells = [_ms(case.get(m)) for m in METHODS]
        if core is None:
            cells += ["-"] * (len(PEERS) + 1)
        else:
            cells += [_fmt(getattr(core, f"vs_{p}"), ".2f") for p in PEERS]
            cells.append(_fmt(core.peak_mib, ".0f"))
        for m in COMPILED_METHODS:
            compiled = case.get(m)
            cells.append("-" if compiled is None else _fmt(compiled.vs_eager, ".3f"))
        lines.append(f"| {key[4]}/{key[5]} | {key[6]} | {key[7]} | " + " | ".join(cells) + " |")
    return lines


def steps_table(step_rows: Sequence[Row], method_rows: Sequence[Row]) -> list[str]:
    """One line per (head dims, mode, T): each step's ms, share of the core and backend.

    Steps timed with a pinned backend (``step@backend``) follow the sum, outside it.
    """
    if not step_rows:
        return []
    steps = [s for s, _ in STEPS]
    pinned = sorted({r.step for r in step_rows if "@" in r.step})
    lines = [
        "### Where the core's time goes: ms (share of nsa_core) backend",
        "",
        "Each step timed alone through its public op; fwdbwd: its forward and backward "
        "(select_blocks takes no gradient: forward).",
        "",
        "| dk/dv | mode | T | nsa_core ms | "
        + " | ".join(steps)
        + " | steps sum | other |"
        + "".join(f" {p} |" for p in pinned),
        "|---|---|---:|---:|" + "---|" * len(steps) + "---:|---:|" + "---|" * len(pinned),
    ]
    by_case: dict[tuple[Any, ...], dict[str, Row]] = {}
    for row in step_rows:
        by_case.setdefault(row.case_key(), {})[row.step] = row
    core_rows = {r.case_key(): r for r in method_rows if r.method == "nsa_core"}

    def cell(timed: Row) -> str:
        share = f" ({100 * timed.share:.0f}%)" if math.isfinite(timed.share) else ""
        # The table names the backend; the CSV keeps the full routing text.
        return f"{timed.ms:.3f}{share} {timed.backend.split(' (')[0]}"

    for key in sorted(by_case, key=lambda k: (k[4], k[5], MODES.index(k[6]), k[7])):
        case = by_case[key]
        cells = []
        total = 0.0
        for step in steps:
            timed = case.get(step)
            if timed is None or not timed.ok:
                cells.append(_ms(timed))
                total = math.nan
                continue
            total += timed.ms
            cells.append(cell(timed))
        extra = [cell(t) if t is not None and t.ok else _ms(t) for t in map(case.get, pinned)]
        core = core_rows.get(key)
        core_ms = core.ms if core is not None and core.ok else math.nan
        lines.append(
            f"| {key[4]}/{key[5]} | {key[6]} | {key[7]} | {_ms(core)} | "
            + " | ".join(cells)
            + f" | {_fmt(total)} | {_fmt(core_ms - total)} |"
            + "".join(f" {c} |" for c in extra)
        )
    return lines


def failures(rows: Sequence[Row]) -> list[str]:
    """Every row without a time: one line per (method or step, reason) with the cases it hit."""
    groups: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        if not r.ok:
            what = r.method + (f"/{r.step}" if r.step else "")
            groups.setdefault((what, r.status), []).append(f"{r.dk}/{r.dv} {r.mode} T={r.T}")
    lines = [
        f"- {what}: {status} ({len(cases)} case{'s' * (len(cases) > 1)}: {', '.join(cases)})"
        for (what, status), cases in groups.items()
    ]
    return ["### Rows without a time", "", *lines] if lines else []


def markdown(rows: Sequence[Row]) -> str:
    """The closing tables: the methods with their ratios, where the core forward's time goes,
    and the rows that did not run with their reasons."""
    method_rows = [r for r in rows if r.kind == "method"]
    step_rows = [r for r in rows if r.kind == "step"]
    parts = [methods_table(method_rows), steps_table(step_rows, method_rows), failures(rows)]
    return "\n\n".join("\n".join(p) for p in parts if p)
