"""``nsa-bench decode``: NSA decode at real shapes, the fused step and the whole layer step.

For every batch B (``--batch-sizes``, default 1, 8, 32) and context length S (``--seqlens``,
default 4k to 128k), at HQ=64, H=4, dk=dv=128, bf16 by default, the B sequences hold S random
tokens and every timed call advances them by one token, as decoding does:

- ``ms_step``: the attention step alone, nsa-kernels' fused ``decode_step`` (append, compress,
  score, top-n, three branches, gated combine) on q/K/V/gates already projected;
- ``ms_layer``: the whole ``NSAAttention`` layer step through ``LayerDecoder`` (q/K/V/gate
  projections, RoPE at each sequence's device-side position, the fused step, the output
  projection) at ``--hidden``; ``tokens_per_s`` = B / ms_layer, one GPU;
- baselines, in the same run: ``ms_sdpa`` dense decode with torch SDPA and ``enable_gqa=True``
  over all S keys (no repeated kv heads), ``ms_fa2`` FlashAttention-2's
  ``flash_attn_with_kvcache`` where flash_attn is installed, and ``ms_dense_layer`` a dense
  layer step of the same hidden size (q/K/V/output projections around the better dense
  attention);
- reads: the keys each branch's softmax covered per (sequence, kv head) at the last step
  (``reads_cmp``, ``reads_sel``, ``reads_win``), their sum against ``expected_reads``.

With ``--graph`` (the default) every step is one CUDA graph replayed token after token (median
over ``--repeats`` timings of ``--iters`` back-to-back replays, CUDA events); ``--no-graph``
times eager steps. ``speedup`` is the better dense baseline over ``ms_step``,
``layer_speedup`` the dense layer over ``ms_layer``. Under ``--out`` (default
``artifacts/bench/decode``): ``decode.csv``, ``decode.json`` (rows, environment, arguments,
targets), ``decode.png`` (ms against S, one panel per B; needs matplotlib) and ``decode.md``,
printed last. ``--sweep`` / ``--sweep-chunks`` try tiles, warps, stages and compressed chunk
sizes per shape and keep the best, ``--sweep-grid "sel_splits=2,4;warps=4,8"`` any grid of
config fields; ``--config "key_tile=32,warps=8"`` fixes one;
``--profile`` prints a per-kernel table (eager steps under torch.profiler).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nsa_bench.cli_args import (
    check_tile_configs,
    head_config,
    non_negative_int,
    positive_int,
    positive_ints,
    seqlens,
)
from nsa_bench.decode_ragged import parse_ragged
from nsa_bench.env import collect
from nsa_bench.timing import warm_then_capture
from nsa_core import NSAAttention, NSAConfig, expected_reads, num_cmp_blocks

if TYPE_CHECKING:
    # The decode kernels load Triton; the CLI imports this module to build its parser.
    from nsa_kernels.decode.graph import DecodeGraph
    from nsa_kernels.decode.layer import LayerDecoder
    from nsa_kernels.decode.state import DecodeState, PageTable
    from nsa_kernels.decode.step import DecodeKernelConfig, StepInputs

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _config_field(name: str) -> str:
    """``name`` if DecodeKernelConfig has that field, else ValueError listing the fields."""
    from nsa_kernels.decode.step import DecodeKernelConfig

    names = {f.name for f in fields(DecodeKernelConfig)}
    if name not in names:
        raise ValueError(f"unknown DecodeKernelConfig field {name!r}; known: {sorted(names)}")
    return name


def parse_kernel_config(text: str) -> DecodeKernelConfig:
    """``"key_tile=32,warps=8"`` -> DecodeKernelConfig (unnamed fields stay 0 = choose)."""
    from nsa_kernels.decode.step import DecodeKernelConfig

    values: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, raw = item.partition("=")
        values[_config_field(name)] = int(raw)
    return DecodeKernelConfig(**values)


def parse_sweep_grid(text: str) -> dict[str, tuple[int, ...]]:
    """``"sel_splits=2,4;warps=4,8"`` -> {field: values} of DecodeKernelConfig fields."""
    grid: dict[str, tuple[int, ...]] = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        name, _, raw = item.partition("=")
        name = _config_field(name.strip())
        try:
            grid[name] = tuple(int(v) for v in raw.split(",") if v.strip())
        except ValueError:
            raise ValueError(f"{name}: values must be integers, got {raw!r}") from None
        if not grid[name]:
            raise ValueError(f"{name}: no values")
    return grid


def filled_state(
    cfg: NSAConfig,
    lengths: Sequence[int],
    capacity: int,
    dtype: torch.dtype,
    pages: PageTable | None = None,
) -> DecodeState:
    """A state whose sequence b holds ``lengths[b]`` random tokens (random K~/V~ as well);
    ``pages``: its selected K/V in pages (``DecodeState.empty``)."""
    from nsa_kernels.decode.state import DecodeState

    state = DecodeState.empty(cfg, len(lengths), capacity, device="cuda", dtype=dtype, pages=pages)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for buf in (state.k_sel, state.v_sel, state.k_win, state.v_win, state.k_raw, state.v_raw):
        buf.normal_(generator=gen)
    state.k_cmp.normal_(generator=gen)
    state.v_cmp.normal_(generator=gen)
    state.cache_seqlens.copy_(torch.tensor(list(lengths), dtype=torch.int32))
    blocks = [num_cmp_blocks(n, cfg.cmp_block, cfg.cmp_stride) for n in lengths]
    state.num_cmp.copy_(torch.tensor(blocks, dtype=torch.int32))
    return state


def random_inputs(state: DecodeState) -> StepInputs:
    """Random step inputs for ``state``: every field normal, the gates through a sigmoid."""
    from nsa_kernels.decode.step import StepInputs

    inputs = StepInputs.zeros(state)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for f in fields(inputs):
        getattr(inputs, f.name).normal_(generator=gen)
    inputs.gates.sigmoid_()
    return inputs


def graph_ms(replay: Callable[[], object], iters: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean time of ``iters`` back-to-back calls (ms)."""
    times: list[float] = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        for _ in range(iters):
            replay()
        end.record()
        torch.cuda.synchronize()
        times.append(float(start.elapsed_time(end)) / iters)
    return statistics.median(times)


