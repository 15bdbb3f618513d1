"""``nsa-bench`` refuses bad command lines as usage errors: exit 2, the sub-command's usage, the
flag and the rule it breaks on stderr, never a traceback; and every flag is spelled kebab-case.

The rows run on a host without a GPU whatever this one has: torch's CUDA check is patched to see
none (and TRITON_INTERPRET is unset unless a row sets it), so the GPU refusals are tested
everywhere and no row ever reaches a bench.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nsa_bench import cli, decode_bench
from nsa_bench.cli import COMMANDS, build_parsers, checked_args, main
from nsa_bench.cli_args import UsageError

ROOT = Path(__file__).resolve().parents[3]
KEBAB = re.compile(r"--[a-z0-9]+(-[a-z0-9]+)*")

# command -> rows of (arguments after the command, what stderr must say). Each expected text
# names the flag and the rule; "{tmp}" in an argument is a folder of the test's own. A row may
# end with environment variables to set (TRITON_INTERPRET=1 reaches the checks after the GPU's).
Row = tuple[list[str], str] | tuple[list[str], str, dict[str, str]]
INTERP = {"TRITON_INTERPRET": "1"}
BAD_INPUTS: dict[str, list[Row]] = {
    "demo": [
        (["--steps", "-3"], "argument --steps: '-3' is not a positive integer"),
        (["--prefill", "0"], "argument --prefill: '0' is not a positive length"),
        (["--heads", "6"], "--heads (6) must be a multiple of --kv-heads (4)"),
        (["--dk", "33"], "--dk must be even for the rotary embedding, got 33"),
        (["--device", "cuda"], "argument --device: 'cuda' needs a CUDA GPU (torch sees none)"),
        (["--device", "tpu"], "argument --device: 'tpu' is not a device (cpu, cuda or cuda:N)"),
        (["--groups", "4"], "unrecognized arguments: --groups 4"),
    ],
    "cmp": [
        ([], "--methods triton needs a CUDA GPU (torch sees none), or TRITON_INTERPRET=1"),
        (["--methods", "reference,flex", "--window", "8"], "--methods flex needs a CUDA GPU"),
        (["--methods", "triton,flash"], "argument --methods: unknown 'flash'; choose from"),
        (["--methods", "sdpa", "--window", "8"], "--methods: sdpa cannot time the sliding branch"),
        (["--methods", "reference", "--window", "-8"], "argument --window: '-8' is not an int"),
        (["--methods", "reference", "--seqlens", "8k,-64"], "argument --seqlens: '-64' is not a"),
        (["--methods", "reference", "--heads", "6"], "--heads (6) must be a multiple of --kv-h"),
        (["--methods", "reference", "--cmp-stride", "24"], "--cmp-block (32) must be a multiple"),
        (["--configs", "block_m=16;tile=8"], "--configs: unknown CmpConfig field 'tile'", INTERP),
        (["--T", "512"], "unrecognized arguments: --T 512"),
    ],
    "cp": [
        (["--world-sizes", "1,0"], "argument --world-sizes: '0' is not a positive integer"),
        (["--heads", "64"], "argument --heads: '64' is not A/B (two positive integers)"),
        (["--head-dims", "192/-128"], "argument --head-dims: '192/-128' is not A/B"),
        (["--sel-exchanges", "bogus"], "argument --sel-exchanges: unknown 'bogus'"),
        (["--heads", "6/4"], "--heads HQ (6) must be a multiple of --heads H (4)"),
        (["--timeout-s", "0"], "argument --timeout-s: '0' is not a positive number"),
        (["--device", "cuda"], "argument --device: 'cuda' needs a CUDA GPU (torch sees none)"),
    ],
    "decode": [
        ([], "nsa-bench decode needs a CUDA GPU (torch sees none)"),
        (["--no-layer"], "nsa-bench decode needs a CUDA GPU (torch sees none)"),
        (["--batch-sizes", "1,0"], "argument --batch-sizes: '0' is not a positive integer"),
        (["--seqlens", "64k,x"], "argument --seqlens: 'x' is not a positive length"),
        (["--iters", "0"], "argument --iters: '0' is not a positive integer"),
        (["--B", "1", "--S", "4096"], "unrecognized arguments: --B 1 --S 4096"),
        (
            ["--ragged", "0:1k-2k"],
            "argument --ragged: need B >= 1 and 1 <= LO <= HI, got '0:1k-2k'",
        ),
        (
            ["--ragged", "32:2k-1k"],
            "argument --ragged: need B >= 1 and 1 <= LO <= HI, got '32:2k-1k'",
        ),
        (["--ragged", "32"], "argument --ragged: expected B:LO-HI such as 32:1k-128k, got '32'"),
        (["--page-size", "0"], "argument --page-size: '0' is not a positive integer"),
    ],
    "decode-module": [
        (["--seqlens", ""], "argument --seqlens: '' holds no value; give at least one"),
        (["--iters", "0"], "argument --iters: '0' is not a positive integer"),
        (["--warmup", "-1"], "argument --warmup: '-1' is not an integer >= 0"),
        (["--cmp-stride", "24"], "--cmp-stride (24) must divide --cmp-block (32)"),
        (["--num-selected", "2"], "--num-selected must be >= 3"),
        (["--S_list", "512"], "unrecognized arguments: --S_list 512"),
    ],
    "needle": [
        ([], "the following arguments are required: --out"),
        (["--out", "{tmp}/o", "--variants", "nsa,bogus"], "argument --variants: unknown 'bogus'"),
        (["--out", "{tmp}/o", "--steps", "0"], "argument --steps: '0' is not a positive integer"),
        (["--out", "{tmp}/o", "--depths", "0.5,1.5"], "argument --depths: '1.5' is not a number"),
        (["--out", "{tmp}/o", "--ckpt", "{tmp}/none"], "argument --ckpt: no such folder"),
        (["--out", "{tmp}/o", "--eval-only"], "--eval-only needs --ckpt DIR"),
        (["--out", "{tmp}/o", "--train-len", "40"], "--train-len: T=40 is too short"),
        (["--out", "{tmp}/o", "--heads", "5"], "--heads (5) must be a multiple of --kv-heads (2)"),
        (["--out", "{tmp}/o", "--lr", "-1"], "argument --lr: '-1' is not a positive number"),
    ],
    "layer": [
        (["--seqlens", "-64"], "argument --seqlens: '-64' is not a positive length"),
        (["--methods", "bogus"], "argument --methods: unknown 'bogus'; choose from nsa_core"),
        (["--modes", "bwd"], "argument --modes: unknown 'bwd'; choose from fwd, fwdbwd"),
        (["--head-dims", "128"], "argument --head-dims: '128' is not A/B"),
        (["--head-dims", "33/32"], "--head-dims dk (33/32) must be even"),
        (["--merge", "{tmp}/none.csv"], "argument --merge: no such file"),
        (["--step-backends", "sliding"], "argument --step-backends: takes STEP=BACKEND pairs"),
        (["--rep-ms", "0"], "argument --rep-ms: '0' is not a positive number"),
    ],
    "fa2": [
        (["--seqlens", "0"], "argument --seqlens: '0' is not a positive length"),
        (["--methods", "fa3"], "argument --methods: unknown 'fa3'; choose from fa2, flex"),
        (["--branches", "dense"], "argument --branches: unknown 'dense'; choose from sliding"),
        (["--head-dims", "64/64"], "argument --head-dims: '64/64' is not a positive integer"),
        (["--heads", "6"], "--heads (6) must be a multiple of --kv-heads (4)"),
        (["--min-speedup", "nan"], "argument --min-speedup: 'nan' is not a positive number"),
        (["--warmup", "25"], "unrecognized arguments: --warmup 25"),
    ],
    "routing": [
        (["--seq-len", "0"], "argument --seq-len: '0' is not a positive length"),
        (["--heads", "6"], "--heads (6) must be a multiple of --kv-heads (4)"),
        (["--dk", "33"], "--dk must be even for the rotary embedding, got 33"),
        (["--kv-heads", "x"], "argument --kv-heads: 'x' is not a positive integer"),
        (["--groups", "4"], "unrecognized arguments: --groups 4"),
    ],
    "score": [
        ([], "the Triton scoring kernel needs a CUDA GPU (torch sees none), or TRITON_INTERPRET"),
        (["--seqlens", "0"], "argument --seqlens: '0' is not a positive length"),
        (["--num-selected", "0"], "argument --num-selected: '0' is not a positive integer"),
        (["--lse", "maybe"], "argument --lse: invalid choice: 'maybe'"),
        # Under Triton's interpreter the run gets past the GPU check to the geometry's.
        (["--cmp-stride", "24"], "--cmp-block (32) must be a multiple of --cmp-stride", INTERP),
        (["--heads", "6"], "--heads (6) must be a multiple of --kv-heads (4)", INTERP),
        (["--config", "warps=four"], "--config: ScoreConfig field 'warps' needs an int", INTERP),
        (["--l_sel", "64"], "unrecognized arguments: --l_sel 64"),
    ],
    "sel": [
        (["--methods", "bogus"], "argument --methods: unknown 'bogus'; choose from triton"),
        (["--pass", "bwd"], "argument --pass: unknown 'bwd'; choose from fwd, fwd_bwd"),
        (["--prefill"], "--mode prefill needs a CUDA GPU (torch sees none)"),
        (["--prefill", "--mode", "rows"], "--prefill contradicts --mode rows"),
        (["--configs", "block_l=64"], "--configs: read in prefill mode only"),
        (["--probe"], "--probe: read in prefill mode only (--mode prefill)"),
        (["--query-rows", "0"], "argument --query-rows: '0' is not a positive integer"),
        (["--heads", "6", "--kv-heads", "4"], "--heads (6) must be a multiple of --kv-heads (4)"),
        (["--indices", "{tmp}/none.pt"], "argument --indices: no such file"),
        (["--L_list", "64"], "unrecognized arguments: --L_list 64"),
    ],
    "summarize": [
        ([], "the following arguments are required: csv"),
        (["{tmp}/none.csv"], "argument csv: no such file"),
        (["{tmp}"], "argument csv: '{tmp}' is a folder, not a file"),
        (["{tmp}/other.csv"], "csv: '{tmp}/other.csv' is not a decode-module CSV: no column S"),
    ],
}

# A good command line of each command that runs on a CPU (decode runs on none).
GOOD_ON_CPU: dict[str, list[str]] = {
    "demo": ["--prefill", "1k", "--steps", "3"],
    "cmp": ["--methods", "reference,sdpa"],
    "cp": ["--device", "cpu"],
    "decode-module": [],
    "needle": ["--out", "{tmp}/o"],
    "layer": ["--head-dims", "192/128"],
    "fa2": [],
    "routing": [],
    "score": [],  # under the Triton interpreter, set below
    "sel": ["--methods", "sdpa,reference"],
    "summarize": ["{tmp}/decode.csv"],
}


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process sees no CUDA GPU and runs Triton compiled, as a plain CPU host does."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    """A folder with a CSV that is not a decode-module CSV, and one that is."""
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    (tmp_path / "decode.csv").write_text(
        "S,ms_total,ms_cmp,ms_sel,ms_win,reads_actual,reads_expected\n512,1.0,0.2,0.3,0.1,9,9\n"
    )
    return tmp_path


def _rows() -> list[tuple[str, list[str], str, dict[str, str]]]:
    rows = []
    for command, bad in BAD_INPUTS.items():
        for row in bad:
            env = row[2] if len(row) == 3 else {}
            rows.append((command, row[0], row[1], env))
    return rows


@pytest.mark.parametrize(
    ("command", "argv", "says", "env"),
    _rows(),
    ids=[f"{c}:{' '.join(a) or '(no flags)'}" for c, a, _, _ in _rows()],
)
def test_bad_input_is_a_usage_error(
    command: str,
    argv: list[str],
    says: str,
    env: dict[str, str],
    tmp: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)

    def passed_every_check() -> None:  # main's step after the checks: a row that gets here fails
        raise AssertionError(f"{command} {argv} passed every check; it would run")

    monkeypatch.setattr(cli, "register_kernels", passed_every_check)
    with pytest.raises(SystemExit) as exit_info:
        main([command, *(a.replace("{tmp}", str(tmp)) for a in argv)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert says.replace("{tmp}", str(tmp)) in err
    assert err.startswith("usage: nsa-bench"), err
    assert "Traceback" not in err


def test_every_command_has_three_bad_inputs() -> None:
    assert set(BAD_INPUTS) == set(COMMANDS)
    few = {c: len(rows) for c, rows in BAD_INPUTS.items() if len(rows) < 3}
    assert not few, f"commands with fewer than three bad-input rows: {few}"


def test_every_flag_is_kebab_case() -> None:
    """Every option string of every sub-command: --lower-case-words (and argparse's own -h)."""
    parser, subparsers = build_parsers()
    assert set(subparsers) == set(COMMANDS)
    bad = {}
    for name, sub in [("nsa-bench", parser), *subparsers.items()]:
        # argparse lists a parser's arguments only in its (private) _actions.
        flags = [s for action in sub._actions for s in action.option_strings]
        assert flags, name
        wrong = [s for s in flags if s != "-h" and not KEBAB.fullmatch(s)]
        if wrong:
            bad[name] = wrong
    assert not bad, f"flags not spelled --kebab-case: {bad}"


def test_only_decode_needs_a_gpu_for_every_run() -> None:
    assert [name for name, c in COMMANDS.items() if c.needs_cuda] == ["decode"]


@pytest.mark.parametrize("command", sorted(GOOD_ON_CPU))
def test_good_input_passes_the_checks_on_a_cpu_host(
    command: str, tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checks refuse only what is wrong: each command that runs on a CPU keeps a command line
    that does (parsed and checked here, not run)."""
    if command == "score":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    argv = [a.replace("{tmp}", str(tmp)) for a in GOOD_ON_CPU[command]]
    assert checked_args([command, *argv]).command == command


def test_decode_checks_its_shape_and_kernel_config() -> None:
    """decode's own checks, which main reaches only where a GPU is (the CUDA check comes first)."""
    parser = build_parsers()[0]
    with pytest.raises(UsageError, match=r"--heads \(6\) must be a multiple of --kv-heads \(4\)"):
        decode_bench.check_arguments(parser.parse_args(["decode", "--heads", "6"]))
    with pytest.raises(UsageError, match="--config: unknown DecodeKernelConfig field 'tile'"):
        decode_bench.check_arguments(parser.parse_args(["decode", "--config", "tile=32"]))
    decode_bench.check_arguments(parser.parse_args(["decode", "--config", "key_tile=32"]))


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m nsa_bench.cli ARGV`` in a fresh process that sees no GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "packages" / p / "src") for p in ("nsa-core", "nsa-kernels", "nsa-bench")]
        + [env.get("PYTHONPATH", "")]
    )
    command = [sys.executable, "-m", "nsa_bench.cli", *argv]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def test_real_process_bad_size_exits_2_without_traceback() -> None:
    run = _cli("demo", "--steps", "-3")
    assert run.returncode == 2, run.stderr
    assert "argument --steps: '-3' is not a positive integer" in run.stderr
    assert "Traceback" not in run.stderr
    assert run.stdout == ""  # refused before the demo printed anything


def test_real_process_gpu_only_command_exits_2_without_traceback() -> None:
    run = _cli("score", "--seqlens", "1k")
    assert run.returncode == 2, run.stderr
    assert "the Triton scoring kernel needs a CUDA GPU (torch sees none)" in run.stderr
    assert "Traceback" not in run.stderr
