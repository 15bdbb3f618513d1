"""Every way to lint, type-check, test and package nsa (docs/ci.md explains each session).

Plain ``nox`` runs lint, typecheck and tests. The torch x triton cells come from the version table
(nsa_kernels/version_table.py via ci/cells.py): ``interp-<minor>`` (interpreter tier on CPU) and
``gpu_parity-<minor>`` (GPU tiers) for each supported torch minor. ``NSA_NOX_SYSTEM_PACKAGES=1``
runs the test sessions with the packages of the interpreter running nox, on a host with no index.
Arguments after ``--`` go to pytest (test sessions) or to the tool (lint, typecheck, pairing).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import nox

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from ci import cells  # noqa: E402  (needs ROOT on sys.path)

PACKAGES = ("nsa-core", "nsa-kernels", "nsa-bench")
SRC_DIRS = tuple(f"packages/{p}/src" for p in PACKAGES)

# The CPU CI cell: this torch release and the triton its wheel pins (read from the table).
CPU_CELL = "2.13"
CPU_TORCH = "2.13.0"

# Linters are pinned so that a new release cannot turn CI red on unchanged code.
RUFF = "ruff==0.17.6"
MYPY = "mypy==2.4.1"

GPU_MARKERS = "gpu or fa2 or cuda or slow"

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.reuse_venv = "yes"


def _system_packages() -> bool:
    raw = os.environ.get("NSA_NOX_SYSTEM_PACKAGES", "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise SystemExit(f"NSA_NOX_SYSTEM_PACKAGES={raw!r} is not a boolean (use 1 or 0)")


SYSTEM = _system_packages()


def _constraints(session: nox.Session, cell: dict[str, Any], release: str | None = None) -> str:
    path = Path(session.create_tmp()) / f"constraints-torch-{cell['torch']}.txt"
    path.write_text(cells.constraints(cell, release))
    session.log(f"constraints for cell {cell['torch']}: {path.read_text().strip()!r}")
    return str(path)


def _install_project(
    session: nox.Session, cell: dict[str, Any], release: str | None = None
) -> None:
    """torch + triton of ``cell`` and the three packages (editable) with their test extras."""
    # Triton's interpreter (TRITON_INTERPRET=1) imports numpy, which triton does not declare.
    session.install(
        "-c",
        _constraints(session, cell, release),
        "torch",
        "triton",
        "numpy",
        "-e",
        "packages/nsa-core[test]",
        "-e",
        "packages/nsa-kernels[test]",
        "-e",
        "packages/nsa-bench",
    )


_NOT_SOURCE = ("build", "dist", "*.egg-info", "__pycache__", ".pytest_cache")


def _source_copies(session: nox.Session) -> list[str]:
    """Clean copies of the three packages' sources to build from.

    setuptools keeps a build/ folder in the source tree it builds, and files left there by an
    earlier build would end up in the next one; building copies keeps the checkout clean too.
    """
    root = Path(session.create_tmp()) / "src"
    shutil.rmtree(root, ignore_errors=True)
    ignore = shutil.ignore_patterns(*_NOT_SOURCE)
    for name in PACKAGES:
        shutil.copytree(ROOT / "packages" / name, root / name, ignore=ignore)
    return [str(root / name) for name in PACKAGES]


def _build_offline(session: nox.Session) -> dict[str, str]:
    """System mode: the three packages built without an index into a folder put on PYTHONPATH."""
    site = Path(session.create_tmp()) / "site"
    shutil.rmtree(site, ignore_errors=True)
    session.run(
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-index",
        "--no-deps",
        "--no-build-isolation",
        "--upgrade",
        "--target",
        str(site),
        *_source_copies(session),
        external=True,
    )
    path = os.pathsep.join(x for x in (str(site), os.environ.get("PYTHONPATH", "")) if x)
    return {"PYTHONPATH": path}


_PROBE = """
import json, torch
from nsa_kernels.pairing import installed_pairing
try:
    import triton.language
    language = None
except Exception as err:
    language = f"{type(err).__name__}: {err}"