def _captured(fn: Callable[[], object], graph: bool) -> Callable[[], object]:
    """``fn`` warmed up, then as a CUDA graph replay (``graph``) or as it is."""
    return warm_then_capture(lambda: fn, warmup=3, graph=graph)


def load_flash_kvcache() -> Callable[..., torch.Tensor] | None:
    """FlashAttention-2's ``flash_attn_with_kvcache``, or None where flash_attn is missing."""
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        return None
    fn: Callable[..., torch.Tensor] = flash_attn_with_kvcache
    return fn


class DenseDecode:
    """Dense decode baselines over a cache of ``length`` keys per sequence (no NSA).

    k/v are [B, H, S, d] for SDPA (``enable_gqa=True``: no repeated kv heads) and [B, S, H, d]
    for FlashAttention-2 (``cache_seqlens`` = S, GQA in the kernel).
    """

    def __init__(
        self, cfg: NSAConfig, batch: int, length: int, dtype: torch.dtype, hidden: int
    ) -> None:
        hq, h, dk, dv = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim_qk, cfg.head_dim_v
        self.cfg, self.batch, self.length = cfg, batch, length
        gen = torch.Generator(device="cuda").manual_seed(2)

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)

        self.q = randn(batch, hq, 1, dk)
        self.k = randn(batch, h, length, dk)
        self.v = randn(batch, h, length, dv)
        self.x = randn(batch, hidden)
        self.q_proj = torch.nn.Linear(hidden, hq * dk, bias=False, device="cuda", dtype=dtype)
        self.kv_proj = torch.nn.Linear(
            hidden, h * (dk + dv), bias=False, device="cuda", dtype=dtype
        )
        self.o_proj = torch.nn.Linear(hq * dv, hidden, bias=False, device="cuda", dtype=dtype)
        self.flash = load_flash_kvcache()
        self.k_flash: torch.Tensor | None = None
        self.v_flash: torch.Tensor | None = None
        self.seqlens = torch.full((batch,), length, device="cuda", dtype=torch.int32)
        if self.flash is not None and dk == dv:
            self.k_flash = self.k.transpose(1, 2).contiguous()
            self.v_flash = self.v.transpose(1, 2).contiguous()

    def sdpa(self, q: torch.Tensor | None = None) -> torch.Tensor:
        """o [B, HQ, 1, dv]: one query per sequence over all S keys."""
        return torch.nn.functional.scaled_dot_product_attention(
            self.q if q is None else q, self.k, self.v, enable_gqa=True
        )

    def fa2(self, q: torch.Tensor | None = None) -> torch.Tensor:
        """o [B, 1, HQ, dv] with ``flash_attn_with_kvcache``."""
        assert self.flash is not None
        assert self.k_flash is not None
        q4 = (self.q if q is None else q).transpose(1, 2)  # [B, 1, HQ, dk]
        return self.flash(q4, self.k_flash, self.v_flash, cache_seqlens=self.seqlens, causal=True)

    @property
    def has_fa2(self) -> bool:
        return self.k_flash is not None

    def layer(self, attention: str) -> torch.Tensor:
        """A dense layer step: projections around the chosen attention (``sdpa`` or ``fa2``).

        The new token's K/V are projected (their cost counted) but not appended: the dense
        side is timed on a cache that does not grow, which favours it slightly.
        """
        cfg = self.cfg
        q = self.q_proj(self.x).view(self.batch, cfg.num_q_heads, 1, cfg.head_dim_qk)
        self.kv_proj(self.x)
        o = self.sdpa(q) if attention == "sdpa" else self.fa2(q).transpose(1, 2)
        out: torch.Tensor = self.o_proj(o.reshape(self.batch, -1))
        return out


