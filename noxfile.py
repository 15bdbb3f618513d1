"""Lint, type-check, test and package nsa.

``nox`` alone runs lint, typecheck and tests (the CPU test tiers with torch 2.13 and its triton).
Each supported torch minor of the version table has ``interp-<minor>`` (the Triton interpreter
tier on CPU) and ``gpu_parity-<minor>`` (the GPU tiers); ``interp_triton-<triton minor>`` runs the
interpreter tier with the CPU torch and the oldest or newest triton. Arguments after ``--`` go to
pytest or to the tool. On a host with no package index, ``NSA_NOX_SYSTEM_PACKAGES=1`` tests the
packages of the Python that runs nox. docs/ci.md describes every session.
"""

from __future__ import annotations

import json
import os
import runpy
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import nox
from nox.command import CommandFailed

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
from ci import cells, gpu_workers, tiers  # noqa: E402  (needs ROOT on sys.path)

PACKAGES = ("nsa-core", "nsa-kernels", "nsa-bench")
SRC_DIRS = tuple(f"packages/{p}/src" for p in PACKAGES)

# Linters are pinned so that a new release cannot turn CI red on unchanged code.
RUFF = "ruff==0.17.6"
MYPY = "mypy==2.4.1"

# The transformers releases nsa_core.hf supports, read from its one table (a stdlib-only module).
_HF_VERSIONS = runpy.run_path(str(ROOT / "packages/nsa-core/src/nsa_core/hf/versions.py"))
TRANSFORMERS = "transformers" + _HF_VERSIONS["supported_text"]()

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


def _constraints_file(session: nox.Session, name: str, text: str) -> str:
    path = Path(session.create_tmp()) / f"constraints-{name}.txt"
    path.write_text(text)
    session.log(f"constraints: {' '.join(text.split())}")
    return str(path)


