"""The GPU robustness check (ci/gpu_robustness.py, the package ci/robustness) on a CPU: its plan,
its parsers, its report, and its real code paths on tiny shapes under the Triton interpreter.

These need the checkout (ci/ is not installed): the root conftest.py puts its folder on sys.path.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import itertools
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ci.robustness.children import Child, parse_shard, run_children, shard_of, visible_gpus
from ci.robustness.cli import main
from ci.robustness.launches import LaunchRecorder, kernel_launches
from ci.robustness.long import parse_lengths, sample_rows
from ci.robustness.parity import (
    REQUIRED_BACKENDS,
    Check,
    ParityOptions,
    parity_verdict,
    run_parity_case,
)
from ci.robustness.plan import (
    CPU_LIMITS,
    DEFAULT_CASES,
    DEFAULT_SEED,
    GPU_LIMITS,
    SHORT,
    Geometry,
    ParityCase,
    ParityPlan,
    describe_plan,
    geometry_problems,
    make_plan,
)
from ci.robustness.report import PartResult, load_parts, markdown_report, summary_lines, write_part
from ci.robustness.runtime import setup_runtime
from ci.robustness.sanitize import (
    SweepSummary,
    finding_kernels,
    kernel_name,
    parse_sanitizer,
    parse_sweep,
    tool_verdict,
)
from ci.robustness.sweep import run_sweep, sweep_cases
from nsa_core import NSAConfig

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "ci" / "gpu_robustness.py"
PACKAGE = ROOT / "ci" / "robustness"
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
needs_interpreter = pytest.mark.skipif(
    not INTERPRET, reason="runs Triton kernels on CPU: needs TRITON_INTERPRET=1"
)


# ---------------------------------------------------------------------------- the parity plan


def test_plan_is_a_function_of_the_seed_and_case_n_of_any_length() -> None:
    first = make_plan(13, 200, GPU_LIMITS)
    assert first == make_plan(13, 200, GPU_LIMITS)
    shorter = make_plan(13, 37, GPU_LIMITS)
    assert shorter.geometries == first.geometries
    assert shorter.cases == first.cases[:37], "--case N must replay case N of the full run"
    assert make_plan(14, 200, GPU_LIMITS).cases != first.cases


def test_plan_covers_what_the_issue_asks_for() -> None:
    plan = make_plan(DEFAULT_SEED, DEFAULT_CASES, GPU_LIMITS)
    geos = plan.geometries
    assert {g.dtype for g in geos} == {"float16", "bfloat16", "float32"}
    assert len({g.group for g in geos}) == len(geos), "each geometry has its own G"
    assert {g.group for g in geos} <= {1, 2, 3, 4, 8, 16}
    assert any(g.cmp_block == g.cmp_stride == g.sel_block for g in geos), "l = d = l'"
    assert any((g.head_dim_qk, g.head_dim_v) == (192, 128) for g in geos)
    assert any(g.grad for g in geos)
    assert not all(g.grad for g in geos)
    cases = plan.cases
    assert len(cases) == 200
    assert {c.geometry for c in cases} == set(range(len(geos)))
    assert any(c.seqlens is not None and 1 in c.seqlens for c in cases), "a 1-token sequence"
    assert any(c.q_start > 0 for c in cases)
    assert any(c.batch == 2 for c in cases)
    lengths = {c.seq_len for c in cases}
    assert 1 in lengths
    assert any(n < SHORT for n in lengths)
    assert any(n >= 2048 for n in lengths)
    for c in cases:
        assert 1 <= c.seq_len <= 3000
        assert 1 <= c.query_len <= c.seq_len
        if c.seqlens is not None:
            assert (c.batch, c.q_start, sum(c.seqlens)) == (1, 0, c.seq_len)
            assert min(c.seqlens) >= 0


def _config(g: Geometry) -> NSAConfig:
    return NSAConfig(
        num_q_heads=g.num_q_heads,
        num_kv_heads=g.num_kv_heads,
        head_dim_qk=g.head_dim_qk,
        head_dim_v=g.head_dim_v,
        cmp_block=g.cmp_block,
        cmp_stride=g.cmp_stride,
        sel_block=g.sel_block,
        num_selected=g.num_selected,
        window=g.window,
    )


@pytest.mark.parametrize("seed", range(5))
def test_every_drawn_geometry_is_a_valid_nsa_config(seed: int) -> None:
    for limits in (GPU_LIMITS, CPU_LIMITS):
        for g in make_plan(seed, 0, limits).geometries:
            assert geometry_problems(g) == []
            assert _config(g).group_size == g.group
            assert g.num_q_heads <= limits.max_q_heads


VALID = Geometry("bfloat16", 2, 3, 64, 32, 32, 16, 64, 16, 512, False)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"cmp_block": 40}, "d must divide l"),
        ({"sel_block": 24}, "d must divide l'"),
        ({"num_selected": 2}, "n must be >= 3"),
        ({"head_dim_qk": 33}, "dk must be even"),
        ({"window": 0}, "window must be >= 1"),
        ({"num_kv_heads": 0}, "num_kv_heads must be >= 1"),
        ({"dtype": "float64"}, "no bound"),
    ],
)
def test_geometry_problems_name_the_broken_rule(change: dict[str, Any], problem: str) -> None:
    bad = dataclasses.replace(VALID, **change)
    assert any(problem in p for p in geometry_problems(bad))
    if change.get("dtype") is None:  # the config rules are NSAConfig's own
        with pytest.raises((ValueError, TypeError)):
            _config(bad)


def test_parse_lengths() -> None:
    assert parse_lengths("128k, 256k,3000") == [131072, 262144, 3000]
    for text in ("", "12x", "0", "-5"):
        with pytest.raises(ValueError, match=r"length"):
            parse_lengths(text)


@pytest.mark.parametrize(("seq_len", "count"), [(262144, 64), (131072, 64), (100, 64), (5, 64)])
def test_sampled_rows_include_the_last_rows_and_row_0(seq_len: int, count: int) -> None:
    rows = sample_rows(seq_len, count)
    assert rows == sorted(set(rows))
    assert len(rows) == min(count, seq_len)
    assert rows[0] == 0
    assert rows[-1] == seq_len - 1
    assert set(range(seq_len - min(8, len(rows)), seq_len)) <= set(rows)
    assert all(0 <= r < seq_len for r in rows)
    if seq_len > 1000:  # one row in each of count - 9 equal spans (row 0 and 8 last apart)
        span = seq_len / (count - 9)
        assert max(b - a for a, b in itertools.pairwise(rows)) < 2 * span + 1


# ---------------------------------------------------------------------------- parsers, report

MEMCHECK_LOG = """\
========= COMPUTE-SANITIZER
SWEEP ok branches/g1/dense (1.0 s)
========= Invalid __global__ read of size 2 bytes
=========     at sel_fwd_kernel+0x1a40 in forward.py:210
=========     by thread (3,0,0) in block (77,0,0)
SWEEP FAIL branches/g3/varlen: RuntimeError: CUDA error: unspecified launch failure
========= ERROR SUMMARY: 3 errors
"""

RACECHECK_LOG = """\
========= COMPUTE-SANITIZER
SWEEP ok a (1.0 s)
SWEEP ok b (1.0 s)
SWEEP kernels found=m.x_kernel,m.y_kernel,m.z_kernel
SWEEP kernels launched=m.x_kernel
========= RACECHECK SUMMARY: 2 hazards displayed (0 errors, 2 warnings)
========= ERROR SUMMARY: 0 errors
"""


def test_parse_sanitizer() -> None:
    mem = parse_sanitizer(MEMCHECK_LOG)
    assert mem.errors == 3
    assert mem.race_errors is None
    assert mem.first_finding == "Invalid __global__ read of size 2 bytes"
    race = parse_sanitizer(RACECHECK_LOG)
    assert (race.errors, race.race_errors, race.race_warnings) == (0, 0, 2)
    assert race.first_finding == ""
    unfinished = parse_sanitizer("========= COMPUTE-SANITIZER\nSWEEP ok a (1 s)\n")
    assert unfinished.errors is None, "no ERROR SUMMARY line: the tool did not finish"
    race_only = parse_sanitizer(
        "========= RACECHECK SUMMARY: 3 hazards displayed (1 error, 2 warnings)\n"
    )
    assert (race_only.errors, race_only.race_errors, race_only.race_warnings) == (1, 1, 2)
    two = parse_sanitizer("ERROR SUMMARY: 1 error\nERROR SUMMARY: 2 errors\n")
    assert two.errors == 3, "one summary per process checked: they add up"


RACES_LOG = """\
========= COMPUTE-SANITIZER
SWEEP ok core/g3/dense (2.7 s)
SWEEP kernels found=m.sel_fwd_kernel,m.combine_fwd_kernel
SWEEP kernels launched=m.sel_fwd_kernel,m.combine_fwd_kernel
========= Error: Race reported between Write access at fmha_f(K<bf16, (int)64>::Params)+0xa7f0
=========     and Read access at fmha_f(K<bf16, (int)64>::Params)+0x5ac0 [224 hazards]
=========
========= Warning: Race reported between Write access at combine_fwd_kernel+0x10
=========     and Read access at combine_fwd_kernel+0x20 [2 hazards]
=========
========= Error: Race reported between Read access at fmha_f(K<bf16, (int)64>::Params)+0x300
=========     and Write access at fmha_f(K<bf16, (int)64>::Params)+0x6af0 [64 hazards]
=========
========= RACECHECK SUMMARY: 3 hazards displayed (2 errors, 1 warning)
"""


def test_sanitizer_errors_are_tied_to_the_kernel_they_are_in() -> None:
    assert kernel_name("fmha_f(K<cutlass::bf16>::Params)") == ("fmha_f")
    assert kernel_name("sel_fwd_kernel") == "sel_fwd_kernel"
    # Each error block once, by its first location; warnings are not errors.
    assert finding_kernels(RACES_LOG) == {"fmha_f": 2}
    assert finding_kernels(MEMCHECK_LOG) == {"sel_fwd_kernel": 1}
    assert parse_sanitizer(RACES_LOG).kernels == (("fmha_f", 2),)


def test_errors_only_in_kernels_not_ours_are_reported_apart(tmp_path: Path) -> None:
    plain = parse_sweep(RACES_LOG)

    def verdict(text: str) -> tuple[str, dict[str, Any], list[str]]:
        log = tmp_path / "racecheck_0.log"
        log.write_text(text)
        child = Child("racecheck 0", [], log, 60.0, returncode=86, wall_s=1.0)
        return tool_verdict("racecheck", [child], plain)

    line, details, failures = verdict(RACES_LOG)
    assert failures == []
    assert details["errors"] == 0
    assert details["errors_in_other_kernels"] == {"fmha_f": 2}
    assert "racecheck 0 errors + 2 in kernels not ours (fmha_f x2)" in line
    # The same hazard in one of this project's kernels fails the part.
    ours = RACES_LOG.replace("fmha_f(K<bf16, (int)64>::Params)", "sel_fwd_kernel")
    line, details, failures = verdict(ours)
    assert details["errors"] == 2
    assert failures[0].startswith("racecheck: 2 errors")
    # An error the log ties to no kernel counts as ours.
    untied = RACES_LOG.replace(
        "RACECHECK SUMMARY: 3 hazards displayed (2 errors",
        "RACECHECK SUMMARY: 4 hazards displayed (3 errors",
    )
    assert verdict(untied)[1]["errors"] == 1


def test_parse_sweep_and_coverage_over_shards() -> None:
    mem = parse_sweep(MEMCHECK_LOG)
    assert mem.ok == ("branches/g1/dense",)
    assert mem.failed == (
        ("branches/g3/varlen", "RuntimeError: CUDA error: unspecified launch failure"),
    )
    assert mem.found is None
    assert mem.missing() == [], "no coverage without the list of kernels found"
    race = parse_sweep(RACECHECK_LOG)
    assert race.found == frozenset({"m.x_kernel", "m.y_kernel", "m.z_kernel"})
    assert race.missing() == ["m.y_kernel", "m.z_kernel"]
    assert race.missing(["z_kernel"]) == ["m.y_kernel"]
    other = parse_sweep("SWEEP ok c (2 s)\nSWEEP kernels launched=m.y_kernel,m.z_kernel\n")
    merged = SweepSummary.merge([race, other, mem])
    assert merged.ok == ("a", "b", "c", "branches/g1/dense")
    assert len(merged.failed) == 1
    assert merged.missing() == [], "a kernel launched by any shard counts"


def test_shards_take_every_nth_item() -> None:
    items = list(range(10))
    slices = [shard_of(items, i, 3) for i in range(3)]
    assert slices == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert shard_of(items[:1], 2, 3) == []
    assert parse_shard("2/6") == (2, 6)
    for bad in ("6/6", "1", "a/b", "-1/2"):
        with pytest.raises(ValueError, match="I/N"):
            parse_shard(bad)


def test_children_spread_over_the_visible_gpus_one_each() -> None:
    assert visible_gpus("cpu", {"CUDA_VISIBLE_DEVICES": "0,1"}) == []
    assert visible_gpus("cuda", {"CUDA_VISIBLE_DEVICES": "2, 3"}) == ["2", "3"]
    assert visible_gpus("cuda", {"CUDA_VISIBLE_DEVICES": "1"}) == []  # one GPU: inherited


def test_run_children_pins_child_i_to_gpu_i_mod_n(tmp_path: Path) -> None:
    show = [sys.executable, "-c", "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES'))"]
    children = [Child(f"c{i}", show, tmp_path / f"c{i}.log", 60.0) for i in range(3)]
    run_children(children, dict(os.environ), "test", ["4", "7"])
    assert [c.log_path.read_text().strip() for c in children] == ["4", "7", "4"]
    assert [c.returncode for c in children] == [0, 0, 0]


def test_report_marks_a_missing_part_failed(tmp_path: Path) -> None:
    passed = PartResult("sanitize", "PASS", "memcheck 0 errors", 12.0, {"tools": ["a"]})
    write_part(tmp_path, passed)
    results = load_parts(tmp_path, ["sanitize", "long"])
    assert [r.status for r in results] == ["PASS", "FAIL"]
    assert "did not finish" in results[1].headline
    lines = summary_lines(results)
    assert lines[1].split()[:2] == ["sanitize", "PASS"]
    assert lines[2].split()[:2] == ["long", "FAIL"]
    assert lines[-1] == "GPU robustness: FAIL (long)"
    md = markdown_report(results)
    assert "| sanitize | PASS |" in md
    assert "| long | FAIL |" in md
    ok = summary_lines([passed])
    assert ok[-1] == "GPU robustness: PASS"


def test_report_command_exit_status(tmp_path: Path) -> None:
    write_part(tmp_path, PartResult("parity", "PASS", "200/200 cases pass", 1.0))
    assert main(["report", "--out", str(tmp_path), "--sections", "parity"]) == 0
    assert (tmp_path / "report.md").is_file()
    assert main(["report", "--out", str(tmp_path), "--sections", "parity long"]) == 1


def test_parity_verdict_needs_every_triton_backend_to_run_and_every_case() -> None:
    plan = make_plan(3, 3, GPU_LIMITS)
    args = argparse.Namespace(device="cuda", case=None, seed=3)
    ran = [
        Check(name.split("/")[0], name.split("/")[1], "pass", "o 1e-3")
        for name in REQUIRED_BACKENDS
    ]
    ran.append(Check("gated_combine", "triton_combine", "declined", "turned off"))
    results = {0: ran, 1: [*ran[:-1], Check("sliding_attention", "sdpa", "fail", "o 1 > 1e-2")]}
    verdict = parity_verdict(args, plan, plan.cases, results, [], {}, "replay", 0.0)
    assert verdict.status == "FAIL"
    assert verdict.headline.startswith("1/3 cases pass (seed 3)")
    assert any(
        "case 1 (seed 3; geometry" in f and "sliding_attention/sdpa" in f for f in verdict.failures
    )
    assert "gated_combine/triton_combine never ran: gated_combine/triton_combine: 0 run" in str(
        verdict.failures
    )
    assert "1 of 3 cases did not run" in verdict.failures
    every = {i: ran[:-1] for i in range(3)}
    assert parity_verdict(args, plan, plan.cases, every, [], {}, "r", 0.0).status == "PASS"


def test_every_name_the_script_imports_from_the_packages_exists() -> None:
    """The GPU parts import nsa_core/nsa_kernels names inside functions that only a GPU runs:
    a renamed function must fail here, on a CPU, not on the GPU host."""
    imports = [
        (node.module, alias.name)
        for path in sorted(PACKAGE.glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
        if node.module.split(".")[0] in ("nsa_core", "nsa_kernels")
    ]
    assert len(imports) > 20
    for module, name in imports:
        assert hasattr(importlib.import_module(module), name), f"{module}.{name}"


def test_the_script_runs_from_any_folder(tmp_path: Path) -> None:
    """The entry point finds its package from the checkout, whatever the working folder."""
    command = [sys.executable, str(SCRIPT), "plan", "--device", "cpu", "--cases", "3"]
    run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, check=True)
    assert run.stdout == describe_plan(make_plan(DEFAULT_SEED, 3, CPU_LIMITS)) + "\n"
    usage = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True)
    assert usage.returncode == 0
    assert "GPU robustness of the Triton kernels: compute-sanitizer" in usage.stdout


def test_shell_wrapper_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", str(ROOT / "ci" / "gpu_robustness.sh")], check=True)


# ---------------------------------------------------------------------------- real code paths


def _cpu_plan(*cases: ParityCase) -> ParityPlan:
    geometry = Geometry("float32", 1, 2, 16, 16, 8, 4, 8, 3, 5, True)
    return ParityPlan(0, CPU_LIMITS, (geometry,), (), cases)


@needs_interpreter
@pytest.mark.triton
def test_parity_case_runs_the_triton_backends_and_passes() -> None:
    rt = setup_runtime("cpu")
    plan = _cpu_plan(
        ParityCase(0, 0, 1, 21, 5, None, 1),
        ParityCase(1, 0, 1, 22, 0, (1, 12, 0, 9), 2),
    )
    for case in plan.cases:
        checks = run_parity_case(rt, plan, case, ParityOptions(flex_geometries=1))
        status = {f"{c.op}/{c.backend}": c.status for c in checks}
        for name in (*REQUIRED_BACKENDS, "select_blocks/triton_score+lse"):
            assert status[name] == "pass", [c for c in checks if c.status == "fail"]
        assert status["sliding_attention/sdpa"] == "pass"
        assert status["sliding_attention/flex"] == "declined"
        assert not [c for c in checks if c.status == "fail"]


@needs_interpreter
@pytest.mark.triton
def test_parity_catches_a_wrong_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend 1% off the reference, or one that breaks the graph, is reported as failed."""
    from nsa_core import registry
    from nsa_core.reference import sliding_attention
    from nsa_core.registry import Backend

    def off(q: Any, k: Any, v: Any, window: int, scale: Any, **kw: Any) -> torch.Tensor:
        kw.pop("toggles")
        return sliding_attention(q, k, v, window, scale, **kw) * 1.01

    def detached(q: Any, k: Any, v: Any, window: int, scale: Any, **kw: Any) -> torch.Tensor:
        return off(q, k, v, window, scale, **kw).detach() / 1.01

    rt = setup_runtime("cpu")
    fakes = [
        Backend("sliding_attention", name, fn, lambda ctx, t: None, priority=-1)
        for name, fn in (("off_by_one_percent", off), ("detached", detached))
    ]
    # Registered for this test only (the registry has no removal; monkeypatch restores it).
    rows = registry.backends("sliding_attention")
    monkeypatch.setitem(registry._backends, "sliding_attention", [*rows, *fakes])
    plan = _cpu_plan(ParityCase(0, 0, 2, 9, 0, None, 3))
    checks = run_parity_case(rt, plan, plan.cases[0], ParityOptions(flex_geometries=0))
    by_name = {c.backend: c for c in checks}
    assert by_name["off_by_one_percent"].status == "fail"
    assert "o 1.0" in by_name["off_by_one_percent"].detail
    assert by_name["detached"].status == "fail"
    assert "detached" in by_name["detached"].detail
    assert by_name["sdpa"].status == "pass"


