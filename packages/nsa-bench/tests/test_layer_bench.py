"""``nsa-bench layer`` on CPU: outputs and their columns, ratios from rows, refusals as rows."""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from nsa_bench.cases import failure_status
from nsa_bench.cli import build_parser
from nsa_bench.cli_args import names, pairs, seqlen
from nsa_bench.layer import cli as layer_cli
from nsa_bench.layer.inputs import make_inputs
from nsa_bench.layer.measure import measure
from nsa_bench.layer.peers import Peer, bench_fa2, bench_fla, bench_sdpa, load_fla, sdpa_has_gqa
from nsa_bench.layer.plot import write_plot
from nsa_bench.layer.rows import (
    DEFAULT_METHODS,
    METHODS,
    MODES,
    PEERS,
    ROW_COLUMNS,
    LayerShape,
    Row,
    add_ratios,
)
from nsa_bench.layer.steps import STEPS, StepCall, bench_steps, parse_step_backends, step_timed_call
from nsa_bench.timing import Timer, make_timer

CPU = torch.device("cpu")
TINY = ["--seqlens", "128", "--heads", "4/2", "--head-dims", "32/32", "--hidden-size", "32",
        "--dtype", "fp32", "--iters", "1", "--warmup", "0"]  # fmt: skip
FLA_REFUSAL = "Group size (HQ/H) must be a power of 2 and >= 16 in NSA"


def fake_parallel_nsa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> Any:
    """Stands in for fla-core's parallel_nsa: its group-size check, then a differentiable output."""
    group = q.shape[2] // k.shape[2]
    if group < 16 or group & (group - 1):
        # fla-core checks with an assert; pytest would rewrite one written here.
        raise AssertionError(FLA_REFUSAL)
    g = kwargs["g_cmp"] + kwargs["g_slc"]  # fla-core's keywords
    return v.repeat_interleave(group, dim=2) * g.unsqueeze(-1) + q[..., : v.shape[-1]]


def _shape(hq: int = 4, h: int = 2, dk: int = 32, dv: int = 32, t: int = 128) -> LayerShape:
    return LayerShape(1, t, hq, h, dk, dv, "fp32", 32, 16, 64, 16, 512)


def _host_timer() -> Timer:
    return make_timer(CPU, use_do_bench=False, warmup_ms=1, rep_ms=1, iters=1, warmup=0)


def _read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _capture(fn: Any) -> tuple[str, str]:
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert fn() == 0
    return out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def monkeypatch_module() -> Any:
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def cpu_run_module(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch_module: pytest.MonkeyPatch
) -> tuple[Path, str, str]:
    out = tmp_path_factory.mktemp("layer")
    monkeypatch_module.setattr(
        layer_cli, "load_fla", lambda: Peer(fake_parallel_nsa, "fla-core stand-in")
    )
    args = build_parser().parse_args(["layer", *TINY, "--out", str(out)])
    stdout, stderr = _capture(lambda: layer_cli.run(args))
    return out, stdout, stderr


def test_csv_has_every_column_and_the_env_in_every_row(
    cpu_run_module: tuple[Path, str, str],
) -> None:
    out, _, _ = cpu_run_module
    rows = _read_csv(out / "layer.csv")
    header = list(rows[0])
    assert header[: len(ROW_COLUMNS)] == ROW_COLUMNS
    env_columns = header[len(ROW_COLUMNS) :]
    assert env_columns == sorted(env_columns)
    assert {"env_torch", "env_triton", "env_gpu_name", "env_commit"} <= set(env_columns)
    for row in rows:
        assert row["env_torch"] == torch.__version__
        assert row["env_gpu_name"] == "none"