def _install_project(session: nox.Session, constraints: str) -> None:
    """torch + triton as ``constraints`` pin them and the three packages (editable), with tests
    and nsa-core's Hugging Face extra (its tests are in the reference tier)."""
    session.log("installing torch, triton and the three packages (a minute or more)")
    # Triton's interpreter (TRITON_INTERPRET=1) imports numpy, which triton does not declare.
    session.install(
        "--progress-bar",
        "off",
        "-c",
        constraints,
        "torch",
        "triton",
        "numpy",
        "-e",
        "packages/nsa-core[test,hf]",
        "-e",
        "packages/nsa-kernels[test]",
        "-e",
        "packages/nsa-bench",
        silent=False,
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


def _probe(session: nox.Session, python: str, env: dict[str, str]) -> dict[str, Any]:
    out = session.run(python, "-c", _PROBE, env=env, silent=True, external=True)
    lines = [x for x in str(out).splitlines() if x.startswith("NSA-PAIRING ")]
    if not lines:
        session.error(f"could not read torch/triton of {python}:\n{out}")
    found: dict[str, Any] = json.loads(lines[-1].removeprefix("NSA-PAIRING "))
    session.log(f"torch {found['torch']}, triton {found['triton']}: {found['verdict']}")
    if found["triton_language"]:
        # The Triton tests would all skip: a tier that silently runs nothing must not pass.
        mode = " with TRITON_INTERPRET=1" if env.get("TRITON_INTERPRET") else ""
        session.error(f"import triton.language{mode} fails: {found['triton_language']}")
    return found


def _check_cell(
    session: nox.Session, found: dict[str, Any], cell: dict[str, Any] | None, need_gpu: bool
) -> None:
    """Fail unless torch/triton are paired (and are ``cell``, when given)."""
    session.log(found["reason"])
    if found["verdict"] != "paired":
        session.error(f"torch/triton are not paired: {found['verdict']}: {found['reason']}")
    if cell is not None and found["cell"] != cell["torch"]:
        session.error(
            f"this session is cell torch {cell['torch']} (triton {cell['triton']}), but the "
            f"Python has torch {found['torch']}; run the session of its cell, "
            f"gpu_parity-{found['cell']} / interp-{found['cell']}"
        )
    if need_gpu and not found["cuda"]:
        session.error("this session runs the GPU tiers, and torch sees no CUDA GPU here")


def _python_and_env(session: nox.Session, constraints: str | None) -> tuple[str, dict[str, str]]:
    """Install from ``constraints`` (or, in system mode, build offline); the Python to test."""
    if SYSTEM:
        return sys.executable, _build_offline(session)
    assert constraints is not None
    _install_project(session, constraints)
    return "python", {}


def _run_tiers(
    session: nox.Session,
    python: str,
    base_env: dict[str, str],
    selected: Sequence[tiers.Tier],
    workers: Sequence[str] = (),
    compile_for: Sequence[int] = (),
) -> None:
    """Each tier as its own pytest run with its environment; fail after all ran if any failed.

    ``workers``: pytest arguments of the tiers the table marks parallel (``-n N`` and, on a GPU
    host, ``--worker-gpus``). pytest's exit code 5 (no test collected) fails a tier like any
    other: a tier that selects nothing is a broken tier, never a pass. ``compile_for``: CUDA
    architectures (x10) for which every Triton launch of the interpreter tier is then compiled
    (ci/compile_triton.py). Each tier's wall time is logged, and the table of them at the end.
    """
    failed: list[str] = []
    times: list[str] = []
    launches = Path(session.create_tmp()) / "triton-launches"
    recorded = False
    for i, tier in enumerate(selected):
        args = tier.pytest_args()
        if tier.parallel:
            args += list(workers)
        if compile_for and tier.records_launches:
            shutil.rmtree(launches, ignore_errors=True)
            args += ["--record-triton-launches", str(launches)]
            recorded = True
        session.log(f"[tier {i + 1}/{len(selected)}] {tier.name}: {tier.title}")
        start = time.monotonic()
        status = "ok"
        try:
            session.run(
                python,
                "-m",
                "pytest",
                *args,
                *session.posargs,
                env={**base_env, **tier.env},
                external=SYSTEM,
            )
        except CommandFailed:
            failed.append(tier.name)
            status = "FAILED"
        times.append(f"{tier.name}: {status} in {time.monotonic() - start:.0f} s")
        session.log(f"[tier {i + 1}/{len(selected)}] {times[-1]}")
    if recorded and not failed:
        archs = [a for arch in compile_for for a in ("--arch", str(arch))]
        session.log("[compile] the interpreter tier's Triton launches, compiled for the GPU")
        try:
            session.run(python, "ci/compile_triton.py", str(launches), *archs, external=SYSTEM)
        except CommandFailed:
            failed.append("triton-compile")
    session.log("tiers: " + "; ".join(times))
    if failed:
        session.error(f"tiers failed: {', '.join(failed)}")


_TEST_BACKEND = "none" if SYSTEM else None


@nox.session(python=None, tags=["ci"])
def lint(session: nox.Session) -> None:
    """ruff check, ruff format --check, and nsa-kernels' torch extras against the version table."""
    session.install(RUFF)
    session.run("ruff", "check", ".", *session.posargs)
    session.run("ruff", "format", "--check", ".")
    session.run("python", "ci/cells.py", "extras", "--check")


@nox.session(python=None, tags=["ci"])
def typecheck(session: nox.Session) -> None:
    """mypy over the three packages' sources, noxfile.py and ci/ (strict for nsa-core)."""
    constraints = cells.constraints(cells.cell(cells.CPU_CELL), cells.CPU_TORCH)
    session.log("installing mypy, nox, pytest and torch (a minute or more)")
    session.install(
        "--progress-bar",
        "off",
        MYPY,
        "nox",
        "packaging",
        "pytest",  # ci/triton_launches.py is a pytest plugin
        TRANSFORMERS,  # nsa_core.hf is checked against transformers' own types
        "-c",
        _constraints_file(session, "typecheck", constraints),
        "torch",
        silent=False,
    )
    session.run("mypy", *SRC_DIRS, "noxfile.py", "ci", *session.posargs)


@nox.session(python=None, venv_backend=_TEST_BACKEND, tags=["ci"])
def tests(session: nox.Session) -> None:
    """The CPU test tiers (reference, Triton interpreter, kernel logic, bench) with torch 2.13."""
    cell = cells.cell(cells.CPU_CELL)
    text = cells.constraints(cell, cells.CPU_TORCH)
    python, env = _python_and_env(
        session, None if SYSTEM else _constraints_file(session, "cpu", text)
    )
    found = _probe(session, python, {**env, "TRITON_INTERPRET": "1"})
    _check_cell(session, found, None if SYSTEM else cell, need_gpu=False)
    _run_tiers(session, python, env, tiers.CPU_TIERS, ["-n", "2"], compile_for=(90, 89))


def _pair_text(cell: dict[str, Any]) -> str:
    release = cells.newest_release(cell)
    return f"torch=={release} triton{cell['releases'][release]}"


def _workers(session: nox.Session, need_gpu: bool) -> list[str]:
    """pytest-xdist arguments: CPU tiers share the machine's cores between two workers; GPU
    tiers take the workers ci/gpu_workers.py sizes from the cards' memory and the host's cores,
    spread over every visible GPU."""
    if not need_gpu:
        return ["-n", "2"]
    plan = gpu_workers.plan(gpu_workers.visible_gpus(), os.cpu_count() or 1)
    session.log(f"GPU tiers: {plan.why}")
    if plan.workers < 1:
        session.error("these are GPU tiers, and nvidia-smi lists no GPU here")
    return ["-n", str(plan.workers), "--worker-gpus", ",".join(plan.gpus)]


def _paired_session(
    cell: dict[str, Any], name: str, tag: str, selected: Sequence[tiers.Tier], doc: str
) -> None:
    """Register session ``name``: the ``selected`` tiers in an install of ``cell``'s torch and
    its paired triton, the pairing checked first."""
    need_gpu = any(t.hardware == "cuda" for t in selected)
    # The pairing is probed under the environment the tiers run in (TRITON_INTERPRET=1 for the
    # interpreter; the GPU tiers set none).
    probe_env = {k: v for t in selected for k, v in t.env.items()}

    def session_fn(session: nox.Session) -> None:
        constraints = (
            None if SYSTEM else _constraints_file(session, cell["torch"], cells.constraints(cell))
        )
        python, env = _python_and_env(session, constraints)
        found = _probe(session, python, {**env, **probe_env})
        _check_cell(session, found, cell, need_gpu=need_gpu)
        _run_tiers(session, python, env, selected, _workers(session, need_gpu))

    session_fn.__doc__ = doc
    nox.session(
        name=name,
        python=None if SYSTEM else cells.default_python(cell),
        venv_backend=_TEST_BACKEND,
        tags=[tag],
        default=False,
    )(session_fn)


def _interp_session(cell: dict[str, Any]) -> None:
    _paired_session(
        cell,
        f"interp-{cell['torch']}",
        "interp",
        [tiers.tier("interpreter")],
        f"The Triton interpreter tier on CPU with {_pair_text(cell)}.",
    )


def _interp_triton_session(cell: dict[str, Any]) -> None:
    """The interpreter tier with the CPU torch and ``cell``'s triton (not a paired install)."""
    interpreter = tiers.tier("interpreter")
    major, minor = cells.triton_minor(cell)

    def session_fn(session: nox.Session) -> None:
        if SYSTEM:
            session.error(
                "this session installs its own triton: run it without NSA_NOX_SYSTEM_PACKAGES"
            )
        text = cells.constraints(cell, torch_release=cells.CPU_TORCH)
        python, env = _python_and_env(
            session, _constraints_file(session, f"triton-{major}.{minor}", text)
        )
        found = _probe(session, python, {**env, **interpreter.env})
        if not cells.triton_matches(found["triton"], cell):
            session.error(f"installed triton {found['triton']}, wanted triton {cell['triton']}")
        # The interpreter runs the kernels in Python and never uses torch's own triton, so this
        # pair needs no pairing: it checks the kernels against another Triton language release.
        session.log(
            f"torch {found['torch']} with torch {cell['torch']}'s triton {found['triton']}: "
            "an interpreter-only install, not a paired one"
        )
        _run_tiers(session, python, env, [interpreter], ["-n", "2"])

    which = "oldest" if cell["torch"] == cells.OLDEST_INTERPRETER_CELL else "newest"
    session_fn.__doc__ = (
        f"The Triton interpreter tier with torch {cells.CPU_TORCH} (CPU) and the {which} triton "
        f"CPU CI can install, torch {cell['torch']}'s triton {cell['triton']}."
    )
    nox.session(
        name=f"interp_triton-{major}.{minor}",
        python=None,
        venv_backend=_TEST_BACKEND,
        tags=["interp", "ci_interp"],
        default=False,
    )(session_fn)


def _gpu_session(cell: dict[str, Any]) -> None:
    names = ", ".join(t.name for t in tiers.GPU_TIERS)
    _paired_session(
        cell,
        f"gpu_parity-{cell['torch']}",
        "gpu",
        tiers.GPU_TIERS,
        f"The GPU tiers ({names}) on a CUDA machine with {_pair_text(cell)}.",
    )
    quick = tiers.GPU_QUICK_TIERS
    _paired_session(
        cell,
        f"gpu_quick-{cell['torch']}",
        "gpu_quick",
        tiers.GPU_QUICK_RUNS,
        f"The GPU tiers but the slow one ({', '.join(t.name for t in quick)}) with "
        f"{_pair_text(cell)}: what every labelled pull request runs.",
    )


for _cell in cells.supported():
    _interp_session(_cell)
    _gpu_session(_cell)
for _cell in cells.interpreter_cells():
    _interp_triton_session(_cell)


@nox.session(python=None, default=False)
def pairing(session: nox.Session) -> None:
    """Check the version table against PyPI's torch metadata (no wheel downloads); fail on drift.

    ``nox -s pairing -- --every-wheel`` reads every Python's wheel instead of one per release.
    """
    session.install("--progress-bar", "off", "packaging", "pip>=24", silent=False)
    session.run("python", "-u", "ci/check_pairing.py", *session.posargs)


# Every module must import with the package's declared dependencies; only the optional extras
# (flash_attn, fla, matplotlib, transformers) may be missing, and the modules that need them are
# listed.
_IMPORT_ALL = """
import importlib, pkgutil, sys
name = sys.argv[1]
pkg = importlib.import_module(name)
mods = [m.name for m in pkgutil.walk_packages(pkg.__path__, name + ".")]
optional = []
extras = ("flash_attn", "fla", "matplotlib", "transformers")
for mod in mods:
    try:
        importlib.import_module(mod)
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] not in extras:
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
    constraints = _constraints_file(
        session, "cpu", cells.constraints(cells.cell(cells.CPU_CELL), cells.CPU_TORCH)
    )

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
        session.log(f"installing {', '.join(files)} from their wheels into a fresh venv")
        session.run(
            py, "-m", "pip", "install", "--progress-bar", "off", "-c", constraints,
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
