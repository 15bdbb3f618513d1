"""Re-derive the torch x triton version table from PyPI and report any drift from the table.

The truth is the ``Requires-Dist`` of torch's Linux x86_64 manylinux wheels
(``triton==X; platform_system == "Linux" ...``). For every torch release this asks pip

- which CPython versions have such a wheel (``pip index versions torch --python-version ...``), and
- what one wheel requires (``pip install --dry-run --no-deps --report``): pip reads the wheel's
  PEP 658 metadata file or, where the index has none, only the wheel's central directory and
  METADATA through HTTP range requests (``--use-feature=fast-deps``); no wheel is downloaded,

then rebuilds each cell (release pins, triton pattern, Pythons, Pythons where triton comes along)
and compares it with ``nsa_kernels/version_table.py``. The editorial fields (``supported``,
``why``) are not checked. Run through ``nox -s pairing``; it needs ``packaging``.

Exit status: 0 no drift, 1 drift (each difference and the re-derived cell are printed),
2 the index could not be asked.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement

# ci/ is a folder of scripts, not an installed package: make ``ci.cells`` importable when this file
# runs as a script.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ci import cells as table

DEFAULT_INDEX = "https://pypi.org/simple"
# Older torch wheels are tagged manylinux1; pip does not expand a manylinux_2_x platform into the
# older tags by itself, so every tag torch has used is listed.
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
PROBE_PYTHONS = ("3.8", "3.9", "3.10", "3.11", "3.12", "3.13", "3.14", "3.15", "3.16")
# The Python whose wheel is read for the pin when every Python is not asked (--every-wheel).
PROBE_PREFERRED = "3.12"


class IndexUnavailable(RuntimeError):
    """pip could not answer (network, index, or an unexpected reply)."""


def _pip(args: Sequence[str]) -> subprocess.CompletedProcess[str]:
    # --isolated and PIP_CONFIG_FILE=devnull: the answer must come from the named index alone, not
    # from a local wheel folder or a mirror configured on this machine.
    env = dict(os.environ, PIP_CONFIG_FILE=os.devnull)
    cmd = [sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)


def _target_args(python: str) -> list[str]:
    args = ["--only-binary", ":all:", "--implementation", "cp", "--python-version", python]
    for platform in PLATFORMS:
        args += ["--platform", platform]
    return args


def _say(line: str) -> None:
    # Progress: the index answers in tens of seconds, and a silent wait looks like a hang.
    print(line, flush=True)


def released_for(python: str, index: str) -> list[str]:
    """Final torch releases that have a Linux x86_64 CPython ``python`` wheel on ``index``."""
    proc = _pip(["index", "versions", "torch", "--index-url", index, *_target_args(python)])
    if proc.returncode != 0:
        if "No matching distribution found" in proc.stderr:
            return []
        raise IndexUnavailable(f"pip index versions (python {python}) failed:\n{proc.stderr}")
    for line in proc.stdout.splitlines():
        if line.startswith("Available versions:"):
            return [v.strip() for v in line.split(":", 1)[1].split(",") if v.strip()]
    raise IndexUnavailable(f"unexpected reply from pip index versions:\n{proc.stdout}")


def wheel_requirements(release: str, python: str, index: str) -> tuple[str, list[str]]:
    """(wheel file name, Requires-Dist lines) of torch ``release``'s Linux wheel for ``python``."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        proc = _pip(
            [
                "install",
                "--dry-run",
                "--no-deps",
                "--ignore-installed",
                "--quiet",
                "--use-feature=fast-deps",
                "--target",
                str(Path(tmp) / "target"),
                "--report",
                str(report),
                "--index-url",
                index,
                *_target_args(python),
                f"torch=={release}",
            ]
        )
        if proc.returncode != 0:
            raise IndexUnavailable(f"dry run of torch=={release} (python {python}):\n{proc.stderr}")
        data: dict[str, Any] = json.loads(report.read_text())
    (item,) = data["install"]
    filename = str(item["download_info"]["url"]).rsplit("/", 1)[-1]
    return filename, list(item["metadata"].get("requires_dist", []))


def triton_requirement(requires_dist: Sequence[str]) -> Requirement | None:
    for line in requires_dist:
        req = Requirement(line)
        if req.name.lower() == "triton":
            return req
    return None


