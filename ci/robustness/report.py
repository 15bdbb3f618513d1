"""The parts' results: what each part writes to ``<part>.json``, and the report that merges them
into ``report.json``, ``report.md`` and the summary printed last."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class PartResult:
    """What one part writes to ``<part>.json``: PASS/FAIL, one headline, details, failures."""

    part: str
    status: str
    headline: str
    wall_s: float
    details: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PartResult:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def missing_part(part: str) -> PartResult:
    return PartResult(
        part,
        "FAIL",
        f"no result: the part did not finish (timed out or crashed); see {part}.log",
        0.0,
    )


def load_parts(out: Path, sections: Sequence[str]) -> list[PartResult]:
    results = []
    for part in sections:
        path = out / f"{part}.json"
        if not path.is_file():
            results.append(missing_part(part))
            continue
        try:
            results.append(PartResult.from_json(json.loads(path.read_text())))
        except (ValueError, TypeError) as exc:
            results.append(PartResult(part, "FAIL", f"unreadable {path.name}: {exc}", 0.0))
    return results


def summary_lines(results: Sequence[PartResult]) -> list[str]:
    """The table printed last: one line per part, then the verdict."""
    lines = [f"{'part':<9} {'result':<6} {'time':>7}  what"]
    for r in results:
        lines.append(f"{r.part:<9} {r.status:<6} {r.wall_s:>6.0f}s  {r.headline}")
        lines += [f"{'':<26}- {failure}" for failure in r.failures[:5]]
        if len(r.failures) > 5:
            lines.append(f"{'':<26}  ... {len(r.failures) - 5} more in {r.part}.json")
    failed = [r.part for r in results if r.status != "PASS"]
    lines.append(f"GPU robustness: {'FAIL (' + ', '.join(failed) + ')' if failed else 'PASS'}")
    return lines


def markdown_report(results: Sequence[PartResult]) -> str:
    env = next((r.env for r in results if r.env), {})
    lines = ["# GPU robustness", ""]
    if env:
        lines += [", ".join(f"{k} {v}" for k, v in env.items()), ""]
    lines += ["| part | result | time | what |", "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.part} | {r.status} | {r.wall_s:.0f} s | {r.headline} |")
    for r in results:
        lines += ["", f"## {r.part}: {r.status}", "", r.headline]
        if r.failures:
            lines += ["", "Failures:", ""] + [f"- {f}" for f in r.failures]
        for key, value in r.details.items():
            if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
                lines += ["", f"{key}:", "", "```", *value, "```"]
            elif isinstance(value, (str, int, float)):
                lines.append(f"- {key}: {value}")
    return "\n".join(lines) + "\n"


def write_part(out: Path, result: PartResult) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{result.part}.json").write_text(json.dumps(result.to_json(), indent=2) + "\n")


def write_report(out: Path, sections: Sequence[str]) -> int:
    """Merge the parts asked for into ``report.json`` and ``report.md`` and print the summary;
    0 when every part passed, else 1."""
    results = load_parts(out, sections)
    (out / "report.json").write_text(json.dumps([r.to_json() for r in results], indent=2) + "\n")
    (out / "report.md").write_text(markdown_report(results))
    print("\n".join(summary_lines(results)))
    return 0 if all(r.status == "PASS" for r in results) else 1
