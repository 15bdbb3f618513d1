"""``nsa-bench demo``: a small NSA prefill + decode that prints the routing and a reads table."""

from __future__ import annotations

import argparse
import time

import torch

from nsa_bench.cli_args import (
    add_device_arg,
    add_seed_arg,
    head_config,
    positive_int,
    seqlen,
)
from nsa_core import NSAAttention
from nsa_core.registry import OpContext, routing_report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", type=seqlen, default=1024, help="prompt tokens (default 1024)")
    parser.add_argument(
        "--steps", type=positive_int, default=64, help="decode steps after the prompt"
    )
    parser.add_argument("--hidden", type=positive_int, default=256, help="hidden size")
    parser.add_argument("--heads", type=positive_int, default=16, help="query heads HQ")
    parser.add_argument("--kv-heads", type=positive_int, default=4, help="kv heads H")
    parser.add_argument("--dk", type=positive_int, default=32, help="query/key head dim")
    parser.add_argument("--dv", type=positive_int, default=32, help="value head dim")
    add_device_arg(parser)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    add_seed_arg(parser)


def check_arguments(args: argparse.Namespace) -> None:
    head_config(args)  # heads that do not group, an odd dk: refused before anything is built


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    config = head_config(args)
    layer = NSAAttention(config, args.hidden).to(device=device, dtype=dtype).eval()
    total = args.prefill + args.steps
    x = torch.randn(1, total, args.hidden, device=device, dtype=dtype)

    ctx = OpContext.for_config(config, device=device, dtype=dtype, seq_len=args.prefill)
    print(f"NSA demo on {device} ({args.dtype}): {config}")
    print("\nrouting (prefill context):")
    print(routing_report(ctx))

    with torch.no_grad():
        start = time.perf_counter()
        _, cache = layer.prefill(x[:, : args.prefill])
        prefill_ms = (time.perf_counter() - start) * 1e3
        print(f"\nprefill {args.prefill} tokens: {prefill_ms:.1f} ms")
        print("\n     pos   cmp   sel   win  actual  expected  step_ms")
        show = {0, args.steps - 1} | set(range(0, args.steps, max(1, args.steps // 8)))
        mismatches = 0
        for i in range(args.steps):
            start = time.perf_counter()
            _, stats = layer.decode(x[:, args.prefill + i : args.prefill + i + 1], cache)
            step_ms = (time.perf_counter() - start) * 1e3
            actual = int(stats.reads_actual.max())
            mismatches += int((stats.reads_actual != stats.reads_expected).sum())
            if i in show:
                print(
                    f"{stats.position:8d} {int(stats.reads_cmp.max()):5d} "
                    f"{int(stats.reads_sel.max()):5d} {int(stats.reads_win.max()):5d} "
                    f"{actual:7d} {stats.reads_expected:9d} {step_ms:8.2f}"
                )
    print(
        f"\nreads: measured == formula at every step and head: {'yes' if not mismatches else 'NO'}"
        f" ({mismatches} mismatches); dense attention would read {total} tokens at the last step"
    )
    return 0 if mismatches == 0 else 1
