"""Result files the benches share: flat records of dataclass rows, CSV + JSON writers, cells.

Rows are dataclasses; the layer and cp benches' rows also carry an ``env`` dict of ``env_*``
columns (see :mod:`nsa_bench.env`) that is spread into the record after the row's own columns.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any


def blank_nan(value: Any) -> Any:
    """A missing number (NaN or inf) as an empty cell; every other value as it is.

    The others keep full precision, so ratios recomputed from the files equal the written ones.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return ""
    return value


def finite_or_dash(value: float, spec: str) -> str:
    """``value`` formatted with ``spec`` for a Markdown table, ``-`` when it is not finite."""
    return format(value, spec) if math.isfinite(value) else "-"


def env_columns(row_columns: Sequence[str], rows: Sequence[Any]) -> list[str]:
    """``row_columns``, then every ``env_*`` key of any row's ``env`` dict, sorted."""
    env_keys = sorted({k for row in rows for k in row.env})
    return [*row_columns, *env_keys]


def env_records(row_columns: Sequence[str], rows: Sequence[Any]) -> list[dict[str, Any]]:
    """One flat dict per dataclass row with an ``env`` dict, keys in :func:`env_columns` order.

    Non-finite floats become empty cells; a key a row lacks is empty too (CSV and JSON share it).
    """
    keys = env_columns(row_columns, rows)
    out = []
    for row in rows:
        flat = {k: blank_nan(v) for k, v in asdict(row).items() if k != "env"}
        flat.update(row.env)
        out.append({k: flat.get(k, "") for k in keys})
    return out


def write_csv(path: Path, columns: Sequence[str], records: Iterable[Mapping[str, Any]]) -> None:
    """``records`` as a CSV file at ``path`` with a header of ``columns`` (folders created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns))
        writer.writeheader()
        writer.writerows(records)


def write_env_tables(
    row_columns: Sequence[str], rows: Sequence[Any], out: Path, stem: str
) -> tuple[Path, Path]:
    """``<stem>.csv`` and ``<stem>.json`` under ``out``: one schema, missing numbers empty."""
    csv_path, json_path = out / f"{stem}.csv", out / f"{stem}.json"
    recs = env_records(row_columns, rows)
    write_csv(csv_path, env_columns(row_columns, rows), recs)
    with json_path.open("w") as f:
        json.dump(recs, f, indent=1)
    return csv_path, json_path


def write_dataclass_csv(path: Path, rows: Sequence[Any]) -> None:
    """Dataclass ``rows`` as a CSV file, one column per field; nothing is written without rows."""
    if rows:
        write_csv(path, list(asdict(rows[0])), (asdict(r) for r in rows))
