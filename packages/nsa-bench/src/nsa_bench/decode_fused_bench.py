"""``nsa-bench decode-fused``: the fused Triton decode step (CUDA graph replay) vs dense SDPA.

``nsa-bench decode-fused --B 1,32 --S 4096,16384,65536,131072`` prints one JSON line
per (B, S) and a summary of the targets: at S = 64k the step is >= 6x faster than SDPA with
``enable_gqa=True`` over the full cache at B = 32 and >= 2x at B = 1, and at B = 1 it grows by
< 1.5x from the smallest to the largest S. Both sides are timed as CUDA graph replays (median
over repeats of ``--iters`` replays, CUDA events); every NSA replay advances the sequences by
one token, as decoding does. ``--sweep`` tries a small grid of tiles, warps and stages per shape
and reports the best; ``--config "key_tile=32,warps=8"`` fixes one; ``--profile`` adds a
per-kernel table (eager steps under torch.profiler).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections.abc import Callable
from dataclasses import fields, replace
from typing import TYPE_CHECKING

import torch

from nsa_core import NSAConfig, expected_reads, num_cmp_blocks

if TYPE_CHECKING:
    # The decode kernels load Triton; the CLI imports this module to build its parser.
    from nsa_kernels.decode.graph import DecodeGraph
    from nsa_kernels.decode.state import DecodeState
    from nsa_kernels.decode.step import DecodeKernelConfig, StepInputs

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_kernel_config(text: str) -> DecodeKernelConfig:
    """``"key_tile=32,warps=8"`` -> DecodeKernelConfig (unnamed fields stay 0 = choose)."""
    from nsa_kernels.decode.step import DecodeKernelConfig

    names = {f.name for f in fields(DecodeKernelConfig)}
    values: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, raw = item.partition("=")
        if name not in names:
            raise ValueError(f"unknown DecodeKernelConfig field {name!r}; known: {sorted(names)}")
        values[name] = int(raw)
    return DecodeKernelConfig(**values)


def filled_state(
    cfg: NSAConfig, batch: int, length: int, capacity: int, dtype: torch.dtype
) -> DecodeState:
    """A state whose B sequences hold ``length`` random tokens (random K~/V~ as well)."""
    from nsa_kernels.decode.state import DecodeState

    state = DecodeState.empty(cfg, batch, capacity, device="cuda", dtype=dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for buf in (state.k_slc, state.v_slc, state.k_win, state.v_win, state.k_raw, state.v_raw):
        buf.normal_(generator=gen)
    state.k_cmp.normal_(generator=gen)
    state.v_cmp.normal_(generator=gen)
    state.cache_seqlens.fill_(length)
    state.num_cmp.fill_(num_cmp_blocks(length, cfg.cmp_block, cfg.cmp_stride))
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
    """Median over ``repeats`` of the mean time of ``iters`` back-to-back replays (ms)."""
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


def sdpa_ms(
    cfg: NSAConfig, batch: int, length: int, dtype: torch.dtype, args: argparse.Namespace
) -> float:
    """Dense decode: one query per sequence over all ``length`` keys, GQA in the kernel."""
    hq, h = cfg.num_q_heads, cfg.num_kv_heads
    q = torch.randn(batch, hq, 1, cfg.head_dim_qk, device="cuda", dtype=dtype)
    k = torch.randn(batch, h, length, cfg.head_dim_qk, device="cuda", dtype=dtype)
    v = torch.randn(batch, h, length, cfg.head_dim_v, device="cuda", dtype=dtype)

    def run() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph_ms(graph.replay, args.iters, args.repeats)


def nsa_ms(
    state: DecodeState, kernel_cfg: DecodeKernelConfig, args: argparse.Namespace
) -> tuple[float, DecodeGraph]:
    from nsa_kernels.decode.graph import DecodeGraph

    saved = state.snapshot_counters()
    graph = DecodeGraph(state, config=kernel_cfg)
    graph.inputs.copy_(random_inputs(state))
    for _ in range(3):
        graph.replay()
    ms = graph_ms(graph.replay, args.iters, args.repeats)
    torch.cuda.synchronize()
    state.restore_counters(saved)
    return ms, graph


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--B", default="1,32", help="batch sizes")
    parser.add_argument("--S", default="4096,16384,65536,131072", help="context lengths")
    parser.add_argument("--HQ", type=int, default=64, help="query heads")
    parser.add_argument("--H", type=int, default=4, help="kv heads")
    parser.add_argument("--dk", type=int, default=128, help="query/key head dim")
    parser.add_argument("--dv", type=int, default=128, help="value head dim")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--iters", type=int, default=100, help="replays per timing")
    parser.add_argument("--repeats", type=int, default=5, help="timings; the median is kept")
    parser.add_argument("--config", default="", help='kernel config, e.g. "key_tile=32,warps=8"')
    parser.add_argument("--sweep", action="store_true", help="try a grid of tiles/warps/stages")
    parser.add_argument(
        "--sweep-chunks", action="store_true", help="try compressed chunk sizes (cmp_chunk_tiles)"
    )
    parser.add_argument("--profile", action="store_true", help="per-kernel CUDA times")
    parser.add_argument("--no-sdpa", action="store_true", help="skip the dense baseline")


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("the fused decode bench needs a CUDA GPU; none is visible to torch")
        return 2
    dtype = DTYPES[args.dtype]
    cfg = NSAConfig(
        num_q_heads=args.HQ, num_kv_heads=args.H, head_dim_qk=args.dk, head_dim_v=args.dv
    )
    base = parse_kernel_config(args.config)
    rows = []
    for batch in (int(x) for x in args.B.split(",")):
        for length in (int(x) for x in args.S.split(",")):
            capacity = length + args.iters * (args.repeats + 1) + 64
            state = filled_state(cfg, batch, length, capacity, dtype)
            grid = {**(SWEEP if args.sweep else {}), **(CHUNK_SWEEP if args.sweep_chunks else {})}
            candidates = sweep_configs(base, grid) if grid else [base]
            timed = []
            for kernel_cfg in candidates:
                ms, graph = nsa_ms(state, kernel_cfg, args)
                timed.append((ms, kernel_cfg, graph.plan.describe()))
                reads = graph.outputs.reads_total.float().mean().item()
                del graph
            ms, best_cfg, plan_text = min(timed, key=lambda x: x[0])
            dense = None if args.no_sdpa else sdpa_ms(cfg, batch, length, dtype, args)
            row: dict[str, object] = {
                "B": batch,
                "S": length,
                "ms_nsa": round(ms, 5),
                "ms_sdpa": None if dense is None else round(dense, 5),
                "speedup": None if dense is None else round(dense / ms, 3),
                "reads_per_head": reads,
                # The last replay ran at position S + 3 warm replays + iters * repeats - 1.
                "reads_expected": expected_reads(length + 2 + args.iters * args.repeats, cfg),
                "plan": plan_text,
                "device": torch.cuda.get_device_name(),
            }
            if grid:
                row["sweep"] = [
                    {"ms": round(t, 5), "config": {k: getattr(c, k) for k in grid}}
                    for t, c, _ in sorted(timed, key=lambda x: x[0])
                ]
            print(json.dumps(row), flush=True)
            if args.profile:
                print(profile_table(state, best_cfg), flush=True)
            rows.append(row)
            del state
            torch.cuda.empty_cache()
    print(json.dumps({"targets": targets(rows)}), flush=True)
    return 0


def targets(rows: list[dict[str, object]]) -> dict[str, object]:
    """The step's performance targets, judged on the rows measured (None where not measured)."""

    def find(batch: int, length: int) -> dict[str, object] | None:
        return next((r for r in rows if r["B"] == batch and r["S"] == length), None)

    out: dict[str, object] = {}
    for batch, need in ((32, 6.0), (1, 2.0)):
        row = find(batch, 65536)
        speed = None if row is None else row["speedup"]
        out[f"B{batch}_S64k_speedup>={need}"] = (
            None if not isinstance(speed, float) else {"speedup": speed, "ok": speed >= need}
        )
    b1 = sorted((r for r in rows if r["B"] == 1), key=lambda r: int(str(r["S"])))
    if len(b1) >= 2:
        growth = float(str(b1[-1]["ms_nsa"])) / float(str(b1[0]["ms_nsa"]))
        out[f"B1_growth_S{b1[0]['S']}_to_S{b1[-1]['S']}<1.5"] = {
            "growth": round(growth, 3),
            "ok": growth < 1.5,
        }
    return out