p = installed_pairing()
found = {**p.__dict__, "cuda": torch.cuda.is_available(), "triton_language": language}
print("NSA-PAIRING " + json.dumps(found))
"""


def _check_pairing(
    session: nox.Session,
    python: str,
    env: dict[str, str],
    cell: dict[str, Any] | None,
    need_gpu: bool = False,
) -> None:
    """Fail unless ``python`` imports a paired torch/triton (of ``cell``, when given)."""
    out = session.run(python, "-c", _PROBE, env=env, silent=True, external=True)
    lines = [x for x in str(out).splitlines() if x.startswith("NSA-PAIRING ")]
    if not lines:
        session.error(f"could not read torch/triton of {python}:\n{out}")
    found = json.loads(lines[-1].removeprefix("NSA-PAIRING "))
    session.log(f"torch {found['torch']}, triton {found['triton']}: {found['reason']}")
    if found["verdict"] != "paired":
        session.error(f"torch/triton are not paired: {found['verdict']}: {found['reason']}")
    if found["triton_language"]:
        # The Triton tests would all skip: a tier that silently runs nothing must not pass.
        mode = " with TRITON_INTERPRET=1" if env.get("TRITON_INTERPRET") else ""
        session.error(f"import triton.language{mode} fails: {found['triton_language']}")
    if cell is not None and found["cell"] != cell["torch"]:
        session.error(
            f"this session is cell torch {cell['torch']} (triton {cell['triton']}), but "
            f"{python} has torch {found['torch']}; run the session of its cell, "
            f"gpu_parity-{found['cell']} / interp-{found['cell']}"
        )
    if need_gpu and not found["cuda"]:
        session.error("this session runs the GPU tiers, and torch sees no CUDA GPU here")


def _prepare(
    session: nox.Session,
    cell: dict[str, Any] | None,
    release: str | None = None,
    *,
    need_gpu: bool = False,
    interpret: bool = False,
) -> tuple[list[str], dict[str, str]]:
    """Install (or, in system mode, check) the cell; returns the pytest command and its env.

    ``interpret``: the run uses Triton's CPU interpreter (``TRITON_INTERPRET=1``, also set while
    probing, since the interpreter needs more than compiled Triton does).
    """
    env = {"TRITON_INTERPRET": "1"} if interpret else {}
    if SYSTEM:
        env.update(_build_offline(session))
        python = sys.executable
    else:
        _install_project(session, cell or cells.cell(CPU_CELL), release)
        python = "python"
    _check_pairing(session, python, env, cell, need_gpu)
    return [python, "-m", "pytest"], env


def _pytest(session: nox.Session, cmd: list[str], env: dict[str, str], *args: str) -> None:
    # pytest's exit code 5 (no test collected) fails the session like any other: a tier that
    # selects nothing is a broken tier, never a pass.
    session.run(*cmd, *args, *session.posargs, env=env, external=SYSTEM)


_TEST_BACKEND = "none" if SYSTEM else None


@nox.session(python=None, tags=["ci"])
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check over the whole repository."""
    session.install(RUFF)
    session.run("ruff", "check", ".", *session.posargs)
    session.run("ruff", "format", "--check", ".")


@nox.session(python=None, tags=["ci"])
def typecheck(session: nox.Session) -> None:
    """mypy over the three packages' sources, noxfile.py and ci/ (strict for nsa-core)."""
    constraints = _constraints(session, cells.cell(CPU_CELL), CPU_TORCH)
    session.install(MYPY, "nox", "packaging", "-c", constraints, "torch")
    session.run("mypy", *SRC_DIRS, "noxfile.py", "ci", *session.posargs)


@nox.session(python=None, venv_backend=_TEST_BACKEND, tags=["ci"])
def tests(session: nox.Session) -> None:
    """Reference and interpreter tiers on CPU (torch 2.13.0, triton 3.7.1, TRITON_INTERPRET=1)."""
    cell = None if SYSTEM else cells.cell(CPU_CELL)
    cmd, env = _prepare(session, cell, CPU_TORCH, interpret=True)
    _pytest(session, cmd, env, "-n", "2")


def _pair_text(cell: dict[str, Any]) -> str:
    release = cells.newest_release(cell)
    return f"torch=={release} triton{cell['releases'][release]}"


def _interp_session(cell: dict[str, Any]) -> None:
    def session_fn(session: nox.Session) -> None:
        cmd, env = _prepare(session, cell, interpret=True)
        _pytest(session, cmd, env, "-m", "triton", "-n", "2")

    session_fn.__doc__ = (
        f"Interpreter tier on CPU, {_pair_text(cell)}: -m triton, TRITON_INTERPRET=1."
    )
    nox.session(
        name=f"interp-{cell['torch']}",
        python=None if SYSTEM else cells.default_python(cell),
        venv_backend=_TEST_BACKEND,
        tags=["interp"],
        default=False,
    )(session_fn)


