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

CELLS: tuple[Cell, ...] = (
    {
        "torch": "2.2",
        "triton": "2.2.0",
        "releases": {"2.2.0": "==2.2.0", "2.2.1": "==2.2.0", "2.2.2": "==2.2.0"},
        "pythons": ("3.8", "3.9", "3.10", "3.11", "3.12"),
        "triton_pythons": ("3.8", "3.9", "3.10", "3.11"),
        "supported": False,
        "why": _TRITON2,
    },
    {
        "torch": "2.3",
        "triton": "2.3.x",
        "releases": {"2.3.0": "==2.3.0", "2.3.1": "==2.3.1"},
        "pythons": ("3.8", "3.9", "3.10", "3.11", "3.12"),
        "triton_pythons": ("3.8", "3.9", "3.10", "3.11"),
        "supported": False,
        "why": _TRITON2,
    },
    {
        "torch": "2.4",
        "triton": "3.0.0",
        "releases": {"2.4.0": "==3.0.0", "2.4.1": "==3.0.0"},
        "pythons": ("3.8", "3.9", "3.10", "3.11", "3.12"),
        "triton_pythons": ("3.8", "3.9", "3.10", "3.11", "3.12"),
        "supported": True,
        "why": _TRITON3 + " (the oldest supported cell)",
    },
    {
        "torch": "2.5",
        "triton": "3.1.0",
        "releases": {"2.5.0": "==3.1.0", "2.5.1": "==3.1.0"},
        "pythons": ("3.9", "3.10", "3.11", "3.12", "3.13"),
        "triton_pythons": ("3.9", "3.10", "3.11", "3.12"),
        "supported": True,
        "why": _TRITON3 + "; on Python 3.13 the wheel brings no triton",
    },
    {
        "torch": "2.6",
        "triton": "3.2.0",
        "releases": {"2.6.0": "==3.2.0"},
        "pythons": ("3.9", "3.10", "3.11", "3.12", "3.13"),
        "triton_pythons": ("3.9", "3.10", "3.11", "3.12", "3.13"),
        "supported": True,
        "why": _TRITON3,
    },
    {
        "torch": "2.7",
        "triton": "3.3.x",
        "releases": {"2.7.0": "==3.3.0", "2.7.1": "==3.3.1"},
        "pythons": ("3.9", "3.10", "3.11", "3.12", "3.13"),
        "triton_pythons": ("3.9", "3.10", "3.11", "3.12", "3.13"),
        "supported": True,
        "why": _TRITON3,
    },
    {
        "torch": "2.8",
        "triton": "3.4.0",
        "releases": {"2.8.0": "==3.4.0"},
        "pythons": ("3.9", "3.10", "3.11", "3.12", "3.13"),
        "triton_pythons": ("3.9", "3.10", "3.11", "3.12", "3.13"),
        "supported": True,
        "why": _TRITON3,
    },
    {
        "torch": "2.9",
        "triton": "3.5.x",
        "releases": {"2.9.0": "==3.5.0", "2.9.1": "==3.5.1"},
        "pythons": ("3.10", "3.11", "3.12", "3.13", "3.14"),
        "triton_pythons": ("3.10", "3.11", "3.12", "3.13", "3.14"),
        "supported": True,
        "why": _TRITON3,
    },
    {
        "torch": "2.10",
        "triton": "3.6.0",
        "releases": {"2.10.0": "==3.6.0"},
        "pythons": ("3.10", "3.11", "3.12", "3.13", "3.14"),
        "triton_pythons": ("3.10", "3.11", "3.12", "3.13", "3.14"),
        "supported": True,
        "why": _TRITON3,
    },
    {
        "torch": "2.11",
        "triton": "3.6.0",
        "releases": {"2.11.0": "==3.6.0"},
        "pythons": ("3.10", "3.11", "3.12", "3.13", "3.14"),
        "triton_pythons": ("3.10", "3.11", "3.12", "3.13", "3.14"),
        "supported": True,
        "why": _TRITON3 + " (the GPU host's stack)",
    },
    {
        "torch": "2.12",
        "triton": "3.7.x",
        "releases": {"2.12.0": "==3.7.0", "2.12.1": "==3.7.1"},
        "pythons": ("3.10", "3.11", "3.12", "3.13", "3.14"),
        "triton_pythons": ("3.10", "3.11", "3.12", "3.13", "3.14"),
        "supported": True,
        "why": _TRITON3,
    },
    {
        "torch": "2.13",
        "triton": "3.7.1",
        "releases": {"2.13.0": "==3.7.1"},
        "pythons": ("3.10", "3.11", "3.12", "3.13", "3.14"),
        "triton_pythons": ("3.10", "3.11", "3.12", "3.13", "3.14"),
        "supported": True,
        "why": _TRITON3 + " (the CPU CI cell)",
    },
    {
        "torch": "2.14",
        "triton": "3.8.x",
        "releases": {"2.14.0": "~=3.8.0", "2.14.1": "~=3.8.0"},
        "pythons": ("3.10", "3.11", "3.12", "3.13", "3.14"),
        "triton_pythons": ("3.10", "3.11", "3.12", "3.13", "3.14"),
        "supported": True,
        "why": _TRITON3,
    },
    {
        "torch": "2.15",
        "triton": "3.9.x",
        "releases": {"2.15.0": "~=3.9.0"},
        "pythons": ("3.11", "3.12", "3.13", "3.14", "3.15"),
        "triton_pythons": ("3.11", "3.12", "3.13", "3.14", "3.15"),
        "supported": True,
        "why": _TRITON3 + "; needs Python >= 3.11",
    },
)
