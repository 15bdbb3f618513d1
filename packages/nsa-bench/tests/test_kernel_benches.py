"""``nsa-bench cmp``, ``score`` and ``decode``: their host-side logic and tiny CPU runs.

The Triton runs are marked ``triton``: on CPU they need the interpreter (TRITON_INTERPRET=1, the
interpreter tier), on a GPU they compile.
"""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path

import pytest
import torch

from nsa_bench import cmp_bench, decode_bench, score_bench
from nsa_bench.cli import COMMANDS, build_parser
from nsa_bench.cli_args import UsageError
from nsa_core.reference.compressed_attention import compressed_attention

RUNS_TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
NEEDS_TRITON = pytest.mark.skipif(
    not RUNS_TRITON, reason="needs a CUDA GPU or the Triton interpreter (TRITON_INTERPRET=1)"
)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_cli_lists_the_kernel_benches() -> None:
    assert {"cmp", "score", "decode", "decode-module"} <= set(COMMANDS)
    assert COMMANDS["decode"].needs_cuda
    argv = ["decode", "--batch-sizes", "2,4", "--seqlens", "128,1k", "--no-graph"]
    args = build_parser().parse_args(argv)
    assert (args.batch_sizes, args.seqlens, args.command, args.graph) == (
        [2, 4],
        [128, 1024],
        "decode",
        False,
    )
    assert build_parser().parse_args(["decode"]).graph is True


def test_visible_pairs_is_the_sum_of_block_counts() -> None:
    want = sum(max(0, (t + 1 - 32) // 16 + 1) for t in range(1100))
    assert score_bench.visible_pairs(1100, 32, 16) == want
    assert score_bench.visible_pairs(31, 32, 16) == 0  # no row completes a block


def test_compressed_lse_matches_float64() -> None:
    """float32 chunks of 1024 rows against one float64 logsumexp; -inf where no block is seen."""
    gen = torch.Generator().manual_seed(0)
    l_cmp, d, tq, hq, h, dk = 32, 16, 1100, 6, 2, 32
    n = (tq - l_cmp) // d + 1
    q = torch.randn(1, tq, hq, dk, generator=gen)
    k = torch.randn(1, n, h, dk, generator=gen)
    got = score_bench.compressed_lse(q, k, l_cmp, d)
    logits = torch.einsum("bthd,bnhd->bthn", q.double(), k.double().repeat_interleave(3, dim=2))
    last = torch.arange(n) * d + l_cmp - 1
    visible = last[None, :] <= torch.arange(tq)[:, None]  # [T, N]
    logits = logits * dk**-0.5
    want = logits.masked_fill(~visible[None, :, None, :], -math.inf).logsumexp(-1)
    assert got.dtype == torch.float32
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert bool(torch.isinf(got[:, : l_cmp - 1]).all())
    assert bool(torch.isfinite(got[:, l_cmp - 1 :]).all())
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite].double(), want[finite], rtol=1e-5, atol=1e-5)


def test_sdpa_peer_matches_the_reference_where_rows_see_a_block() -> None:
    gen = torch.Generator().manual_seed(1)
    l_cmp, d, tq = 8, 4, 45
    n = (tq - l_cmp) // d + 1
    q = torch.randn(2, tq, 4, 16, generator=gen)
    k = torch.randn(2, n, 2, 16, generator=gen)
    v = torch.randn(2, n, 2, 8, generator=gen)
    got = cmp_bench.sdpa_chunked(q, k, v, l_cmp, d, chunk=16)  # three chunks, the last short
    want = compressed_attention(q, k, v, l_cmp, d)
    assert got.shape == want.shape == (2, tq, 4, 8)
    # Rows that see no block: SDPA's softmax over an empty row, NaN or 0 by backend (timing only).
    empty = got[:, : l_cmp - 1]
    assert bool(torch.isnan(empty).all()) or bool((empty == 0).all())
    assert torch.allclose(got[:, l_cmp - 1 :], want[:, l_cmp - 1 :], rtol=1e-5, atol=1e-5)


def _cmp_argv(out: Path, methods: str, *extra: str) -> list[str]:
    return ["cmp", "--seqlens", "40,64", "--heads", "4", "--kv-heads", "2", "--dk", "16",
            "--dv", "16", "--cmp-block", "8", "--cmp-stride", "4", "--dtype", "fp32",
            "--methods", methods, "--iters", "1", "--warmup", "0", "--device", DEVICE,
            "--csv", str(out), *extra]  # fmt: skip


