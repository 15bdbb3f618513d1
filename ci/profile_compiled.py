"""Where a compiled NSA call spends its time against the eager one: a CUDA profile of each.

    python3 ci/profile_compiled.py [--seqlen 8192] [--mode fwd+bwd] [--out DIR]

For ``nsa_attention`` at the layer bench's shape (bf16, B=1, HQ=64, H=4, dk=dv=128, the paper's
l, d, l', n, w), eager and ``torch.compile(fullgraph=True)``: the wall time of one call (median
of 10, after warm-up), the GPU's busy time inside it (the union of its kernels' intervals: the
rest is the GPU waiting for the host), and the kernels by total time, side by side. Written to
DIR/profile_T_MODE.txt (MODE fwd or fwdbwd) and printed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from nsa_bench.cli import register_kernels
from nsa_bench.cli_args import block_geometry
from nsa_bench.layer.inputs import make_inputs
from nsa_bench.layer.rows import LayerShape
from nsa_core import NSAConfig, nsa_attention


def _shape(t: int) -> LayerShape:
    """The layer bench's shape: bf16, B=1, HQ=64, H=4, dk=dv=128, NSAConfig's (the paper's)
    l, d, l', n, w."""
    paper = NSAConfig(num_q_heads=64, num_kv_heads=4, head_dim_qk=128, head_dim_v=128)
    return LayerShape(1, t, 64, 4, 128, 128, "bf16", **block_geometry(paper))


def _inputs(shape: LayerShape, grad: bool) -> list[torch.Tensor]:
    drawn = make_inputs(shape, torch.device("cuda"), seed=0)
    return [x.requires_grad_(grad) for x in (drawn.q, drawn.k, drawn.v, drawn.gates)]


def _step(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], grad: bool) -> None:
    if grad:
        out = fn(*inputs)
        torch.autograd.grad(out, inputs, torch.ones_like(out))
    else:
        with torch.no_grad():
            fn(*inputs)


def _wall_ms(fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], grad: bool) -> float:
    times = []
    for _ in range(10):
        torch.cuda.synchronize()
        start = time.perf_counter()
        _step(fn, inputs, grad)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _kernels(
    fn: Callable[..., torch.Tensor], inputs: list[torch.Tensor], grad: bool
) -> tuple[dict[str, float], float]:
    """(total ms per kernel name, GPU busy ms) of one call."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _step(fn, inputs, grad)
        torch.cuda.synchronize()
    totals: dict[str, float] = defaultdict(float)
    spans = []
    for event in prof.events():
        if getattr(event.device_type, "name", "") != "CUDA":
            continue
        totals[event.name[:90]] += event.device_time / 1e3
        start = event.time_range.start
        spans.append((start, start + event.device_time))
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return dict(totals), busy / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--mode", choices=("fwd", "fwd+bwd"), default="fwd+bwd")
    parser.add_argument("--out", type=Path, default=Path("artifacts/profile_compiled"))
    args = parser.parse_args()
    register_kernels()
    grad = args.mode == "fwd+bwd"
    shape = _shape(args.seqlen)
    config = shape.config()
    inputs = _inputs(shape, grad)

    def eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return nsa_attention(q, k, v, g, config)

    compiled = torch.compile(eager, fullgraph=True)
    results = {}
    for name, fn in (("eager", eager), ("compiled", compiled)):
        for _ in range(3):
            _step(fn, inputs, grad)
        wall = _wall_ms(fn, inputs, grad)
        totals, busy = _kernels(fn, inputs, grad)
        results[name] = (wall, busy, totals)

    lines = [f"nsa_attention T={args.seqlen} {args.mode}, bf16, HQ=64 H=4 dk=dv=128", ""]
    lines.append("| side | wall ms (median of 10) | GPU busy ms | kernel ms | kernels |")
    lines.append("|---|---:|---:|---:|---:|")
    for name, (wall, busy, totals) in results.items():
        lines.append(
            f"| {name} | {wall:.3f} | {busy:.3f} | {sum(totals.values()):.3f} | {len(totals)} |"
        )
    lines += ["", "| kernel | eager ms | compiled ms |", "|---|---:|---:|"]
    eager_totals, compiled_totals = results["eager"][2], results["compiled"][2]
    names = sorted(
        set(eager_totals) | set(compiled_totals),
        key=lambda n: -max(eager_totals.get(n, 0.0), compiled_totals.get(n, 0.0)),
    )
    for name in names[:40]:
        eager_ms, compiled_ms = eager_totals.get(name, 0.0), compiled_totals.get(name, 0.0)
        lines.append(f"| `{name}` | {eager_ms:.3f} | {compiled_ms:.3f} |")
    text = "\n".join(lines)
    args.out.mkdir(parents=True, exist_ok=True)
    # "fwd+bwd" as "fwdbwd": a file name of plain characters.
    name = f"profile_{args.seqlen}_{args.mode.replace('+', '')}.txt"
    (args.out / name).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
