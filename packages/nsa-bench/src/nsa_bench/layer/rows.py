"""The layer bench's rows: their schema (one for the CSV, the JSON and the tables), the shape
that fills a row's problem columns, the ratios between rows of one case, and the files.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from nsa_bench.cases import Shape, row_columns
from nsa_bench.cli_args import block_geometry, blocks_config
from nsa_bench.tables import write_env_tables
from nsa_core import NSAConfig

NSA_METHODS = ("nsa_core", "nsa_module")
# The NSA methods under torch.compile(fullgraph=True), each timed beside its eager twin.
COMPILED_METHODS = tuple(f"{m}_compiled" for m in NSA_METHODS)
PEERS = ("fla", "sdpa", "fa2")
METHODS = NSA_METHODS + PEERS + COMPILED_METHODS
DEFAULT_METHODS = NSA_METHODS + PEERS
MODES = ("fwd", "fwdbwd")


@dataclass
class Row:
    """One timed (case, method) or (case, step of the core forward).

    ``kind`` is ``method`` or ``step``; ``step`` is empty for methods. ``share``: a step's ms
    over the core forward's ms. ``vs_<peer>``: the peer's ms over this row's ms, same case.
    ``vs_eager`` (compiled methods): the eager twin's ms over this row's ms, same case.
    """

    kind: str
    method: str
    step: str
    mode: str
    dtype: str
    B: int
    T: int
    HQ: int
    H: int
    G: int
    dk: int
    dv: int
    cmp_block: int
    cmp_stride: int
    sel_block: int
    num_selected: int
    window: int
    hidden_size: int = 0
    ms: float = math.nan
    peak_mib: float = math.nan
    work_mib: float = math.nan
    share: float = math.nan
    vs_fla: float = math.nan
    vs_sdpa: float = math.nan
    vs_fa2: float = math.nan
    vs_eager: float = math.nan
    backend: str = ""
    status: str = "ok"
    note: str = ""
    env: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok" and math.isfinite(self.ms)

    def case_key(self) -> tuple[str, int, int, int, int, int, str, int]:
        """Rows with equal keys ran the same problem and are compared with each other."""
        return (self.dtype, self.B, self.HQ, self.H, self.dk, self.dv, self.mode, self.T)


ROW_COLUMNS = row_columns(Row)


@dataclass(frozen=True)
class LayerShape(Shape):
    """A :class:`~nsa_bench.cases.Shape` with the NSA block geometry: l, d, l', n and w."""

    cmp_block: int
    cmp_stride: int
    sel_block: int
    num_selected: int
    window: int

    def config(self) -> NSAConfig:
        heads = (self.num_q_heads, self.num_kv_heads)
        return blocks_config(self, heads, (self.head_dim_qk, self.head_dim_v))

    def row(self, kind: str, method: str, mode: str, step: str = "", **extra: Any) -> Row:
        """A row of this shape, its measurements still to come (``extra`` sets any column)."""
        problem = {**self.columns(), **block_geometry(self)}
        return Row(kind=kind, method=method, step=step, mode=mode, **problem, **extra)


def add_ratios(rows: Sequence[Row]) -> None:
    """Fill ``vs_<peer>`` of method rows and ``share`` of step rows from rows of the same case."""
    by_case: dict[tuple[Any, ...], dict[str, Row]] = {}
    for row in rows:
        if row.kind == "method":
            by_case.setdefault(row.case_key(), {})[row.method] = row
    for case in by_case.values():
        for row in case.values():
            for peer in PEERS:
                other = case.get(peer)
                ratio = math.nan
                if row.ok and other is not None and other.ok and row.ms > 0:
                    ratio = other.ms / row.ms
                setattr(row, f"vs_{peer}", ratio)
            if row.method in COMPILED_METHODS:
                eager = case.get(row.method.removesuffix("_compiled"))
                if row.ok and eager is not None and eager.ok and row.ms > 0:
                    row.vs_eager = eager.ms / row.ms
    for row in rows:
        if row.kind != "step":
            continue
        core = by_case.get(row.case_key(), {}).get("nsa_core")  # same mode
        ok = row.ok and core is not None and core.ok and core.ms > 0
        row.share = row.ms / core.ms if ok and core is not None else math.nan


def write_tables(rows: Sequence[Row], out: Path) -> tuple[Path, Path]:
    """layer.csv and layer.json under ``out`` (one schema; missing numbers are empty)."""
    return write_env_tables(ROW_COLUMNS, rows, out, "layer")


def read_rows(path: Path) -> list[Row]:
    """Rows of a ``layer.csv`` written by :func:`write_tables` (``env_*`` columns kept)."""
    types = {f.name: f.type for f in fields(Row)}
    rows = []
    with path.open(newline="") as f:
        for rec in csv.DictReader(f):
            values: dict[str, Any] = {}
            env = {}
            for key, text in rec.items():
                if key.startswith("env_"):
                    env[key] = text
                elif key in types:
                    kind = types[key]
                    if kind == "int":
                        values[key] = int(text)
                    elif kind == "float":
                        values[key] = float(text) if text != "" else math.nan
                    else:
                        values[key] = text
            rows.append(Row(**values, env=env))
    return rows
