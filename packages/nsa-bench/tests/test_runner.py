"""The runner (ci/runner.py) and the tier table (ci/tiers.py) that nox and the GPU scripts share.

These need the checkout (ci/ is not installed): the root conftest.py puts its folder on sys.path.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from ci import runner, tiers

ROOT = Path(__file__).resolve().parents[3]
MARKERS = ("triton", "gpu", "fa2", "cuda", "slow")


def _selects(expression: str, marks: set[str]) -> bool:
    """pytest's -m semantics for the and/or/not expressions of the tier table."""
    names = {m: m in marks for m in MARKERS}
    return bool(eval(expression, {"__builtins__": {}}, names))


def test_tier_markers_are_registered_and_every_marking_has_one_tier_per_host() -> None:
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    registered = {m.split(":")[0] for m in config["tool"]["pytest"]["ini_options"]["markers"]}
    assert set(MARKERS) == registered
    # The compiled twin of the interpreter tier runs the same tests on a GPU host.
    cpu_host = [t for t in tiers.TIERS if t.name != "triton-gpu"]
    gpu_host = [t for t in tiers.TIERS if t.name != "interpreter"]
    for host in (cpu_host, gpu_host):
        for package in tiers.ALL_TESTS:
            for k in range(len(MARKERS) + 1):
                for marks in itertools.combinations(MARKERS, k):
                    owners = [
                        t.name
                        for t in host
                        if package in t.paths and _selects(t.markers, set(marks))
                    ]
                    assert len(owners) == 1, (package, marks, owners)


def test_interpreter_tier_and_its_compiled_twin_select_the_same_tests() -> None:
    interpreter, compiled = tiers.tier("interpreter"), tiers.tier("triton-gpu")
    assert (interpreter.paths, interpreter.markers) == (compiled.paths, compiled.markers)
    assert dict(interpreter.env) == {"TRITON_INTERPRET": "1"}
    assert (interpreter.hardware, compiled.hardware) == ("cpu", "cuda")
    assert not compiled.env


def test_the_quick_gpu_runs_select_every_gpu_tier_but_slow_once() -> None:
    """gpu_quick's runs (two tiers merged into one pytest run) select, for every marking, the
    tests of the GPU tiers other than ``slow``: each in exactly one run, none of ``slow``'s."""
    assert [r.name for r in tiers.GPU_QUICK_RUNS] == ["triton-gpu+gpu", "fa2", "cuda"]
    quick = [t for t in tiers.GPU_TIERS if t.name != "slow"]
    for k in range(len(MARKERS) + 1):
        for marks in itertools.combinations(MARKERS, k):
            runs = [r.name for r in tiers.GPU_QUICK_RUNS if _selects(r.markers, set(marks))]
            wanted = [t.name for t in quick if _selects(t.markers, set(marks))]
            assert len(runs) == len(wanted) <= 1, (marks, runs, wanted)


def test_only_tiers_alike_but_for_their_markers_merge() -> None:
    with pytest.raises(ValueError, match="differ beyond their markers"):
        tiers.merged("x", "x", [tiers.tier("interpreter"), tiers.tier("triton-gpu")])
    with pytest.raises(ValueError, match="only parallel tiers"):
        tiers.merged("x", "x", [tiers.tier("gpu"), tiers.tier("fa2")])


def test_every_tier_has_a_smoke_selection_that_collects_tests() -> None:
    """``runner.py --quick`` runs each tier's smoke selection: every id in it must still name
    tests (a renamed test would otherwise leave its tier's smoke run empty)."""
    ids = sorted({test for t in tiers.TIERS for test in t.smoke})
    assert all(t.smoke for t in tiers.TIERS)
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    proc = subprocess.run([*cmd, *ids], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    collected = [line for line in proc.stdout.splitlines() if "::" in line]
    for test in ids:
        assert any(line.startswith(test) for line in collected), f"{test} collects no test"


def test_smoke_args_narrow_the_tier_to_its_selection() -> None:
    reference = tiers.tier("reference")
    args = reference.smoke_args()
    assert args[: len(reference.smoke)] == list(reference.smoke)
    assert args[len(reference.smoke) :] == ["-m", reference.markers]


def test_narrow_to_a_folder() -> None:
    gpu = tiers.tier("gpu")
    selected = "packages/nsa-kernels/tests/selected"
    assert gpu.pytest_args(selected) == [selected, "-m", gpu.markers]
    routes = "packages/nsa-kernels/tests/test_default_routes_gpu.py"
    assert gpu.pytest_args([selected, routes]) == [selected, routes, "-m", gpu.markers]
    assert tiers.narrow(gpu.paths, "packages") == list(gpu.paths)
    with pytest.raises(ValueError, match="not inside the tier's paths"):
        tiers.narrow(tiers.tier("reference").paths, "packages/nsa-kernels/tests")


def test_tiers_command_line_prints_what_the_scripts_read() -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "ci/tiers.py", *args], cwd=ROOT, capture_output=True, text=True
        )

    args = cli("args", "slow", "--under", "packages/nsa-core/tests")
    assert args.returncode == 0, args.stderr
    assert args.stdout.splitlines() == ["packages/nsa-core/tests", "-m", "slow", "--run-slow"]
    both = cli("args", "gpu", "--under", "packages/nsa-kernels/tests/selected",
               "packages/nsa-kernels/tests/combine")  # fmt: skip
    assert both.stdout.splitlines()[:2] == [
        "packages/nsa-kernels/tests/selected",
        "packages/nsa-kernels/tests/combine",
    ]
    assert cli("env", "interpreter").stdout == "TRITON_INTERPRET=1\n"
    missing = cli("args", "nope")
    assert missing.returncode == 2
    assert "no tier 'nope'" in missing.stderr