def requires_triton_on(req: Requirement | None, python: str) -> bool:
    """Whether pip installs the pinned triton with this wheel on Linux x86_64 CPython ``python``."""
    if req is None:
        return False
    if req.marker is None:
        return True
    env = {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "sys_platform": "linux",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "extra": "",
    }
    return bool(req.marker.evaluate(env))


def pin_pattern(specifiers: Sequence[str]) -> str:
    """The cell's triton pin from its releases' specifiers.

    All ``==X.Y.Z`` alike -> ``"X.Y.Z"``; otherwise one triton minor (``==`` or ``~=X.Y.0``) ->
    ``"X.Y.x"``. Anything else cannot be said with one pattern and raises ``ValueError``.
    """
    versions: set[tuple[int, int, int]] = set()
    exact = True
    for spec in specifiers:
        m = re.fullmatch(r"(==|~=)(\d+)\.(\d+)\.(\d+)", spec.replace(" ", ""))
        if m is None or (m[1] == "~=" and m[4] != "0"):
            raise ValueError(f"triton specifier {spec!r} has no pattern in the table's terms")
        exact = exact and m[1] == "=="
        versions.add((int(m[2]), int(m[3]), int(m[4])))
    minors = {v[:2] for v in versions}
    if len(minors) != 1:
        raise ValueError(f"triton specifiers {sorted(specifiers)} span more than one triton minor")
    if exact and len(versions) == 1:
        return ".".join(map(str, versions.pop()))
    major, minor = minors.pop()
    return f"{major}.{minor}.x"


def _release_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def derive(index: str, every_wheel: bool, first_minor: str) -> list[dict[str, Any]]:
    """Re-derived cells for every torch minor from ``first_minor`` on, oldest first."""
    first = _release_key(first_minor)
    _say(
        f"pairing: asking {index} which torch releases have Linux wheels for Python "
        f"{PROBE_PYTHONS[0]} .. {PROBE_PYTHONS[-1]}"
    )
    listed: dict[str, list[str]] = {}
    with ThreadPoolExecutor(max_workers=4) as pool:
        asked = {pool.submit(released_for, py, index): py for py in PROBE_PYTHONS}
        for future in as_completed(asked):
            python = asked[future]
            listed[python] = future.result()
            _say(f"  Python {python}: {len(listed[python])} torch releases")

    pythons_of: dict[str, list[str]] = {}
    for python, releases in listed.items():
        for release in releases:
            if re.fullmatch(r"\d+\.\d+\.\d+", release) and _release_key(release)[:2] >= first:
                pythons_of.setdefault(release, []).append(python)

    jobs: list[tuple[str, str]] = []
    for release, wheel_pythons in pythons_of.items():
        if every_wheel:
            jobs += [(release, py) for py in wheel_pythons]
        else:
            preferred = PROBE_PREFERRED if PROBE_PREFERRED in wheel_pythons else wheel_pythons[-1]
            jobs.append((release, preferred))
    _say(f"pairing: reading the triton pin of {len(jobs)} wheels (their metadata only)")
    # release -> python -> triton requirement of that Python's wheel
    reqs: dict[str, dict[str, Requirement | None]] = {}
    with ThreadPoolExecutor(max_workers=4) as pool:
        read = {pool.submit(wheel_requirements, rel, py, index): (rel, py) for rel, py in jobs}
        for done, answer in enumerate(as_completed(read), 1):
            release, python = read[answer]
            req = triton_requirement(answer.result()[1])
            reqs.setdefault(release, {})[python] = req
            pin = f"triton{req.specifier}" if req is not None else "no triton"
            _say(f"  [{done}/{len(jobs)}] torch {release} (Python {python}): {pin}")

    by_minor: dict[str, list[str]] = {}
    for release in sorted(pythons_of, key=_release_key):
        by_minor.setdefault(".".join(release.split(".")[:2]), []).append(release)

    derived: list[dict[str, Any]] = []
    for minor, releases in by_minor.items():
        pins: dict[str, str] = {}
        pythons: set[str] = set(PROBE_PYTHONS)
        triton_pythons: set[str] = set(PROBE_PYTHONS)
        for release in releases:
            per_wheel = reqs[release]
            specs = {str(r.specifier) if r is not None else "" for r in per_wheel.values()}
            if len(specs) != 1 or "" in specs:
                raise ValueError(
                    f"torch {release}: wheels disagree on a triton pin or lack one: {specs}"
                )
            pins[release] = specs.pop()
            # With one wheel read, its marker stands for every wheel of the release.
            sample = next(iter(per_wheel.values()))
            release_pythons = pythons_of[release]
            pythons &= set(release_pythons)
            triton_pythons &= {
                py for py in release_pythons if requires_triton_on(per_wheel.get(py, sample), py)
            }
        derived.append(
            {
                "torch": minor,
                "triton": pin_pattern(list(pins.values())),
                "releases": pins,
                "pythons": tuple(sorted(pythons, key=_release_key)),
                "triton_pythons": tuple(sorted(triton_pythons, key=_release_key)),
            }
        )
    return derived