def _gpu_session(cell: dict[str, Any]) -> None:
    def session_fn(session: nox.Session) -> None:
        cmd, env = _prepare(session, cell, need_gpu=True)
        _pytest(session, cmd, env, "-m", GPU_MARKERS, "--run-slow")

    session_fn.__doc__ = f"GPU tiers, {_pair_text(cell)}: -m '{GPU_MARKERS}' --run-slow."
    nox.session(
        name=f"gpu_parity-{cell['torch']}",
        python=None if SYSTEM else cells.default_python(cell),
        venv_backend=_TEST_BACKEND,
        tags=["gpu"],
        default=False,
    )(session_fn)


for _cell in cells.supported():
    _interp_session(_cell)
    _gpu_session(_cell)


@nox.session(python=None, default=False)
def pairing(session: nox.Session) -> None:
    """Re-derive the version table from PyPI's torch metadata (no wheel downloads); fail on drift.

    ``nox -s pairing -- --every-wheel`` reads every Python's wheel instead of one per release.
    """
    session.install("packaging", "pip>=24")
    session.run("python", "ci/check_pairing.py", *session.posargs)


# Every module must import with the package's declared dependencies; only the optional extras
# (flash_attn, fla) may be missing, and the modules that need them are listed.
_IMPORT_ALL = """
import importlib, pkgutil, sys
name = sys.argv[1]
pkg = importlib.import_module(name)
mods = [m.name for m in pkgutil.walk_packages(pkg.__path__, name + ".")]
optional = []
for mod in mods:
    try:
        importlib.import_module(mod)
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] not in ("flash_attn", "fla"):
            raise
        optional.append(f"{mod} (needs {err.name})")
print(f"imported {name} and {len(mods) - len(optional)} of {len(mods)} submodules")
for line in optional:
    print("  optional extra missing:", line)
"""

_CORE_ALONE = """
import importlib.util as u
for absent in ("triton", "nsa_kernels", "nsa_bench"):
    assert u.find_spec(absent) is None, f"{absent} came along with nsa-core"
print("nsa-core installed alone: no triton, nsa_kernels or nsa_bench")
"""

_KERNELS_CHECK = """
from importlib.metadata import entry_points
from nsa_kernels.pairing import installed_pairing
eps = [ep for ep in entry_points(group="nsa.backends") if ep.name == "nsa_kernels"]
assert eps, "the nsa.backends entry point of nsa-kernels is not installed"
eps[0].load()
print("entry point nsa.backends:nsa_kernels loads;", installed_pairing())
"""

_BENCH_CHECK = """
from nsa_bench.env import collect
row = collect()
assert row["pairing"] == "paired", row
print("nsa_bench.env.collect():", row)
"""


@nox.session(python=None, default=False)
def packages(session: nox.Session) -> None:
    """Build each package's wheel, install each alone in a fresh venv (nsa-core: no triton)."""
    tmp = Path(session.create_tmp())
    dist = tmp / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    for src in _source_copies(session):
        session.run("python", "-m", "pip", "wheel", "--no-deps", "-w", str(dist), src)
    wheels = {name: next(dist.glob(name.replace("-", "_") + "-*.whl")) for name in PACKAGES}
    constraints = _constraints(session, cells.cell(CPU_CELL), CPU_TORCH)

    # Each package with the wheels of the packages it needs, never fetched by name: an unrelated
    # project of the same name on an index must not stand in for ours.
    needs = {
        "nsa-core": ["nsa-core"],
        "nsa-kernels": ["nsa-kernels", "nsa-core"],
        "nsa-bench": ["nsa-bench", "nsa-kernels", "nsa-core"],
    }
    for name, files in needs.items():
        venv = tmp / f"venv-{name}"
        session.run("python", "-m", "venv", "--clear", str(venv))
        py = str(venv / "bin" / "python")
        session.run(
            py, "-m", "pip", "install", "--quiet", "-c", constraints,
            *(str(wheels[f]) for f in files), external=True,
        )  # fmt: skip
        module = name.replace("-", "_")
        session.run(py, "-c", _IMPORT_ALL, module, external=True)
        if name == "nsa-core":
            session.run(py, "-c", _CORE_ALONE, external=True)
        elif name == "nsa-kernels":
            session.run(py, "-c", _KERNELS_CHECK, external=True)
        else:
            session.run(str(venv / "bin" / "nsa-bench"), "--help", external=True, silent=True)
            session.run(py, "-c", _BENCH_CHECK, external=True)


# The GPU-host runner one-shot (ci/runner.sh) may add a ``runner`` session here; it can reuse
# ``_prepare(session, cells.cell(minor), need_gpu=True)`` to get a paired, checked environment.
