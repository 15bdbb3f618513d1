"""``nsa-bench decode-module``: one NSAAttention decode step per context length S, whole and
per branch, on any device (the reference ops on CPU).

For every S a fresh layer cache is filled by a prefill of S tokens; then the step at position S
is timed as a whole (projections, cache update, selection, three branches, combine) and each
branch alone on the same cache state: ``ms_cmp`` the compressed attention, ``ms_sel`` block
scoring + top-n + selected attention, ``ms_win`` the sliding attention. On CUDA the whole step is
timed as a CUDA graph replay; a dense-attention decode over all S+1 tokens is timed in the same
run as the baseline. CSV columns:
``S,ms_total,ms_cmp,ms_sel,ms_win,reads_actual,reads_expected``; a JSON file beside the CSV
holds the environment, the arguments and the dense baseline per S.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
from collections.abc import Callable
from pathlib import Path

import torch

from nsa_bench.cli_args import (
    BLOCK_FLAGS,
    add_batch_arg,
    add_device_arg,
    add_layer_blocks_args,
    add_seed_arg,
    block_geometry,
    head_config,
    non_negative_int,
    positive_int,
    seqlens,
)
from nsa_bench.timing import graph_median_ms, median_ms
from nsa_core import NSAAttention, NSACache, NSAConfig, select_blocks
from nsa_core.registry import OpContext, resolve
from nsa_core.toggles import get_toggles

CSV_COLUMNS = ("S", "ms_total", "ms_cmp", "ms_sel", "ms_win", "reads_actual", "reads_expected")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_batch_arg(parser)
    parser.add_argument("--dim", type=positive_int, default=256, help="hidden size")
    parser.add_argument("--heads", type=positive_int, default=8, help="query heads HQ")
    parser.add_argument("--kv-heads", type=positive_int, default=2, help="kv heads H")
    parser.add_argument("--dk", type=positive_int, default=32, help="query/key head dim")
    parser.add_argument("--dv", type=positive_int, default=32, help="value head dim")
    add_layer_blocks_args(parser)
    parser.add_argument(
        "--seqlens", type=seqlens, default="512,1024,2048,4096", help="context lengths S"
    )
    parser.add_argument("--iters", type=positive_int, default=64, help="timed steps")
    parser.add_argument("--warmup", type=non_negative_int, default=8, help="warm-up steps")
    parser.add_argument("--csv", default="decode.csv", help="output CSV (JSON beside it)")
    parser.add_argument(
        "--branch-force-mode",
        choices=("isolated", "env"),
        default="isolated",
        help="how branch timings are taken: each branch's op alone on the step's cache state "
        "('env' is an earlier name for the same thing)",
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    add_device_arg(parser)
    parser.add_argument("--no-graph", action="store_true", help="time eagerly even on CUDA")
    add_seed_arg(parser)


def nsa_config_of(args: argparse.Namespace) -> NSAConfig:
    return head_config(args, BLOCK_FLAGS, **block_geometry(args))


def check_arguments(args: argparse.Namespace) -> None:
    nsa_config_of(args)


def _returning(fn: Callable[[], object]) -> Callable[[], Callable[[], object]]:
    """A factory that hands out ``fn`` itself (for work that leaves no state behind)."""
    return lambda: fn


def _dense_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Full attention of one query per sequence over every cached token (GQA expanded)."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def bench_one(
    layer: NSAAttention,
    s: int,
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, float | int]:
    """Time the decode step at position ``s`` after a prefill of ``s`` tokens."""
    cfg = layer.config
    x = torch.randn(args.batch, s + 1, args.dim, device=device, dtype=dtype)
    x_t = x[:, s : s + 1]
    with torch.no_grad():
        _, cache = layer.prefill(x[:, :s], capacity=s + 1)

        def fresh_step() -> Callable[[], object]:
            state = copy.deepcopy(cache)
            return lambda: layer.decode(x_t, state)

        use_graph = device.type == "cuda" and not args.no_graph
        if use_graph:
            ms_total = graph_median_ms(
                fresh_step, iters=args.iters, warmup=args.warmup, device=device
            )
        else:
            holder: list[Callable[[], object]] = []

            def setup() -> None:
                holder[:] = [fresh_step()]

            ms_total = median_ms(
                lambda: holder[0](),
                iters=args.iters,
                warmup=args.warmup,
                device=device,
                setup=setup,
            )

        # The state right after the step's cache update, for the branch timings.
        after: NSACache = copy.deepcopy(cache)
        _, stats = layer.decode(x_t, after)
        inp = layer.branch_inputs(x_t, torch.tensor([s], device=device))
        q = inp.q
        ctx = OpContext.for_config(cfg, device=device, dtype=dtype, seq_len=s + 1)
        scale = cfg.softmax_scale
        toggles = get_toggles()
        cmp_fn = resolve("compressed_attention", ctx, toggles).backend.fn
        sel_fn = resolve("selected_attention", ctx, toggles).backend.fn
        win_fn = resolve("sliding_attention", ctx, toggles).backend.fn

        def run_cmp() -> object:
            return cmp_fn(
                q,
                after.k_cmp,
                after.v_cmp,
                cfg.cmp_block,
                cfg.cmp_stride,
                scale,
                q_start=s,
                toggles=toggles,
            )

        def run_sel() -> object:
            idx, _ = select_blocks(
                q,
                after.k_cmp,
                cfg.cmp_block,
                cfg.cmp_stride,
                cfg.sel_block,
                cfg.num_selected,
                scale,
                q_start=s,
            )
            return sel_fn(
                q, after.k_sel, after.v_sel, idx, cfg.sel_block, scale, q_start=s, toggles=toggles
            )

        win_start = after.k_win.shape[1] - 1

        def run_win() -> object:
            return win_fn(
                q,
                after.k_win,
                after.v_win,
                cfg.window,
                scale,
                q_start=win_start,
                toggles=toggles,
            )

        timings = {}
        for name, fn in (("ms_cmp", run_cmp), ("ms_sel", run_sel), ("ms_win", run_win)):
            if use_graph:
                timings[name] = graph_median_ms(
                    _returning(fn), iters=args.iters, warmup=args.warmup, device=device
                )
            else:
                timings[name] = median_ms(fn, iters=args.iters, warmup=args.warmup, device=device)

        g = cfg.group_size
        qd = q.transpose(1, 2)  # [B, HQ, 1, dk]
        kd = after.k_sel.repeat_interleave(g, dim=2).transpose(1, 2)  # [B, HQ, S+1, dk]
        vd = after.v_sel.repeat_interleave(g, dim=2).transpose(1, 2)
        if use_graph:
            ms_dense = graph_median_ms(
                lambda: lambda: _dense_decode(qd, kd, vd),
                iters=args.iters,
                warmup=args.warmup,
                device=device,
            )
        else:
            ms_dense = median_ms(
                lambda: _dense_decode(qd, kd, vd),
                iters=args.iters,
                warmup=args.warmup,
                device=device,
            )
    return {
        "S": s,
        "ms_total": ms_total,
        "ms_cmp": timings["ms_cmp"],
        "ms_sel": timings["ms_sel"],
        "ms_win": timings["ms_win"],
        "reads_actual": int(stats.reads_actual.max()),
        "reads_expected": stats.reads_expected,
        "ms_dense": ms_dense,
        "reads_dense": s + 1,
        "reads_min": int(stats.reads_actual.min()),
    }


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    dtype = (
        getattr(torch, args.dtype)
        if args.dtype
        else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    )
    config = nsa_config_of(args)
    layer = NSAAttention(config, args.dim).to(device=device, dtype=dtype).eval()
    rows = []
    print(f"decode bench on {device} ({dtype}), B={args.batch}, {config}", flush=True)
    print(
        f"{'S':>7} {'total':>9} {'cmp':>8} {'sel':>8} {'win':>8} {'dense':>8} "
        f"{'reads':>7} {'formula':>7}  (ms, medians of {args.iters})",
        flush=True,
    )
    for s in args.seqlens:
        row = bench_one(layer, s, args, device, dtype)
        rows.append(row)
        print(
            f"{s:7d} {row['ms_total']:9.3f} {row['ms_cmp']:8.3f} {row['ms_sel']:8.3f} "
            f"{row['ms_win']:8.3f} {row['ms_dense']:8.3f} {row['reads_actual']:7d} "
            f"{row['reads_expected']:7d}",
            flush=True,
        )
    out = Path(args.csv)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    meta = {"args": vars(args), "env": _env(), "rows": rows}
    out.with_suffix(".json").write_text(json.dumps(meta, indent=2, default=str))
    print(f"wrote {out} and {out.with_suffix('.json')}")
    bad = [
        r["S"]
        for r in rows
        if r["reads_actual"] != r["reads_expected"] or r["reads_min"] != r["reads_expected"]
    ]
    if bad:
        print(f"reads differ from the formula at S={bad}")
        return 1
    return 0


def _env() -> dict[str, object]:
    from nsa_bench.env import collect

    return dict(collect())