def nsa_step_ms(
    state: DecodeState,
    kernel_cfg: DecodeKernelConfig,
    args: argparse.Namespace,
    *,
    tokens: int | None = None,
) -> tuple[float, DecodeGraph | None, Any]:
    """The fused attention step: ms per step; the state's counters are restored afterwards.
    ``tokens``: the batch's total tokens, for the plan's chunks (``DecodePlan``)."""
    from nsa_kernels.decode.graph import DecodeGraph
    from nsa_kernels.decode.step import DecodePlan, decode_step

    saved = state.snapshot_counters()
    inputs = random_inputs(state)
    if args.graph:
        graph = DecodeGraph(state, config=kernel_cfg, tokens=tokens)
        graph.inputs.copy_(inputs)
        for _ in range(3):
            graph.replay()
        ms = graph_ms(graph.replay, args.iters, args.repeats)
        outputs: Any = graph.outputs
    else:
        graph = None
        plan = DecodePlan(state, kernel_cfg, tokens=tokens)
        box: list[Any] = []

        def eager() -> None:
            box[:] = [decode_step(state, inputs, plan=plan)]

        for _ in range(3):
            eager()
        ms = graph_ms(eager, args.iters, args.repeats)
        outputs = box[0]
    torch.cuda.synchronize()
    state.restore_counters(saved)
    return ms, graph, outputs


