"""The torch x triton version table as CI sees it: read from the package, never copied.

The one table lives in ``packages/nsa-kernels/src/nsa_kernels/version_table.py`` because the
runtime pairing check (:mod:`nsa_kernels.pairing`) needs it from an installed wheel. It is a plain
Python data module, so this file reads it with :func:`runpy.run_path` (no import of the package,
no torch, any Python >= 3.10, no third-party parser). noxfile.py, the workflows and
``check_pairing.py`` all go through this module.

It also writes what the table implies for nsa-kernels' pyproject.toml: the base requirement
(``triton>=3.0,<3.10``: the tritons the table supports) and one extra per supported torch minor,
``nsa-kernels[torch2-13]``: that torch and the triton its Linux wheel pins. The extras are
generated into the file (between two marker comments) and ``nox -s lint`` fails when they drift.

Command line (used by the workflows and by people)::

    python3 ci/cells.py list                      # one line per cell
    python3 ci/cells.py constraints 2.7           # pip constraints that install cell 2.7
    python3 ci/cells.py gpu-matrix --labels JSON  # GitHub Actions matrix for the GPU workflow
    python3 ci/cells.py extras --check            # pyproject's extras match the table (--write)
"""

from __future__ import annotations

import argparse
import json
import re
import runpy
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TABLE = ROOT / "packages" / "nsa-kernels" / "src" / "nsa_kernels" / "version_table.py"
KERNELS_PYPROJECT = ROOT / "packages" / "nsa-kernels" / "pyproject.toml"

# The CPU cell: its torch release is the one CPU CI installs (a CPU wheel; any other torch release
# would be a multi-GB CUDA download on a CPU machine).
CPU_CELL = "2.13"
CPU_TORCH = "2.13.0"
# The interpreter tier also runs, next to the CPU cell's torch, under the triton of the oldest
# and of the newest cell it can: the interpreter does not use torch's triton, so these two runs
# check the kernels against the oldest and newest Triton language that CPU CI can install.
# Oldest: torch 2.8's triton 3.4. The 3.3 interpreter has no tensor descriptors (the forced-TMA
# tests need them) and 3.0-3.2's corrupt memory in the interpreter's native loads and stores
# next to torch 2.13's CPU build ("free(): invalid next size").
OLDEST_INTERPRETER_CELL = "2.8"
# The interpreter of triton < 3.7 calls int() on one-element arrays, which numpy 2.4 refuses.
NUMPY_BELOW_FOR_OLD_INTERPRETER = ("2.4", (3, 7))

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


def triton_minor(c: dict[str, Any]) -> tuple[int, int]:
    major, minor = c["triton"].split(".")[:2]
    return int(major), int(minor)


def constraints(
    c: dict[str, Any], release: str | None = None, torch_release: str | None = None
) -> str:
    """pip constraints for one torch release of the cell (its newest by default) and its triton.

    ``torch_release`` installs another torch beside the cell's triton (the interpreter checks on
    CPU). numpy is bounded where the cell's triton interpreter needs an older one.
    """
    release = release or newest_release(c)
    if release not in c["releases"]:
        raise KeyError(f"torch {release} is not a release of cell {c['torch']}")
    lines = [f"torch=={torch_release or release}", f"triton{c['releases'][release]}"]
    numpy_below, fixed_in = NUMPY_BELOW_FOR_OLD_INTERPRETER
    if triton_minor(c) < fixed_in:
        lines.append(f"numpy<{numpy_below}")
    return "\n".join(lines) + "\n"


def interpreter_cells() -> list[dict[str, Any]]:
    """The cells whose triton the interpreter tier runs under next to the CPU cell's torch."""
    return [cell(OLDEST_INTERPRETER_CELL), supported()[-1]]


def triton_matches(version: str | None, c: dict[str, Any]) -> bool:
    """Whether a triton version's release satisfies the cell's pin (``3.6.0``, ``3.3.x``)."""
    m = re.match(r"\d+(?:\.\d+)*", version or "")
    if m is None:
        return False
    release = _key(m[0])
    pin = c["triton"]
    want = _key(pin.removesuffix(".x"))
    if pin.endswith(".x"):
        return release[: len(want)] == want
    width = max(len(want), len(release))
    return release + (0,) * (width - len(release)) == want + (0,) * (width - len(want))


def triton_requirement(c: dict[str, Any]) -> str:
    """The cell's pin as a requirement: ``triton==3.7.1``, or ``triton>=3.3,<3.4`` for 3.3.x."""
    if c["triton"].endswith(".x"):
        major, minor = triton_minor(c)
        return f"triton>={major}.{minor},<{major}.{minor + 1}"
    return f"triton=={c['triton']}"


