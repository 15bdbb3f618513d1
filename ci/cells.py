"""The torch x triton version table as CI sees it: read from the package, never copied.

The one table lives in ``packages/nsa-kernels/src/nsa_kernels/version_table.py`` because the
runtime pairing check (:mod:`nsa_kernels.pairing`) needs it from an installed wheel. It is a plain
Python data module, so this file reads it with :func:`runpy.run_path` (no import of the package,
no torch, any Python >= 3.10, no third-party parser). noxfile.py, the workflows and
``check_pairing.py`` all go through this module.

Command line (used by the workflows and by people)::

    python3 ci/cells.py list                      # one line per cell
    python3 ci/cells.py constraints 2.7           # pip constraints that install cell 2.7
    python3 ci/cells.py gpu-matrix --labels JSON  # GitHub Actions matrix for the GPU workflow
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "packages" / "nsa-kernels" / "src" / "nsa_kernels" / "version_table.py"

# The GPU host runs 3.12 and every supported cell has 3.12 wheels that pull triton; a cell without
# it falls back to its newest such Python the project supports.
PREFERRED_PYTHON = "3.12"
PROJECT_MIN_PYTHON = (3, 10)

# Self-hosted runner labels of the GPU machines (declared in .github/actionlint.yaml too).
GPUS = ("rtx4090", "a100", "h100")
# PR labels that start the GPU workflow: the quick set, or every supported cell on every GPU.
LABEL_QUICK = "gpu-ci"
LABEL_FULL = "gpu-ci-full"


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def load() -> list[dict[str, Any]]:
    """Every cell of the table, oldest torch minor first."""
    cells: Sequence[dict[str, Any]] = runpy.run_path(str(TABLE))["CELLS"]
    return sorted((dict(c) for c in cells), key=lambda c: _key(c["torch"]))


def cell(minor: str) -> dict[str, Any]:
    for c in load():
        if c["torch"] == minor:
            return c
    known = ", ".join(c["torch"] for c in load())
    raise KeyError(f"torch {minor} is not in the version table ({known})")


def supported() -> list[dict[str, Any]]:
    return [c for c in load() if c["supported"]]


def default_python(c: dict[str, Any]) -> str:
    """The Python a cell's sessions and GPU jobs use: one where its torch wheel brings triton."""
    usable = [p for p in c["triton_pythons"] if _key(p) >= PROJECT_MIN_PYTHON]
    if not usable:
        raise ValueError(f"torch {c['torch']}: no Python >= 3.10 gets triton with its wheel")
    return PREFERRED_PYTHON if PREFERRED_PYTHON in usable else str(max(usable, key=_key))


def newest_release(c: dict[str, Any]) -> str:
    return str(max(c["releases"], key=_key))


def constraints(c: dict[str, Any], release: str | None = None) -> str:
    """pip constraints for one torch release of the cell (its newest by default) and its triton."""
    release = release or newest_release(c)
    if release not in c["releases"]:
        raise KeyError(f"torch {release} is not a release of cell {c['torch']}")
    return f"torch=={release}\ntriton{c['releases'][release]}\n"


def gpu_matrix(labels: Sequence[str]) -> dict[str, list[dict[str, str]]]:
    """GitHub Actions ``strategy.matrix`` for the GPU workflow, chosen by the PR's labels.

    ``gpu-ci-full``: every supported cell on every GPU. ``gpu-ci``: the oldest and the newest
    supported cell on every GPU (the two ends of the range catch most API drift at a sixth of the
    cost). Neither label: no job.
    """
    cells = supported()
    if LABEL_FULL in labels:
        chosen = cells
    elif LABEL_QUICK in labels:
        chosen = [cells[0], cells[-1]] if len(cells) > 1 else cells
    else:
        chosen = []
    include = [
        {"gpu": gpu, "torch": c["torch"], "triton": c["triton"], "python": default_python(c)}
        for gpu in GPUS
        for c in chosen
    ]
    return {"include": include}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Read the torch x triton version table.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="one line per cell")
    p_con = sub.add_parser("constraints", help="pip constraints of one cell")
    p_con.add_argument("minor", help="torch minor, e.g. 2.7")
    p_con.add_argument("--release", help="torch release of the cell (default: its newest)")
    p_mat = sub.add_parser("gpu-matrix", help="GitHub Actions matrix JSON for gpu.yml")
    p_mat.add_argument("--labels", default="[]", help="JSON list of the PR's label names")
    args = parser.parse_args(argv)

    if args.command == "list":
        for c in load():
            mark = "supported" if c["supported"] else "not supported"
            pys = c["triton_pythons"]
            print(
                f"torch {c['torch']:<5} triton {c['triton']:<6} "
                f"pythons {pys[0]}-{pys[-1]:<5} {mark}: {c['why']}"
            )
    elif args.command == "constraints":
        sys.stdout.write(constraints(cell(args.minor), args.release))
    else:
        labels = json.loads(args.labels)
        if not isinstance(labels, list):
            parser.error("--labels must be a JSON list")
        print(json.dumps(gpu_matrix([str(label) for label in labels]), separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