def nsa_layer_ms(
    layer: NSAAttention,
    state: DecodeState,
    kernel_cfg: DecodeKernelConfig,
    args: argparse.Namespace,
) -> float:
    """The whole layer step through LayerDecoder: ms per step; the state is restored."""
    from nsa_kernels.decode.layer import LayerDecoder

    saved = state.snapshot_counters()
    decoder: LayerDecoder = LayerDecoder(layer, state, config=kernel_cfg, graph=args.graph)
    gen = torch.Generator(device="cuda").manual_seed(3)
    decoder.x.normal_(generator=gen)
    for _ in range(3):
        decoder.replay()
    ms = graph_ms(decoder.replay, args.iters, args.repeats)
    torch.cuda.synchronize()
    state.restore_counters(saved)
    return ms


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--batch-sizes", type=positive_ints, default="1,8,32", help="batch sizes B, comma-separated"
    )
    parser.add_argument(
        "--seqlens", type=seqlens, default="4k,16k,64k,128k", help="context lengths S (8192 or 8k)"
    )
    parser.add_argument("--heads", type=positive_int, default=64, help="query heads HQ")
    parser.add_argument("--kv-heads", type=positive_int, default=4, help="kv heads H")
    parser.add_argument("--dk", type=positive_int, default=128, help="query/key head dim")
    parser.add_argument("--dv", type=positive_int, default=128, help="value head dim")
    parser.add_argument(
        "--hidden", type=positive_int, default=2048, help="hidden size of the layer step"
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--iters", type=positive_int, default=100, help="steps per timing")
    parser.add_argument(
        "--repeats", type=positive_int, default=5, help="timings; the median is kept"
    )
    parser.add_argument(
        "--graph",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time CUDA graph replays (default) or eager steps (--no-graph)",
    )
    parser.add_argument("--config", default="", help='kernel config, e.g. "key_tile=32,warps=8"')
    parser.add_argument("--sweep", action="store_true", help="try a grid of tiles/warps/stages")
    parser.add_argument(
        "--sweep-chunks", action="store_true", help="try compressed chunk sizes (cmp_chunk_tiles)"
    )
    parser.add_argument(
        "--sweep-grid",
        default="",
        metavar="FIELD=A,B;...",
        help="try every combination of these DecodeKernelConfig values, e.g. "
        '"sel_splits=2,4;cmp_chunk_tiles=8,16" (with --sweep/--sweep-chunks: their grids too)',
    )
    parser.add_argument("--profile", action="store_true", help="per-kernel CUDA times")
    parser.add_argument("--no-sdpa", action="store_true", help="skip the dense baselines")
    parser.add_argument("--no-layer", action="store_true", help="skip the layer steps")
    parser.add_argument(
        "--ragged",
        type=parse_ragged,
        default=None,
        metavar="B:LO-HI",
        help="instead of the grid: B sequences of lengths spread over LO..HI, paged and dense, "
        "against a uniform batch of the same tokens (e.g. 32:1k-128k)",
    )
    parser.add_argument(
        "--page-size", type=positive_int, default=256, help="tokens a page (--ragged)"
    )
    parser.add_argument(
        "--replays",
        type=non_negative_int,
        default=1000,
        help="graph replays checked bit for bit against eager steps (--ragged; 0: none)",
    )
    parser.add_argument("--out", default="artifacts/bench/decode", help="output folder")


def check_arguments(args: argparse.Namespace) -> None:
    """The heads and head dims make an NSA config and ``--config`` names known fields (the CLI
    runs this after its CUDA check: the config's type comes with the Triton kernels)."""
    head_config(args)
    check_tile_configs("--config", parse_kernel_config, [args.config])
    check_tile_configs("--sweep-grid", parse_sweep_grid, [args.sweep_grid])


CSV_COLUMNS = (
    "B", "S", "ms_step", "ms_layer", "tokens_per_s", "ms_sdpa", "ms_fa2", "ms_dense_layer",
    "speedup", "layer_speedup", "reads_cmp", "reads_sel", "reads_win", "reads_total",
    "reads_expected", "plan", "device",
)  # fmt: skip


def _progress(text: str) -> None:
    print(f"[decode] {text}", file=sys.stderr, flush=True)


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 5)


