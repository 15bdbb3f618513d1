"""The version table and the torch/triton pairing verdict, on version strings only (no GPU)."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from nsa_kernels.pairing import installed_pairing, matches, pairing, parse_version
from nsa_kernels.version_table import CELLS, KERNELS_MIN_TRITON, Cell


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


# The pins as first specified for torch 2.2 .. 2.15; the table, re-derived from PyPI, agrees.
# Newer cells come from `nox -s pairing` and need no entry here.
SPECIFIED_PINS = {
    "2.2": "2.2.0",
    "2.3": "2.3.x",
    "2.4": "3.0.0",
    "2.5": "3.1.0",
    "2.6": "3.2.0",
    "2.7": "3.3.x",
    "2.8": "3.4.0",
    "2.9": "3.5.x",
    "2.10": "3.6.0",
    "2.11": "3.6.0",
    "2.12": "3.7.x",
    "2.13": "3.7.1",
    "2.14": "3.8.x",
    "2.15": "3.9.x",
}


def test_table_starts_at_torch_2_2_and_has_no_gaps() -> None:
    minors = [_key(cell["torch"]) for cell in CELLS]
    assert minors[0] == (2, 2)
    for (major, minor), following in itertools.pairwise(minors):
        assert following in ((major, minor + 1), (major + 1, 0)), (major, minor, following)
    pins = {cell["torch"]: cell["triton"] for cell in CELLS}
    assert {minor: pins.get(minor) for minor in SPECIFIED_PINS} == SPECIFIED_PINS


@pytest.mark.parametrize("cell", CELLS, ids=[c["torch"] for c in CELLS])
def test_cell_is_consistent(cell: Cell) -> None:
    releases = cell["releases"]
    assert releases, "a cell lists at least one torch release"
    for release, spec in releases.items():
        assert release.rsplit(".", 1)[0] == cell["torch"], release
        op, version = spec[:2], spec[2:]
        assert op in ("==", "~="), spec
        # every release's own pin satisfies the cell's pattern
        assert matches(parse_version(version), cell["triton"]), (release, spec)
    exact = not cell["triton"].endswith(".x")
    if exact:
        assert set(releases.values()) == {"==" + cell["triton"]}
    else:
        # a range is only used where the releases do not all pin the same exact triton
        assert len(set(releases.values())) > 1 or next(iter(releases.values())).startswith("~=")
    assert list(cell["pythons"]) == sorted(cell["pythons"], key=_key)
    assert set(cell["triton_pythons"]) <= set(cell["pythons"])
    triton_minor = _key(cell["triton"].replace(".x", ""))[:2]
    assert cell["supported"] == (triton_minor >= KERNELS_MIN_TRITON)
    assert cell["why"]


@pytest.mark.parametrize(
    ("text", "release", "pre", "dev", "local"),
    [
        ("2.11.0", (2, 11, 0), None, False, None),
        ("2.11.0+cu130", (2, 11, 0), None, False, "cu130"),
        ("2.6.0a0+ecf3bae40a", (2, 6, 0), "a0", False, "ecf3bae40a"),
        ("2.11.0.dev20251201+cu130", (2, 11, 0), None, True, "cu130"),
        ("2.11.0rc1", (2, 11, 0), "rc1", False, None),
        ("3.6.0+git9a1b2c3", (3, 6, 0), None, False, "git9a1b2c3"),
        ("3.3", (3, 3), None, False, None),
        ("v3.0.0", (3, 0, 0), None, False, None),
        ("2.4.1.post1", (2, 4, 1), None, False, None),
    ],
)
def test_parse_version(
    text: str, release: tuple[int, ...], pre: str | None, dev: bool, local: str | None
) -> None:
    v = parse_version(text)
    assert (v.release, v.pre, v.dev, v.local) == (release, pre, dev, local)


@pytest.mark.parametrize("text", ["", "abc", "2.x", "2.11.0+", "2.11.0 extra"])
def test_parse_version_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="is not a version"):
        parse_version(text)


@pytest.mark.parametrize(
    ("triton", "pin", "expected"),
    [
        ("3.3.0", "3.3.x", True),
        ("3.3.1", "3.3.x", True),
        ("3.3", "3.3.x", True),
        ("3.4.0", "3.3.x", False),
        ("3.6.0", "3.6.0", True),
        ("3.6", "3.6.0", True),
        ("3.6.1", "3.6.0", False),
        ("3.6.0.1", "3.6.0", False),
        ("3.6.0+git9a1b2c3", "3.6.0", True),
    ],
)
def test_matches(triton: str, pin: str, expected: bool) -> None:
    assert matches(parse_version(triton), pin) is expected


@pytest.mark.parametrize(
    ("torch", "triton", "verdict", "expected"),
    [
        ("2.3.1", "3.0.0", "mismatched", "2.3.x"),
        ("2.3.0", "2.3.1", "paired", "2.3.x"),
        ("2.4.0", "3.0.0", "paired", "3.0.0"),
        ("2.4.1", "3.1.0", "mismatched", "3.0.0"),
        ("2.7.1", "3.3.1", "paired", "3.3.x"),
        ("2.10.0", "3.6.1", "mismatched", "3.6.0"),
        ("2.11.0+cu130", "3.6.0", "paired", "3.6.0"),
        ("2.11.0", "3.7.0", "mismatched", "3.6.0"),
        ("2.12.0", "3.7.1", "paired", "3.7.x"),
        ("2.13.0", "3.7.0", "mismatched", "3.7.1"),
        ("2.13.0+cpu", "3.7.1", "paired", "3.7.1"),
        ("2.14.1", "3.8.2", "paired", "3.8.x"),
        ("2.14.0", "3.9.0", "mismatched", "3.8.x"),
        ("2.15.0", "3.9.0", "paired", "3.9.x"),
    ],
)
def test_verdict(torch: str, triton: str, verdict: str, expected: str) -> None:
    result = pairing(torch, triton)
    assert result.verdict == verdict, result.reason
    assert result.expected == expected
    assert result.cell == ".".join(torch.split(".")[:2])
    assert result.torch == torch
    assert result.triton == triton


def test_prereleases_are_judged_by_their_release_and_say_so() -> None:
    nightly = pairing("2.11.0.dev20251201+cu130", "3.6.0+git9a1b2c3")
    assert nightly.verdict == "paired"
    assert "judged by its release 2.11.0" in nightly.reason
    assert nightly.release_pin == "==3.6.0"
    ngc = pairing("2.6.0a0+ecf3bae40a", "3.2.0")
    assert ngc.verdict == "paired"
    rc = pairing("2.11.0rc1", "3.5.1")
    assert rc.verdict == "mismatched"
    assert "2.11.0rc1" in rc.reason


def test_patch_level_difference_is_paired_but_reported() -> None:
    # torch 2.7.0's wheel pins ==3.3.0; the cell accepts any 3.3 patch and the reason says so.
    result = pairing("2.7.0", "3.3.1")
    assert result.verdict == "paired"
    assert result.release_pin == "==3.3.0"
    assert "asks for triton==3.3.0" in result.reason
    assert "asks for" not in pairing("2.7.0", "3.3.0").reason


def test_release_pin_is_none_for_a_release_the_table_does_not_list() -> None:
    result = pairing("2.7.2", "3.3.2")
    assert result.verdict == "paired"
    assert result.release_pin is None


@pytest.mark.parametrize(
    ("torch", "triton", "verdict", "needle"),
    [
        ("2.16.0", "3.10.0", "unknown", "torch 2.16 is not in the version table (2.2 .. 2.15)"),
        ("2.1.2", "2.1.0", "unknown", "torch 2.1 is not in the version table"),
        ("2", "3.0.0", "unknown", "not in the version table"),
        ("nightly", "3.6.0", "unknown", "cannot read torch version 'nightly'"),
        (None, "3.6.0", "unknown", "torch is missing"),
        ("2.11.0", "main", "unknown", "cannot read triton version 'main'"),
        ("2.11.0", None, "mismatched", "triton is missing; torch 2.11 pins triton 3.6.0"),
    ],
)
def test_unknown_and_missing(
    torch: str | None, triton: str | None, verdict: str, needle: str
) -> None:
    result = pairing(torch, triton)
    assert result.verdict == verdict
    assert needle in result.reason
    assert str(result).startswith(f"{verdict}: ")


def test_supported_follows_the_cell() -> None:
    assert pairing("2.3.1", "2.3.1").supported is False
    assert pairing("2.4.0", "3.0.0").supported is True
    assert pairing("2.16.0", "3.10.0").supported is False


def test_installed_pairing_reads_this_interpreter() -> None:
    torch = pytest.importorskip("torch")
    try:
        import triton
    except ImportError:
        triton_version = None
    else:
        triton_version = str(triton.__version__)
    result = installed_pairing()
    assert result.torch == str(torch.__version__)
    assert result.triton == triton_version
    assert result.verdict == pairing(str(torch.__version__), triton_version).verdict


def test_installed_pairing_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    monkeypatch.setitem(sys.modules, "triton", None)  # makes ``import triton`` raise ImportError
    result = installed_pairing()
    assert result.triton is None
    assert result.verdict in ("mismatched", "unknown")
    assert "import triton failed: ModuleNotFoundError" in result.reason


def _spec_of(requirements: list[str], name: str) -> Requirement:
    (req,) = [Requirement(r) for r in requirements if Requirement(r).name == name]
    return req


def _pin_versions(cell: Cell) -> set[str]:
    return {spec[2:] for spec in cell["releases"].values()}


def _neighbours(version: str) -> tuple[str, str]:
    """x.y.z -> (the previous minor's last patch stand-in, the next minor's first release)."""
    major, minor = _key(version)[:2]
    return f"{major}.{minor - 1}.99", f"{major}.{minor + 1}.0"


def test_torch_extras_install_each_cell_and_its_triton() -> None:
    tomllib = pytest.importorskip("tomllib")
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    project = tomllib.loads(pyproject.read_text())["project"]
    extras = project["optional-dependencies"]
    supported = [cell for cell in CELLS if cell["supported"]]
    names = {f"torch{cell['torch'].replace('.', '-')}": cell for cell in supported}
    assert {name for name in extras if name.startswith("torch")} == set(names)
    for name, cell in names.items():
        torch_req, triton_req = _spec_of(extras[name], "torch"), _spec_of(extras[name], "triton")
        for release in cell["releases"]:
            assert torch_req.specifier.contains(release), (name, release)
        for outside in _neighbours(next(iter(cell["releases"]))):
            assert not torch_req.specifier.contains(outside), (name, outside)
        for pinned in _pin_versions(cell):
            assert triton_req.specifier.contains(pinned), (name, pinned)
            assert matches(parse_version(pinned), cell["triton"])
        for outside in _neighbours(next(iter(_pin_versions(cell)))):
            assert not triton_req.specifier.contains(outside), (name, outside)

    base = _spec_of(project["dependencies"], "triton")
    for cell in supported:
        assert all(base.specifier.contains(v) for v in _pin_versions(cell)), cell["torch"]
    newest = max((v for c in supported for v in _pin_versions(c)), key=_key)
    assert not base.specifier.contains(_neighbours(newest)[1])
    assert not base.specifier.contains("2.3.1")