def test_rows_cover_every_method_mode_and_step(cpu_run_module: tuple[Path, str, str]) -> None:
    out, _, _ = cpu_run_module
    rows = _read_csv(out / "layer.csv")
    methods = {(r["method"], r["mode"]) for r in rows if r["kind"] == "method"}
    assert methods == {(m, mode) for m in DEFAULT_METHODS for mode in MODES}
    steps = [r for r in rows if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [s for s, _ in STEPS]
    assert len(rows) == 2 * len(DEFAULT_METHODS) + len(STEPS)
    for r in rows:
        assert (r["T"], r["HQ"], r["H"], r["G"], r["dk"], r["dv"]) == (
            "128",
            "4",
            "2",
            "2",
            "32",
            "32",
        )
        assert (r["cmp_block"], r["cmp_stride"], r["sel_block"]) == ("32", "16", "64")
        assert (r["num_selected"], r["window"], r["dtype"]) == ("16", "512", "fp32")


def test_nsa_rows_and_sdpa_are_timed(cpu_run_module: tuple[Path, str, str]) -> None:
    out, _, _ = cpu_run_module
    rows = _read_csv(out / "layer.csv")
    for r in rows:
        if r["method"] in ("nsa_core", "nsa_module", "sdpa") or r["kind"] == "step":
            assert r["status"] == "ok", r
            assert float(r["ms"]) > 0
            assert r["peak_mib"] == ""  # CPU: no CUDA allocator to ask
    module = [r for r in rows if r["method"] == "nsa_module"]
    assert all(r["hidden_size"] == "32" and "hidden_size=32" in r["note"] for r in module)
    sdpa = [r for r in rows if r["method"] == "sdpa"]
    assert all("enable_gqa=True" in r["note"] for r in sdpa)


def test_refused_and_missing_peers_are_rows_with_reasons(
    cpu_run_module: tuple[Path, str, str],
) -> None:
    out, stdout, _ = cpu_run_module
    rows = _read_csv(out / "layer.csv")
    fla = [r for r in rows if r["method"] == "fla"]
    assert len(fla) == 2
    for r in fla:
        assert r["status"] == f"refused: AssertionError: {FLA_REFUSAL}"
        assert r["ms"] == ""
        assert r["backend"] == "fla-core stand-in"
    for r in (r for r in rows if r["method"] == "fa2"):
        assert r["status"].startswith("skipped: ")
        assert "flash_attn" in r["status"] or "CUDA" in r["status"]
    assert "### Rows without a time" in stdout
    assert f"fla: refused: AssertionError: {FLA_REFUSAL} (2 cases" in stdout


def test_ratios_and_shares_are_computed_from_the_rows(
    cpu_run_module: tuple[Path, str, str],
) -> None:
    out, _, _ = cpu_run_module
    rows = _read_csv(out / "layer.csv")
    by = {(r["method"], r["mode"], r["step"]): r for r in rows}
    for mode in MODES:
        sdpa_ms = float(by["sdpa", mode, ""]["ms"])
        for method in ("nsa_core", "nsa_module", "sdpa"):
            row = by[method, mode, ""]
            assert float(row["vs_sdpa"]) == sdpa_ms / float(row["ms"])
            assert row["vs_fla"] == row["vs_fa2"] == ""  # those peers did not run
    core_fwd = float(by["nsa_core", "fwd", ""]["ms"])
    for step, _ in STEPS:
        row = by["nsa_core", "fwd", step]
        assert float(row["share"]) == float(row["ms"]) / core_fwd


def test_steps_name_the_routed_backend(cpu_run_module: tuple[Path, str, str]) -> None:
    out, _, stderr = cpu_run_module
    rows = _read_csv(out / "layer.csv")
    from nsa_core import registry

    for r in rows:
        if r["kind"] != "step":
            continue
        op = dict(STEPS)[r["step"]]
        if op in registry.OPS:
            assert r["backend"] == "reference"  # CPU: the reference serves every registry op
        else:
            assert r["backend"] == f"reference ({op} is not a registry op)"
    core = [r for r in rows if r["method"] == "nsa_core" and r["kind"] == "method"]
    for r in core:
        assert r["backend"] == ";".join(f"{op}=reference" for op in registry.OPS)
    # One progress line per row, each with its time or its status.
    progress = [line for line in stderr.splitlines() if line.startswith("[layer] dk/dv=")]
    assert len(progress) == len(rows)


def test_json_holds_the_csv_rows(cpu_run_module: tuple[Path, str, str]) -> None:
    out, _, _ = cpu_run_module
    rows = _read_csv(out / "layer.csv")
    records = json.loads((out / "layer.json").read_text())
    assert len(records) == len(rows)
    for rec, row in zip(records, rows, strict=True):
        assert list(rec) == list(row)
        assert {k: str(v) for k, v in rec.items()} == row


def test_markdown_is_printed_last_and_written(cpu_run_module: tuple[Path, str, str]) -> None:
    out, stdout, _ = cpu_run_module
    table = (out / "layer.md").read_text()
    assert stdout.rstrip("\n") == table.rstrip("\n")
    assert "| 32/32 | fwd | 128 |" in table
    assert "| 32/32 | fwdbwd | 128 |" in table
    assert "core vs sdpa" in table
    assert "### Where the core's time goes" in table


def test_png_is_written(cpu_run_module: tuple[Path, str, str]) -> None:
    pytest.importorskip("matplotlib", reason="the PNG needs matplotlib (nsa-bench[plot])")
    out, _, stderr = cpu_run_module
    png = (out / "layer.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    assert f"wrote {out / 'layer.png'}" in stderr


def test_without_matplotlib_the_png_is_reported_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "nsa_bench.plot", None)  # import now raises ImportError
    row = _shape().row("method", "sdpa", "fwd", ms=1.0)
    why = write_plot([row], tmp_path / "layer.png")
    assert why is not None
    assert why.startswith("PNG not written: ")
    assert "nsa-bench[plot]" in why
    assert not (tmp_path / "layer.png").exists()


def test_merge_rebuilds_the_outputs_from_csv(
    cpu_run_module: tuple[Path, str, str], tmp_path: Path
) -> None:
    out, _, _ = cpu_run_module
    merged = tmp_path / "merged"
    args = build_parser().parse_args(
        ["layer", "--merge", str(out / "layer.csv"), "--out", str(merged)]
    )
    stdout, _ = _capture(lambda: layer_cli.run(args))
    assert _read_csv(merged / "layer.csv") == _read_csv(out / "layer.csv")
    assert stdout == (out / "layer.md").read_text()


# ---------------------------------------------------------------------------------------------
# Pieces


def _row(method: str, ms: float, t: int = 1024, mode: str = "fwd", **kw: Any) -> Row:
    return _shape(t=t).row("method", method, mode, ms=ms, **kw)


def test_add_ratios_compares_within_one_case_only() -> None:
    rows = [
        _row("nsa_core", 2.0),
        _row("sdpa", 8.0),
        _row("fa2", 4.0),
        _row("fla", math.nan, status="refused: AssertionError: no"),
        _row("nsa_core", 3.0, mode="fwdbwd"),
        _row("sdpa", 30.0, mode="fwdbwd"),
        _row("nsa_core", 5.0, t=2048),
        _shape(t=1024).row("step", "nsa_core", "fwd", step="sliding", ms=0.5),
        _shape(t=2048).row("step", "nsa_core", "fwd", step="sliding", ms=1.0),
    ]
    add_ratios(rows)
    core, sdpa, fa2, fla, core_bwd, _, core_2k, step_1k, step_2k = rows
    assert (core.vs_sdpa, core.vs_fa2) == (4.0, 2.0)
    assert math.isnan(core.vs_fla)
    assert (sdpa.vs_sdpa, sdpa.vs_fa2, fa2.vs_sdpa) == (1.0, 0.5, 2.0)
    assert all(math.isnan(getattr(fla, f"vs_{p}")) for p in PEERS)
    assert core_bwd.vs_sdpa == 10.0
    assert all(math.isnan(getattr(core_2k, f"vs_{p}")) for p in PEERS)
    assert (step_1k.share, step_2k.share) == (0.25, 0.2)


def test_failure_status_names_the_kind_of_failure() -> None:
    oom = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8 GiB")
    assert failure_status(oom).startswith("oom: OutOfMemoryError: CUDA out of memory")
    assert failure_status(AssertionError("G >= 16")) == "refused: AssertionError: G >= 16"
    assert failure_status(ValueError("a\nb")) == "refused: ValueError: a b"
    assert failure_status(RuntimeError("x")) == "error: RuntimeError: x"


def test_an_out_of_memory_case_is_a_row_not_a_crash() -> None:
    def allocate() -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 80 GiB")

    row = measure(_row("sdpa", math.nan), allocate, [], _host_timer(), CPU)
    assert row.status.startswith("oom: ")
    assert math.isnan(row.ms)


def test_fla_peer_runs_when_it_accepts_and_reports_when_missing() -> None:
    shape = _shape(hq=32, h=2, t=128)  # G = 16: the stand-in accepts
    inp = make_inputs(shape, CPU, seed=0)
    ok = Peer(fake_parallel_nsa, "fla-core stand-in")
    for mode in MODES:
        row = bench_fla(shape, inp, mode, ok, _host_timer(), CPU)
        assert row.status == "ok", row
        assert row.ms > 0
    missing = Peer(None, "fla-core not importable (ModuleNotFoundError: No module named 'fla')")
    row = bench_fla(shape, inp, "fwd", missing, _host_timer(), CPU)
    assert row.status == "skipped: " + missing.info
    assert row.backend == missing.info


def test_the_real_fla_refuses_small_groups_with_its_reason() -> None:
    """Where fla-core is installed: its own group-size check surfaces as a refused row (the
    check runs before any kernel, so this needs no GPU)."""
    pytest.importorskip("fla.ops.nsa.parallel", reason="fla-core is not installed here")
    peer = load_fla()
    assert peer.fn is not None, peer.info
    assert peer.info.startswith("fla-core ")
    shape = _shape(hq=4, h=2)
    row = bench_fla(shape, make_inputs(shape, CPU, 0), "fwd", peer, _host_timer(), CPU)
    assert row.status == f"refused: AssertionError: {FLA_REFUSAL}"


def test_sdpa_without_enable_gqa_repeats_kv_heads_and_says_so() -> None:
    shape = _shape()
    inp = make_inputs(shape, CPU, seed=0)
    row = bench_sdpa(shape, inp, "fwdbwd", False, _host_timer(), CPU)
    assert row.status == "ok"
    assert "lacks enable_gqa" in row.note
    assert "repeat_interleave" in row.note
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    assert sdpa_has_gqa() == ((major, minor) >= (2, 5))


def test_fa2_is_skipped_off_cuda_with_the_reason() -> None:
    shape = _shape(dk=48, dv=32)
    inp = make_inputs(shape, CPU, seed=0)
    peer = Peer(lambda *a, **k: torch.zeros(()), "flash_attn stand-in")
    row = bench_fa2(shape, inp, "fwd", peer, _host_timer(), CPU)
    assert row.status == "skipped: FA-2 needs a CUDA device, this run is on cpu"
    assert "zero-padded from dv=32 to dk=48" in row.note


def test_a_failed_step_skips_the_steps_that_need_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import nsa_core

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("select_blocks broke")

    monkeypatch.setattr(nsa_core, "select_blocks", broken)
    shape = _shape()
    rows = bench_steps(shape, make_inputs(shape, CPU, 0), _host_timer(), CPU)
    status = {r.step: r.status for r in rows}
    assert status["select_blocks"] == "error: RuntimeError: select_blocks broke"
    assert status["selected"] == "skipped: needs the output of select_blocks, which failed"
    assert status["combine"] == "skipped: needs the output of selected, which failed"
    assert all(status[s] == "ok" for s in ("compress", "compressed", "sliding"))


def test_steps_time_forward_and_backward_and_pinned_backends() -> None:
    shape = _shape()
    inp = make_inputs(shape, CPU, 0)
    rows = bench_steps(
        shape, inp, _host_timer(), CPU, ("fwd", "fwdbwd"), [("sliding", "reference")]
    )
    names = [s for s, _ in STEPS] + ["sliding@reference"]
    assert [(r.mode, r.step) for r in rows] == [(m, n) for m in ("fwd", "fwdbwd") for n in names]
    for r in rows:
        assert r.status == "ok", r
        assert r.ms > 0, r
    assert {r.backend for r in rows if r.step.startswith("sliding")} == {"reference"}
    bad = bench_steps(shape, inp, _host_timer(), CPU, pins=[("sliding", "nope")])
    assert bad[-1].step == "sliding@nope"
    assert bad[-1].status.startswith("refused: ")
    assert "'nope'" in bad[-1].status


def test_a_step_in_fwdbwd_fills_the_grads_of_its_inputs() -> None:
    q = torch.randn(1, 8, 2, 4)
    k = torch.randn(1, 8, 2, 4)
    step = StepCall(lambda a, b: (a * b, a.sum()), (q, k), 1)
    call, leaves = step_timed_call(step, "fwdbwd", seed=0)
    assert call() is None
    assert len(leaves) == 2
    # d(a*b)/da = b times the upstream gradient, drawn once from the seed.
    upstream = torch.randn(q.shape, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(leaves[0].grad, k * upstream)
    torch.testing.assert_close(leaves[1].grad, q * upstream)
    no_grad = StepCall(lambda a, b: a + b, (q, k), 0)
    call, leaves = step_timed_call(no_grad, "fwdbwd", seed=0)
    assert leaves == []
    torch.testing.assert_close(call(), q + k)


def test_step_backends_are_parsed_and_checked() -> None:
    assert parse_step_backends("sliding=triton_win, selected=reference") == [
        ("sliding", "triton_win"),
        ("selected", "reference"),
    ]
    assert parse_step_backends("") == []
    for bad in ("sliding", "attention=x", "compress=reference", "sliding="):
        with pytest.raises(Exception, match=r"STEP=BACKEND|nothing to pin"):
            parse_step_backends(bad)


def test_parsers() -> None:
    assert [seqlen(x) for x in ("8k", "128K", "256", "1m")] == [
        8192,
        131072,
        256,
        1 << 20,
    ]
    assert pairs("128/128, 192/128") == [(128, 128), (192, 128)]
    with pytest.raises(Exception, match="not A/B"):
        pairs("128")
    with pytest.raises(Exception, match="unknown 'xformers'"):
        names(METHODS)("nsa_core,xformers")


# ---------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.slow(reason="the layer bench's short sweep compiles and times every step of the layer")
def test_gpu_layer_bench_short_sweep(tmp_path: Path) -> None:
    """T=4k..8k at the paper's heads, both head-dim pairs: every NSA row and SDPA timed, peak
    memory recorded, steps routed; fla and FA-2 timed or reported with their reasons."""
    args = build_parser().parse_args(
        ["layer", "--seqlens", "4k,8k", "--out", str(tmp_path), "--rep-ms", "20"]
    )
    stdout, stderr = _capture(lambda: layer_cli.run(args))
    print(stderr)
    print(stdout)
    rows = _read_csv(tmp_path / "layer.csv")
    for r in rows:
        if r["method"] in ("nsa_core", "nsa_module", "sdpa"):
            assert r["status"] == "ok", r
            assert float(r["ms"]) > 0
            assert float(r["peak_mib"]) > 0
        else:  # a peer is timed, or says why not
            assert r["status"] == "ok" or len(r["status"].split(": ", 1)[1]) > 0, r
    core = [r for r in rows if r["method"] == "nsa_core" and r["kind"] == "method"]
    assert all(r["vs_sdpa"] != "" for r in core)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "PNG not written" in stderr
    else:
        assert (tmp_path / "layer.png").exists()
