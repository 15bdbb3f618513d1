"""The torch x triton version table: the one source of truth for pairing, nox and CI.

Each cell is one torch minor. ``releases`` maps every final torch release of that minor to the
triton specifier its Linux x86_64 manylinux wheel on PyPI requires (``Requires-Dist: triton==X;
platform_system == "Linux" ...``); ``triton`` is the cell's pin in one pattern: an exact version
when every release pins the same one, else ``"X.Y.x"`` (any patch of triton X.Y). ``pythons`` are
the CPython versions for which every release has such a wheel; ``triton_pythons`` the subset on
which that wheel also pulls triton (older wheels carry a ``python_version <`` marker).
``supported`` says whether the project tests the cell, ``why`` says why or why not.

Pure data, no imports beyond typing: CI reads this file without importing the package
(``ci/cells.py``). ``nox -s pairing`` re-derives every field but ``supported``/``why`` from PyPI
and fails on drift; it was last run on the date in ``CHECKED``. nsa-kernels' triton requirement
and its ``torch2-<minor>`` extras (one per supported cell) are written from this table by
``python3 ci/cells.py extras --write``.
"""

from __future__ import annotations

from typing import TypedDict


class Cell(TypedDict):
    torch: str
    triton: str
    releases: dict[str, str]
    pythons: tuple[str, ...]
    triton_pythons: tuple[str, ...]
    supported: bool
    why: str


CHECKED = "2026-11-22"

# The kernels are written for the Triton 3 language and tested only there.
KERNELS_MIN_TRITON = (3, 0)

_TRITON2 = "pins triton 2.x; the kernels need triton >= 3.0 and are not tested on 2.x"
_TRITON3 = "pins triton 3.x, which the kernels target"
_TRITON3_NOT_ON_313 = _TRITON3 + "; on Python 3.13 the wheel brings no triton"

# Each torch release's triton pin, by torch minor.
_RELEASES = {
    "2.2": {"2.2.0": "==2.2.0", "2.2.1": "==2.2.0", "2.2.2": "==2.2.0"},
    "2.3": {"2.3.0": "==2.3.0", "2.3.1": "==2.3.1"},
    "2.4": {"2.4.0": "==3.0.0", "2.4.1": "==3.0.0"},
    "2.5": {"2.5.0": "==3.1.0", "2.5.1": "==3.1.0"},
    "2.6": {"2.6.0": "==3.2.0"},
    "2.7": {"2.7.0": "==3.3.0", "2.7.1": "==3.3.1"},
    "2.8": {"2.8.0": "==3.4.0"},
    "2.9": {"2.9.0": "==3.5.0", "2.9.1": "==3.5.1"},
    "2.10": {"2.10.0": "==3.6.0"},
    "2.11": {"2.11.0": "==3.6.0"},
    "2.12": {"2.12.0": "==3.7.0", "2.12.1": "==3.7.1"},
    "2.13": {"2.13.0": "==3.7.1"},
    "2.14": {"2.14.0": "~=3.8.0", "2.14.1": "~=3.8.0"},
    "2.15": {"2.15.0": "~=3.9.0"},
}


def _pythons(span: str) -> tuple[str, ...]:
    """Every CPython minor of a span: "3.8-3.11" -> ("3.8", "3.9", "3.10", "3.11")."""
    first, last = (version.split(".") for version in span.split("-"))
    return tuple(f"{first[0]}.{minor}" for minor in range(int(first[1]), int(last[1]) + 1))


def _cell(
    torch: str, triton: str, pythons: str, triton_pythons: str, supported: bool, why: str
) -> Cell:
    """One row of the table as a Cell: the Pythons from their spans, the releases' pins from
    ``_RELEASES``."""
    return {
        "torch": torch,
        "triton": triton,
        "releases": _RELEASES[torch],
        "pythons": _pythons(pythons),
        "triton_pythons": _pythons(triton_pythons),
        "supported": supported,
        "why": why,
    }


# One cell a row: torch minor, triton pattern, Pythons, Pythons that get triton, supported, why.
CELLS: tuple[Cell, ...] = (
    _cell("2.2", "2.2.0", "3.8-3.12", "3.8-3.11", False, _TRITON2),
    _cell("2.3", "2.3.x", "3.8-3.12", "3.8-3.11", False, _TRITON2),
    _cell("2.4", "3.0.0", "3.8-3.12", "3.8-3.12", True, _TRITON3 + " (the oldest supported cell)"),
    _cell("2.5", "3.1.0", "3.9-3.13", "3.9-3.12", True, _TRITON3_NOT_ON_313),
    _cell("2.6", "3.2.0", "3.9-3.13", "3.9-3.13", True, _TRITON3),
    _cell("2.7", "3.3.x", "3.9-3.13", "3.9-3.13", True, _TRITON3),
    _cell("2.8", "3.4.0", "3.9-3.13", "3.9-3.13", True, _TRITON3),
    _cell("2.9", "3.5.x", "3.10-3.14", "3.10-3.14", True, _TRITON3),
    _cell("2.10", "3.6.0", "3.10-3.14", "3.10-3.14", True, _TRITON3),
    _cell("2.11", "3.6.0", "3.10-3.14", "3.10-3.14", True, _TRITON3 + " (the GPU host's stack)"),
    _cell("2.12", "3.7.x", "3.10-3.14", "3.10-3.14", True, _TRITON3),
    _cell("2.13", "3.7.1", "3.10-3.14", "3.10-3.14", True, _TRITON3 + " (the CPU CI cell)"),
    _cell("2.14", "3.8.x", "3.10-3.14", "3.10-3.14", True, _TRITON3),
    _cell("2.15", "3.9.x", "3.11-3.15", "3.11-3.15", True, _TRITON3 + "; needs Python >= 3.11"),
)