def measure_case(
    cfg: NSAConfig, batch: int, length: int, base: DecodeKernelConfig, args: argparse.Namespace
) -> dict[str, Any]:
    """One (B, S) row: NSA step and layer step, dense baselines, reads."""
    dtype = DTYPES[args.dtype]
    # Every timing advances the sequences and restores them; the capacity holds the longest run.
    capacity = length + args.iters * (args.repeats + 1) + 64
    state = filled_state(cfg, [length] * batch, capacity, dtype)
    grid = {
        **(SWEEP if args.sweep else {}),
        **(CHUNK_SWEEP if args.sweep_chunks else {}),
        **parse_sweep_grid(args.sweep_grid),
    }
    candidates = sweep_configs(base, grid) if grid else [base]
    timed = []
    for kernel_cfg in candidates:
        ms, graph, outputs = nsa_step_ms(state, kernel_cfg, args)
        plan_text = graph.plan.describe() if graph is not None else ""
        reads = outputs.reads.float().mean(dim=(1, 2)).tolist()  # [3]: cmp, sel, win
        timed.append((ms, kernel_cfg, plan_text, reads))
        del graph, outputs
    ms, best_cfg, plan_text, reads = min(timed, key=lambda x: x[0])
    ms_layer = None
    if not args.no_layer:
        torch.manual_seed(4)
        layer = NSAAttention(cfg, hidden_size=args.hidden).to("cuda", dtype)
        ms_layer = nsa_layer_ms(layer, state, best_cfg, args)
        del layer
    dense_sdpa = dense_fa2 = dense_layer = None
    if not args.no_sdpa:
        dense = DenseDecode(cfg, batch, length, dtype, args.hidden)
        dense_sdpa = graph_ms(_captured(dense.sdpa, args.graph), args.iters, args.repeats)
        if dense.has_fa2:
            dense_fa2 = graph_ms(_captured(dense.fa2, args.graph), args.iters, args.repeats)
        best = "fa2" if dense_fa2 is not None and dense_fa2 < dense_sdpa else "sdpa"
        dense_layer = graph_ms(
            _captured(lambda: dense.layer(best), args.graph), args.iters, args.repeats
        )
        del dense
    best_dense = min(x for x in (dense_sdpa, dense_fa2) if x is not None) if dense_sdpa else None
    # The last timed step ran at position S + 3 warm steps + iters * repeats - 1.
    last_position = length + 2 + args.iters * args.repeats
    row: dict[str, Any] = {
        "B": batch,
        "S": length,
        "ms_step": _round(ms),
        "ms_layer": _round(ms_layer),
        "tokens_per_s": None if ms_layer is None else round(batch * 1e3 / ms_layer, 1),
        "ms_sdpa": _round(dense_sdpa),
        "ms_fa2": _round(dense_fa2),
        "ms_dense_layer": _round(dense_layer),
        "speedup": None if best_dense is None else round(best_dense / ms, 3),
        "layer_speedup": (
            None if dense_layer is None or ms_layer is None else round(dense_layer / ms_layer, 3)
        ),
        "reads_cmp": reads[0],
        "reads_sel": reads[1],
        "reads_win": reads[2],
        "reads_total": sum(reads),
        "reads_expected": expected_reads(last_position, cfg),
        "plan": plan_text,
        "device": torch.cuda.get_device_name(),
    }
    if grid:
        row["sweep"] = [
            {"ms": round(t, 5), "config": {k: getattr(c, k) for k in grid}}
            for t, c, _, _ in sorted(timed, key=lambda x: x[0])
        ]
    if args.profile:
        print(profile_table(state, best_cfg), flush=True)
    del state
    torch.cuda.empty_cache()
    return row


def run(args: argparse.Namespace) -> int:
    cfg = head_config(args)
    base = parse_kernel_config(args.config)
    if args.ragged is not None:
        from nsa_bench.decode_ragged import run_ragged

        return run_ragged(args, cfg, base)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cases = [(b, s) for b in args.batch_sizes for s in args.seqlens]
    rows: list[dict[str, Any]] = []
    for i, (batch, length) in enumerate(cases, 1):
        _progress(f"case {i}/{len(cases)}: B={batch} S={length}")
        try:
            row = measure_case(cfg, batch, length, base, args)
        except torch.cuda.OutOfMemoryError as exc:
            row = {"B": batch, "S": length, "status": f"oom: {str(exc).splitlines()[0]}"}
            torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
        rows.append(row)
        write_outputs(rows, args, out)
    table = markdown(rows)
    print(table)
    print(json.dumps({"targets": targets(rows)}), flush=True)
    return 0