def _pairing(verdict: str = "paired", interpreter_error: str | None = None) -> runner.HostPairing:
    reason = "triton 3.9.0, but torch 2.13 pins triton 3.7.1"
    return runner.HostPairing(verdict, reason, "2.13.0+cpu", "3.9.0", "2.13", interpreter_error)


def test_pairing_warning_names_the_fix() -> None:
    assert runner.pairing_warning(_pairing()) is None
    warning = runner.pairing_warning(_pairing("mismatched"))
    assert warning is not None
    assert warning.startswith("WARNING: torch 2.13.0+cpu and triton 3.9.0 are not a paired install")
    assert "torch 2.13 pins triton 3.7.1" in warning
    assert 'pip install "nsa-kernels[torch2-13]"' in warning


def test_first_error_of_a_junit_report(tmp_path: Path) -> None:
    report = tmp_path / "r.xml"
    report.write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="1" skipped="0">'
        '<testcase classname="pkg.test_a" name="test_ok"/>'
        '<testcase classname="pkg.test_a" name="test_bad[x]">'
        '<failure message="ValueError: mask has unsupported dtype">trace</failure></testcase>'
        '<testcase classname="pkg.test_b" name="test_worse"><error message="later"/></testcase>'
        "</testsuite></testsuites>"
    )
    assert runner.first_error_in_junit(report) == (
        "pkg.test_a::test_bad[x]: ValueError: mask has unsupported dtype"
    )
    counts = runner.junit_counts(report)
    assert (counts["passed"], counts["failures"], counts["errors"]) == (1, 1, 1)


def test_first_error_of_a_log() -> None:
    log = "collected\nE   ImportError: cannot import name 'x'\nE   second\n"
    assert runner.first_error_in_log(log) == "ImportError: cannot import name 'x'"
    assert runner.first_error_in_log("Fatal Python error: Aborted\n") == (
        "Fatal Python error: Aborted"
    )
    assert runner.first_error_in_log("all fine\n") is None


def _fake_tier(tmp_path: Path, body: str, markers: str = "not slow") -> tiers.Tier:
    folder = tmp_path / "fake_tests"
    folder.mkdir()
    (folder / "test_fake.py").write_text(body)
    return tiers.Tier("fake", "Fake", (str(folder),), markers, "cpu")


def test_a_failing_tier_names_its_first_error_and_the_unpaired_install(tmp_path: Path) -> None:
    tier = _fake_tier(
        tmp_path,
        "def test_passes():\n    pass\n\n"
        "def test_fails():\n    raise ValueError('mask has unsupported dtype')\n",
    )
    out = tmp_path / "out"
    out.mkdir()
    result = runner.run_tier(tier, out, False, _pairing("mismatched"), workers="0")
    assert result.status == "FAIL"
    assert result.detail.startswith("1 passed, 1 failed, 0 skipped; first error: ")
    assert "test_fails: ValueError: mask has unsupported dtype" in result.detail
    assert "not paired: triton 3.9.0, but torch 2.13 pins triton 3.7.1" in result.detail
    assert (out / "tests_fake.log").exists()


def test_a_passing_tier_and_one_that_selects_nothing(tmp_path: Path) -> None:
    tier = _fake_tier(tmp_path, "def test_passes():\n    pass\n")
    out = tmp_path / "out"
    out.mkdir()
    ok = runner.run_tier(tier, out, False, _pairing(), workers="0")
    assert (ok.status, ok.detail) == ("PASS", "1 passed, 0 failed, 0 skipped")
    empty = tiers.Tier("empty", "Empty", tier.paths, "slow", "cpu")
    nothing = runner.run_tier(empty, out, False, _pairing(), workers="0")
    assert (nothing.status, nothing.detail) == ("FAIL", "no tests collected")


def test_a_tier_whose_module_skips_at_collection_is_skipped_with_the_reason(
    tmp_path: Path,
) -> None:
    tier = _fake_tier(
        tmp_path,
        "import pytest\n\n"
        "pytest.importorskip('no_such_module_here', reason='needs no_such_module_here')\n",
    )
    out = tmp_path / "out"
    out.mkdir()
    result = runner.run_tier(tier, out, False, _pairing(), workers="0")
    assert (result.status, result.detail) == ("SKIP", "needs no_such_module_here")


def test_gpu_tiers_skip_without_cuda_and_the_interpreter_tier_fails_without_triton(
    tmp_path: Path,
) -> None:
    gpu = runner.run_tier(tiers.tier("gpu"), tmp_path, False, _pairing())
    assert (gpu.status, gpu.detail) == ("SKIP", "no CUDA device visible to torch")
    broken = _pairing(interpreter_error="ImportError: libtriton.so")
    interp = runner.run_tier(tiers.tier("interpreter"), tmp_path, False, broken)
    assert interp.status == "FAIL"
    assert "TRITON_INTERPRET=1 fails: ImportError: libtriton.so" in interp.detail


def test_report_opens_with_the_warning_and_says_the_result(tmp_path: Path) -> None:
    results = [
        runner.StepResult("Triton interpreter (CPU)", "FAIL", 3.0, "0 passed; first error: X"),
        runner.StepResult("Reference (CPU)", "PASS", 1.0, "5 passed"),
    ]
    env = {"torch": "2.13.0", "triton": "3.9.0", "cuda": "none", "pairing": "mismatched"}
    warning = runner.pairing_warning(_pairing("mismatched"))
    report = runner.render_report(results, env, "abc1234", tmp_path, warning)
    lines = report.splitlines()
    assert lines[0] == warning
    assert "Result: FAIL, Triton interpreter (CPU)" in lines
    assert "- Triton interpreter (CPU): FAIL (3.0 s) - 0 passed; first error: X" in lines