def _next_minor(version: str) -> str:
    major, minor = (int(p) for p in version.split(".")[:2])
    return f"{major}.{minor + 1}"


def base_requirements() -> list[str]:
    """nsa-kernels' own dependencies: the supported torch and the supported tritons."""
    cells = supported()
    tritons = sorted(triton_minor(c) for c in cells)
    low, high = tritons[0], tritons[-1]
    return [
        "nsa-core",
        f"torch>={cells[0]['torch']}",
        f"triton>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}",
    ]


def extras() -> dict[str, list[str]]:
    """One extra per supported cell, ``torch2-13``: that torch minor and the triton it pins.

    The name is PEP 685's normal form (pip before 24 does not normalise ``torch2.13``).
    """
    return {
        f"torch{c['torch'].replace('.', '-')}": [
            f"torch>={c['torch']},<{_next_minor(c['torch'])}",
            triton_requirement(c),
        ]
        for c in supported()
    }


_EXTRAS_BEGIN = "# torch extras: begin (written by `python3 ci/cells.py extras --write`)"
_EXTRAS_END = "# torch extras: end"


def _toml_list(items: Sequence[str]) -> str:
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


def render_pyproject(text: str) -> str:
    """``text`` (nsa-kernels' pyproject.toml) with its dependencies and extras from the table."""
    deps = re.compile(r"^dependencies = \[.*\]$", re.MULTILINE)
    if len(deps.findall(text)) != 1:
        raise ValueError("expected one one-line `dependencies = [...]` in the pyproject")
    text = deps.sub(lambda _: f"dependencies = {_toml_list(base_requirements())}", text)
    begin, end = text.find(_EXTRAS_BEGIN), text.find(_EXTRAS_END)
    if begin < 0 or end < begin:
        raise ValueError(f"the pyproject needs the lines {_EXTRAS_BEGIN!r} ... {_EXTRAS_END!r}")
    body = "".join(f"{name} = {_toml_list(reqs)}\n" for name, reqs in extras().items())
    return text[: begin + len(_EXTRAS_BEGIN)] + "\n" + body + text[end:]


def gpu_matrix(labels: Sequence[str]) -> dict[str, list[dict[str, str]]]:
    """GitHub Actions ``strategy.matrix`` for the GPU workflow, chosen by the PR's labels.

    ``gpu-ci-full`` (a push to main passes it too): every supported cell on every GPU, each
    running ``nox -s gpu_parity-<minor>``. ``gpu-ci``: the oldest and the newest supported cell
    on every GPU (the two ends of the range catch most API drift at a sixth of the cost), each
    running ``nox -s gpu_quick-<minor>``. Neither label: no job.
    """
    cells = supported()
    if LABEL_FULL in labels:
        chosen, session = cells, "gpu_parity"
    elif LABEL_QUICK in labels:
        chosen, session = ([cells[0], cells[-1]] if len(cells) > 1 else cells), "gpu_quick"
    else:
        chosen, session = [], ""
    include = [
        {
            "gpu": gpu,
            "torch": c["torch"],
            "triton": c["triton"],
            "python": default_python(c),
            "session": f"{session}-{c['torch']}",
        }
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
    p_ext = sub.add_parser("extras", help="nsa-kernels' torch extras from the table")
    mode = p_ext.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="fail if the pyproject differs")
    mode.add_argument("--write", action="store_true", help="rewrite the pyproject's block")
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
    elif args.command == "extras" and (args.check or args.write):
        current = KERNELS_PYPROJECT.read_text()
        wanted = render_pyproject(current)
        if args.write:
            KERNELS_PYPROJECT.write_text(wanted)
            print(f"wrote {KERNELS_PYPROJECT.relative_to(ROOT)}")
        elif wanted != current:
            print(
                f"{KERNELS_PYPROJECT.relative_to(ROOT)}: dependencies or torch extras differ from "
                "the version table; run `python3 ci/cells.py extras --write`",
                file=sys.stderr,
            )
            return 1
        else:
            print(f"{KERNELS_PYPROJECT.relative_to(ROOT)}: extras match the version table")
    elif args.command == "extras":
        print(f"dependencies = {_toml_list(base_requirements())}")
        for name, reqs in extras().items():
            print(f"{name} = {_toml_list(reqs)}")
    else:
        labels = json.loads(args.labels)
        if not isinstance(labels, list):
            parser.error("--labels must be a JSON list")
        print(json.dumps(gpu_matrix([str(label) for label in labels]), separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