CHECKED_FIELDS = ("triton", "releases", "pythons", "triton_pythons")


def _norm(field: str, value: Any) -> Any:
    return tuple(value) if field in ("pythons", "triton_pythons") else value


def compare(recorded: Sequence[dict[str, Any]], derived: Sequence[dict[str, Any]]) -> list[str]:
    """Human-readable differences; empty when the table says what the index says."""
    problems: list[str] = []
    rec = {c["torch"]: c for c in recorded}
    der = {c["torch"]: c for c in derived}
    for minor in sorted(set(rec) | set(der), key=_release_key):
        if minor not in der:
            problems.append(f"torch {minor}: in the table but no release found on the index")
            continue
        if minor not in rec:
            released = ", ".join(der[minor]["releases"])
            problems.append(f"torch {minor}: released ({released}) but not in the table")
            continue
        for field in CHECKED_FIELDS:
            want, have = _norm(field, der[minor][field]), _norm(field, rec[minor][field])
            if want != have:
                problems.append(f"torch {minor}: {field}: table {have!r}, index {want!r}")
    return problems


def render_cell(cell: dict[str, Any]) -> str:
    """A derived cell as it is written in version_table.py: its line of ``_RELEASES`` and its
    ``_cell(...)`` row (``supported`` and ``why`` left to a person)."""

    def span(pythons: Sequence[str]) -> str:
        return f"{pythons[0]}-{pythons[-1]}" if pythons else ""

    torch = cell["torch"]
    releases = ", ".join(f'"{r}": "{spec}"' for r, spec in cell["releases"].items())
    row = (
        f'"{torch}", "{cell["triton"]}", "{span(cell["pythons"])}", '
        f'"{span(cell["triton_pythons"])}", SUPPORTED, WHY'
    )
    return f'_RELEASES:    "{torch}": {{{releases}}},\nCELLS:    _cell({row}),'


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--index-url", default=DEFAULT_INDEX, help="simple index to ask (PyPI)")
    parser.add_argument(
        "--every-wheel",
        action="store_true",
        help="read every Python's wheel of every release, not one per release (slower)",
    )
    args = parser.parse_args(argv)

    recorded = table.load()
    try:
        derived = derive(args.index_url, args.every_wheel, recorded[0]["torch"])
    except IndexUnavailable as err:
        print(f"pairing: could not ask {args.index_url}: {err}", file=sys.stderr)
        return 2

    print(f"{'torch':>6}  {'triton':<8} {'pythons':<12} {'triton pythons':<14} releases")
    for cell in derived:
        pys, tpys = cell["pythons"], cell["triton_pythons"]
        span = f"{pys[0]}-{pys[-1]}" if pys else "-"
        tspan = f"{tpys[0]}-{tpys[-1]}" if tpys else "-"
        pins = ", ".join(f"{r} {s}" for r, s in cell["releases"].items())
        print(f"{cell['torch']:>6}  {cell['triton']:<8} {span:<12} {tspan:<14} {pins}")

    problems = compare(recorded, derived)
    if not problems:
        print(f"pairing: the table matches {args.index_url} ({len(derived)} torch minors)")
        return 0
    print(f"\npairing: DRIFT, {len(problems)} difference(s):")
    for problem in problems:
        print(f"  - {problem}")
    changed = {p.split(":")[0].split()[1] for p in problems}
    for cell in derived:
        if cell["torch"] in changed:
            print(f"\nre-derived cell torch {cell['torch']}:\n{render_cell(cell)}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