def write_outputs(rows: list[dict[str, Any]], args: argparse.Namespace, out: Path) -> None:
    """decode.csv, decode.json, decode.md and (with matplotlib) decode.png, rewritten per case."""
    with open(out / "decode.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=[*CSV_COLUMNS, "status"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    meta = {
        "env": collect(nvidia_smi=None),
        "args": {
            k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, list))
        },
        "rows": rows,
        "targets": targets(rows),
    }
    (out / "decode.json").write_text(json.dumps(meta, indent=1))
    (out / "decode.md").write_text(markdown(rows) + "\n")
    try:
        from nsa_bench.plot import plot_ms_vs_t
    except ImportError:
        _progress("matplotlib is not installed: no decode.png (pip install nsa-bench[plot])")
        return
    series: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for row in rows:
        panel = series.setdefault(f"B={row['B']}", {})
        for key, label in (
            ("ms_step", "nsa step"),
            ("ms_layer", "nsa layer"),
            ("ms_sdpa", "sdpa step"),
            ("ms_fa2", "fa2 step"),
            ("ms_dense_layer", "dense layer"),
        ):
            if row.get(key) is not None:
                panel.setdefault(label, []).append((int(row["S"]), float(row[key])))
    plot_ms_vs_t(series, out / "decode.png", "NSA decode step vs dense decode (ms per token)")


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as one Markdown table (ms per step, speedups over the better dense baseline)."""
    head = (
        "| B | S | NSA step ms | NSA layer ms | tokens/s | SDPA ms | FA-2 ms | dense layer ms "
        "| step speedup | layer speedup | reads/head (expected) |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )

    def cell(x: object) -> str:
        return "n/a" if x is None else str(x)

    lines = [head]
    for r in rows:
        if "status" in r:
            lines.append(f"| {r['B']} | {r['S']} | {r['status']} |" + " |" * 8)
            continue
        lines.append(
            f"| {r['B']} | {r['S']} | {cell(r['ms_step'])} | {cell(r['ms_layer'])} "
            f"| {cell(r['tokens_per_s'])} | {cell(r['ms_sdpa'])} | {cell(r['ms_fa2'])} "
            f"| {cell(r['ms_dense_layer'])} | {cell(r['speedup'])} | {cell(r['layer_speedup'])} "
            f"| {r['reads_total']:.0f} ({r['reads_expected']}) |"
        )
    return "\n".join(lines)


SWEEP = {
    "key_tile": (32, 64),
    "warps": (4, 8),
    "stages": (1, 2, 3),
}


CHUNK_SWEEP = {"cmp_chunk_tiles": (1, 2, 4, 8, 16, 32)}


def sweep_configs(
    base: DecodeKernelConfig, grid: dict[str, tuple[int, ...]]
) -> list[DecodeKernelConfig]:
    keys = list(grid)
    return [
        replace(base, **dict(zip(keys, values, strict=True)))
        for values in itertools.product(*(grid[k] for k in keys))
    ]


def profile_table(state: DecodeState, kernel_cfg: DecodeKernelConfig) -> str:
    """CUDA time per kernel over 20 eager steps (the state is restored afterwards)."""
    from torch.profiler import ProfilerActivity, profile

    from nsa_kernels.decode.step import DecodePlan, decode_step

    saved = state.snapshot_counters()
    plan = DecodePlan(state, kernel_cfg)
    inputs = random_inputs(state)
    decode_step(state, inputs, plan=plan)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            decode_step(state, inputs, plan=plan)
        torch.cuda.synchronize()
    state.restore_counters(saved)
    table: str = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)
    return table


def targets(rows: list[dict[str, object]]) -> dict[str, object]:
    """The step's performance targets, judged on the rows measured (None where not measured)."""

    def find(batch: int, length: int) -> dict[str, object] | None:
        return next(
            (r for r in rows if r["B"] == batch and r["S"] == length and "status" not in r), None
        )

    out: dict[str, object] = {}
    for batch, need in ((32, 6.0), (1, 2.0)):
        row = find(batch, 65536)
        speed = None if row is None else row["speedup"]
        out[f"B{batch}_S64k_speedup>={need}"] = (
            None if not isinstance(speed, float) else {"speedup": speed, "ok": speed >= need}
        )
    b1 = sorted(
        (r for r in rows if r["B"] == 1 and "status" not in r), key=lambda r: int(str(r["S"]))
    )
    if len(b1) >= 2:
        growth = float(str(b1[-1]["ms_step"])) / float(str(b1[0]["ms_step"]))
        out[f"B1_growth_S{b1[0]['S']}_to_S{b1[-1]['S']}<1.5"] = {
            "growth": round(growth, 3),
            "ok": growth < 1.5,
        }
    return out