def test_cmp_peers_on_cpu_write_csv(tmp_path: Path) -> None:
    out = tmp_path / "cmp.csv"
    argv = _cmp_argv(out, "reference,sdpa", "--baseline-max-t", "40", "--device", "cpu")
    assert cmp_bench.run(build_parser().parse_args(argv)) == 0
    rows = list(csv.DictReader(out.open()))
    # T = 64 is past --baseline-max-t, so only T = 40 is timed.
    assert [(r["T"], r["method"]) for r in rows] == [("40", "reference"), ("40", "sdpa")]
    assert all(r["blocks"] == "9" for r in rows)  # (40 - 8) // 4 + 1
    assert all(float(r["fwd_ms"]) > 0 and float(r["fwd_bwd_ms"]) > 0 for r in rows)
    assert all(math.isnan(float(r["bwd_ms"])) for r in rows)


def test_window_flops_count_each_rows_keys() -> None:
    # Rows t = 0..9 with w = 4 see 1, 2, 3, 4, 4, ... keys: 1 + 2 + 3 + 7 * 4 = 34.
    assert cmp_bench.window_flops(1, 10, 2, 8, 4, 4) == 2 * 2 * (8 + 4) * 34
    assert cmp_bench.window_flops(1, 3, 1, 8, 8, 100) == 2 * 16 * 6  # no row fills the window


def test_cmp_window_times_the_sliding_branch_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "cmp.csv"
    argv = _cmp_argv(out, "reference", "--window", "16", "--device", "cpu")
    assert cmp_bench.run(build_parser().parse_args(argv)) == 0
    rows = list(csv.DictReader(out.open()))
    assert [(r["T"], r["method"], r["blocks"]) for r in rows] == [
        ("40", "reference", "40"),  # k and v hold T tokens
        ("64", "reference", "64"),
    ]
    assert all(float(r["fwd_ms"]) > 0 and float(r["fwd_bwd_ms"]) > 0 for r in rows)
    args = build_parser().parse_args(_cmp_argv(out, "sdpa", "--window", "16"))
    # The compressed branch's SDPA peer has no sliding form.
    with pytest.raises(UsageError, match="sdpa cannot time the sliding branch"):
        cmp_bench.check_arguments(args)


@pytest.mark.triton
@NEEDS_TRITON
def test_cmp_triton_tiny(tmp_path: Path) -> None:
    out = tmp_path / "cmp.csv"
    argv = _cmp_argv(out, "triton", "--seqlens", "40", "--configs", "block_m=16;block_m=32")
    assert cmp_bench.run(build_parser().parse_args(argv)) == 0
    rows = list(csv.DictReader(out.open()))
    assert [r["method"] for r in rows] == ["triton", "triton"]
    assert "block_m=16" in rows[0]["config"]
    assert "block_m=32" in rows[1]["config"]
    assert all(float(r[c]) > 0 for r in rows for c in ("fwd_ms", "bwd_ms", "fwd_bwd_ms"))


@pytest.mark.triton
@NEEDS_TRITON
def test_cmp_window_triton_tiny(tmp_path: Path) -> None:
    out = tmp_path / "cmp.csv"
    argv = _cmp_argv(out, "triton", "--seqlens", "40", "--window", "8", "--configs", "block_m=16")
    assert cmp_bench.run(build_parser().parse_args(argv)) == 0
    rows = list(csv.DictReader(out.open()))
    assert [(r["method"], r["blocks"]) for r in rows] == [("triton", "40")]
    assert "block_m=16" in rows[0]["config"]
    assert float(rows[0]["fwd_ms"]) > 0
    assert float(rows[0]["fwd_bwd_ms"]) > 0


def test_cmp_sweep_reports_a_config_the_gpu_cannot_hold_and_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    errors = pytest.importorskip("triton.runtime.errors")

    def time_triton(
        p: cmp_bench.CmpProblem, config_text: str, timer: cmp_bench.Timer
    ) -> tuple[str, float, float, float]:
        if config_text == "block_n=128":
            raise errors.OutOfResources(262144, 232448, "shared memory")
        return config_text, 1.0, 2.0, 3.0

    monkeypatch.setattr(cmp_bench, "time_triton", time_triton)
    out = tmp_path / "cmp.csv"
    argv = _cmp_argv(out, "triton", "--seqlens", "40", "--configs", "block_n=128;block_m=32")
    assert cmp_bench.run(build_parser().parse_args(argv)) == 0
    assert [r["config"] for r in csv.DictReader(out.open())] == ["block_m=32"]
    printed = capsys.readouterr().out
    assert "config 'block_n=128': not run: out of resource: shared memory" in printed