@needs_interpreter
@pytest.mark.triton
def test_sweep_case_runs_and_its_kernel_launch_is_recorded(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert run_sweep("cpu", "quick/") == 0
    out = parse_sweep(capsys.readouterr().out)
    assert out.ok == ("quick/dense_varlen",)
    assert [k.rsplit(".", 1)[1] for k in out.launched] == ["quick_fwd_kernel"]
    assert out.found is None, "a filtered sweep reports no coverage"
    rt = setup_runtime("cpu")
    names = [name for name, _ in sweep_cases(rt)]
    assert len(names) == len(set(names))
    with kernel_launches() as (kernels, launched):
        dict(sweep_cases(rt))["quick/dense_varlen"]()
    assert len(kernels) >= 15, "every Triton kernel of nsa_kernels is found"
    assert [k.rsplit(".", 1)[1] for k in launched] == ["quick_fwd_kernel"]
    from nsa_kernels.selected import quick

    assert not isinstance(quick.quick_fwd_kernel, LaunchRecorder), "restored after the block"


FAKE_SANITIZER = """#!/bin/sh
# compute-sanitizer --tool TOOL --error-exitcode N --print-limit M TARGET...: runs TARGET; memcheck
# then reports one finding.
tool="$2"; code="$4"; shift 6
echo "========= COMPUTE-SANITIZER"
"$@"; rc=$?
if [ "$tool" = memcheck ]; then
  echo "========= Invalid __global__ write of size 4 bytes"
  echo "=========     at some_kernel+0x10"
  echo "========= ERROR SUMMARY: 1 error"; exit "$code"
fi
echo "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"
echo "========= ERROR SUMMARY: 0 errors"
exit $rc
"""


@needs_interpreter
@pytest.mark.triton
def test_sanitize_part_end_to_end(tmp_path: Path) -> None:
    """The sweep plainly and under each tool; a tool's finding fails the part, with its line."""
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(FAKE_SANITIZER)
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    env = {**os.environ, "COMPUTE_SANITIZER": str(fake)}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "packages" / p / "src") for p in ("nsa-core", "nsa-kernels", "nsa-bench")]
        + [env.get("PYTHONPATH", "")]
    )
    command = [sys.executable, str(SCRIPT), "sanitize", "--device", "cpu", "--case", "quick/"]
    command += ["--shards", "1"]
    run = subprocess.run(
        [*command, "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 1, run.stderr
    result = load_parts(tmp_path, ["sanitize"])[0]
    assert result.status == "FAIL"
    assert result.details["sweep_cases"] == 1
    assert result.details["memcheck"]["errors"] == 1
    assert result.details["racecheck"]["errors"] == 0
    assert result.details["racecheck"]["sweep_ok"] == 1
    assert result.failures == [
        "memcheck: 1 errors; first: Invalid __global__ write of size 4 bytes"
    ]
    assert result.headline.startswith("memcheck 1 errors; racecheck 0 errors (0 race warnings)")