@pytest.mark.triton
@NEEDS_TRITON
def test_score_triton_tiny(tmp_path: Path) -> None:
    out = tmp_path / "score.csv"
    argv = ["score", "--seqlens", "96", "--heads", "2", "--kv-heads", "1", "--dk", "16",
            "--num-selected", "2",
            "--dtype", "fp32", "--iters", "1", "--warmup", "0", "--device", DEVICE,
            "--csv", str(out)]  # fmt: skip
    assert score_bench.run(build_parser().parse_args(argv)) == 0
    rows = list(csv.DictReader(out.open()))
    assert [r["with_lse"] for r in rows] == ["True", "False"]
    work = 2.0 * 2 * 16 * score_bench.visible_pairs(96, 32, 16) / 1e12
    for row, passes in zip(rows, (1, 2), strict=True):
        assert float(row["qk_tflop"]) == pytest.approx(work)
        rate = work * passes / (float(row["ms"]) * 1e-3)
        assert float(row["tflops"]) == pytest.approx(rate)


def test_decode_kernel_config_and_sweep() -> None:
    cfg = decode_bench.parse_kernel_config("key_tile=32, warps=8")
    assert (cfg.key_tile, cfg.warps, cfg.stages) == (32, 8, 0)
    with pytest.raises(ValueError, match="unknown DecodeKernelConfig field 'tile'"):
        decode_bench.parse_kernel_config("tile=32")
    grid = decode_bench.SWEEP
    configs = decode_bench.sweep_configs(cfg, grid)
    assert len(configs) == math.prod(len(v) for v in grid.values())
    assert len(set(configs)) == len(configs)
    assert all(c.cmp_chunk_tiles == cfg.cmp_chunk_tiles for c in configs)


def test_decode_sweep_grid_names_fields_and_values() -> None:
    grid = decode_bench.parse_sweep_grid("sel_splits=2,4; cmp_chunk_tiles=8")
    assert grid == {"sel_splits": (2, 4), "cmp_chunk_tiles": (8,)}
    configs = decode_bench.sweep_configs(decode_bench.parse_kernel_config("warps=8"), grid)
    assert [(c.sel_splits, c.cmp_chunk_tiles, c.warps) for c in configs] == [
        (2, 8, 8),
        (4, 8, 8),
    ]
    assert decode_bench.parse_sweep_grid("") == {}
    with pytest.raises(ValueError, match="unknown DecodeKernelConfig field 'splits'"):
        decode_bench.parse_sweep_grid("splits=2")
    with pytest.raises(ValueError, match="sel_splits: values must be integers"):
        decode_bench.parse_sweep_grid("sel_splits=2,x")
    with pytest.raises(ValueError, match="warps: no values"):
        decode_bench.parse_sweep_grid("warps=")


def test_decode_targets_judge_the_measured_rows() -> None:
    rows: list[dict[str, object]] = [
        {"B": 1, "S": 4096, "ms_step": 0.02, "speedup": 1.5},
        {"B": 1, "S": 65536, "ms_step": 0.025, "speedup": 2.5},
        {"B": 32, "S": 65536, "ms_step": 0.2, "speedup": 5.0},
    ]
    got = decode_bench.targets(rows)
    assert got["B32_S64k_speedup>=6.0"] == {"speedup": 5.0, "ok": False}
    assert got["B1_S64k_speedup>=2.0"] == {"speedup": 2.5, "ok": True}
    assert got["B1_growth_S4096_to_S65536<1.5"] == {"growth": 1.25, "ok": True}
    assert decode_bench.targets(rows[:1]) == {
        "B32_S64k_speedup>=6.0": None,
        "B1_S64k_speedup>=2.0": None,
    }


def test_decode_markdown_and_failed_rows() -> None:
    ok = {
        "B": 1, "S": 4096, "ms_step": 0.03, "ms_layer": 0.05, "tokens_per_s": 20000.0,
        "ms_sdpa": 0.06, "ms_fa2": None, "ms_dense_layer": 0.08, "speedup": 2.0,
        "layer_speedup": 1.6, "reads_total": 1761.0, "reads_expected": 1761,
    }  # fmt: skip
    oom = {"B": 32, "S": 131072, "status": "oom: CUDA out of memory"}
    table = decode_bench.markdown([ok, oom]).splitlines()
    assert len(table) == 4
    assert "| 1 | 4096 | 0.03 | 0.05 | 20000.0 | 0.06 | n/a | 0.08 | 2.0 | 1.6 |" in table[2]
    assert table[3].startswith("| 32 | 131072 | oom: CUDA out of memory |")
    assert decode_bench.targets([ok, oom])["B32_S64k_speedup>=6.0"] is None
