"""One tree's side of the bench gate (ci/bench_gate.py): it times the gate's rows on request.

    PYTHONPATH=<tree>/packages/nsa-core/src:... python ci/bench_gate_worker.py --tree <tree>

The gate starts one worker per tree (the pull request's and its merge base's), both from the
pull request's checkout of this file, so the two trees are timed by the same code; only the
packages under test come from each tree. The worker imports them, checks that they are the
tree's own (an installed copy of another tree must not stand in), prints ``ready``, then answers
one JSON line per request on stdin:

    {"row": "layer fwd T=16384", "calls": 8}  ->  {"row": ..., "ms": [8 floats]}

Each call's time is taken with CUDA events around the call alone (the device idle before it).
A row's inputs are built at its first request, with two untimed warm-up calls that compile its
kernels; later requests reuse them. A row the tree cannot run answers ``{"row", "error"}``.

The rows (paper geometry: B=1, HQ=64, H=4, dk=dv=128, l=32, d=16, l'=64, n=16, w=512, bf16):
the attention core (``nsa_core.nsa_attention``, default routes) forward and forward+backward at
T=16k and 64k; the fused decode step (one CUDA graph replay per token; a sample is the mean of
``DECODE_REPLAYS`` replays) at B=1 and B=32 with S=64k cached tokens; the selected branch
(``nsa_core.selected_attention``) forward and forward+backward at T=64k on random valid block
indices with the forced blocks.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HQ, H, DK, DV = 64, 4, 128, 128
L_CMP, D_CMP, L_SEL, N_SEL, WINDOW = 32, 16, 64, 16, 512
DECODE_REPLAYS = 50


@dataclass(frozen=True)
class RowSpec:
    """One gate row: what it times (Liger-Kernel's bench schema names) and at which size."""

    kernel: str  # nsa_attention, decode_step, selected_attention
    mode: str  # forward, full (forward+backward), step
    x_name: str  # T or B
    x_value: int
    context: int  # tokens: T of a prefill, S of the decode cache

    @property
    def name(self) -> str:
        return f"{self.kernel} {self.mode} {self.x_name}={self.x_value}"


ROWS: tuple[RowSpec, ...] = (
    RowSpec("nsa_attention", "forward", "T", 16384, 16384),
    RowSpec("nsa_attention", "full", "T", 16384, 16384),
    RowSpec("nsa_attention", "forward", "T", 65536, 65536),
    RowSpec("nsa_attention", "full", "T", 65536, 65536),
    RowSpec("decode_step", "step", "B", 1, 65536),
    RowSpec("decode_step", "step", "B", 32, 65536),
    RowSpec("selected_attention", "forward", "T", 65536, 65536),
    RowSpec("selected_attention", "full", "T", 65536, 65536),
)


def row_spec(name: str) -> RowSpec:
    for spec in ROWS:
        if spec.name == name:
            return spec
    raise KeyError(f"no gate row {name!r} (rows: {', '.join(s.name for s in ROWS)})")


Call = Callable[[], object]


def _config() -> Any:
    from nsa_core import NSAConfig

    return NSAConfig(
        num_q_heads=HQ, num_kv_heads=H, head_dim_qk=DK, head_dim_v=DV,
        cmp_block=L_CMP, cmp_stride=D_CMP, sel_block=L_SEL, num_selected=N_SEL, window=WINDOW,
    )  # fmt: skip


def _randn(gen: Any, *size: int) -> Any:
    import torch

    return torch.randn(*size, device="cuda", generator=gen).to(torch.bfloat16)


def _forward_or_full(
    forward: Callable[..., Any], inputs: list[Any], upstream: Any, mode: str
) -> Call:
    import torch

    if mode == "forward":

        def call_forward() -> object:
            with torch.no_grad():
                return forward(*inputs)

        return call_forward
    leaves = [x.detach().clone().requires_grad_() for x in inputs]

    def call_full() -> object:
        for leaf in leaves:
            leaf.grad = None
        torch.autograd.backward(forward(*leaves), upstream)
        return None

    return call_full


def attention_row(spec: RowSpec) -> Call:
    """nsa_attention: q [1, T, HQ, dk], one k [1, T, H, dk] / v [1, T, H, dv] for the three
    branches, gates [1, T, HQ, 3]."""
    import torch

    import nsa_core

    t, config = spec.x_value, _config()
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = _randn(gen, 1, t, HQ, DK), _randn(gen, 1, t, H, DK), _randn(gen, 1, t, H, DV)
    gates = torch.sigmoid(_randn(gen, 1, t, HQ, 3))
    upstream = _randn(gen, 1, t, HQ, DV)

    def forward(q: Any, k: Any, v: Any, g: Any) -> Any:
        return nsa_core.nsa_attention(q, k, v, g, config)

    return _forward_or_full(forward, [q, k, v, gates], upstream, spec.mode)


def random_block_indices(t: int, gen: Any) -> Any:
    """[1, T, H, n] int32: per (t, kv head) the valid forced blocks {0, jt - 1, jt} and random
    other valid blocks, ascending, padded with -1 where fewer than n blocks are valid."""
    import torch

    blocks = -(-t // L_SEL)
    pos = torch.arange(t, device="cuda")
    jt = (pos // L_SEL)[:, None, None]
    j = torch.arange(blocks, device="cuda")[None, None, :]
    score = torch.rand(t, H, blocks, device="cuda", generator=gen, dtype=torch.float16)
    score = score.masked_fill((j == 0) | (j == jt) | (j == jt - 1), 2.0)
    score = score.masked_fill(j > jt, -1.0)
    top, picked = score.topk(N_SEL, dim=-1)
    picked = picked.masked_fill(top < 0, -1).to(torch.int32)
    # -1 (padding) sorts first; ascending valid blocks after it, then padding moved to the end.
    picked = picked.sort(dim=-1).values
    order = (picked < 0).to(torch.int8).argsort(dim=-1, stable=True)
    return picked.gather(-1, order)[None]


def selected_row(spec: RowSpec) -> Call:
    """selected_attention: q [1, T, HQ, dk], k [1, T, H, dk], v [1, T, H, dv], indices above."""
    import torch

    import nsa_core

    t = spec.x_value
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = _randn(gen, 1, t, HQ, DK), _randn(gen, 1, t, H, DK), _randn(gen, 1, t, H, DV)
    idx = random_block_indices(t, gen)
    upstream = _randn(gen, 1, t, HQ, DV)

    def forward(q: Any, k: Any, v: Any) -> Any:
        return nsa_core.selected_attention(q, k, v, idx, L_SEL)

    return _forward_or_full(forward, [q, k, v], upstream, spec.mode)


def decode_row(spec: RowSpec) -> Call:
    """The fused decode step over B sequences of S random cached tokens, one CUDA graph replay
    per token; a call is ``DECODE_REPLAYS`` replays (the gate divides)."""
    import torch

    from nsa_bench.decode_bench import filled_state, random_inputs
    from nsa_kernels.decode.graph import DecodeGraph

    batch, length = spec.x_value, spec.context
    capacity = length + DECODE_REPLAYS + 64  # a call's replays and the graph's warm-up steps
    state = filled_state(_config(), [length] * batch, capacity, torch.bfloat16)
    graph = DecodeGraph(state)
    graph.inputs.copy_(random_inputs(state))
    saved = state.snapshot_counters()

    def call() -> object:
        # Every call starts from the same cache length, so all samples time the same step.
        state.restore_counters(saved)
        for _ in range(DECODE_REPLAYS):
            graph.replay()
        return None

    return call


BUILDERS: dict[str, Callable[[RowSpec], Call]] = {
    "nsa_attention": attention_row,
    "selected_attention": selected_row,
    "decode_step": decode_row,
}


def time_calls(call: Call, calls: int, per_call: int) -> list[float]:
    """ms of each of ``calls`` calls (CUDA events, the device idle before each)."""
    import torch

    times = []
    for _ in range(calls):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        torch.cuda.synchronize()
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(float(start.elapsed_time(end)) / per_call)
    return times


def check_tree(tree: Path) -> list[str]:
    """The packages under test and where they were imported from; fail unless from ``tree``."""
    import nsa_bench
    import nsa_core
    import nsa_kernels

    lines = []
    for module in (nsa_core, nsa_kernels, nsa_bench):
        path = Path(module.__file__ or "").resolve()
        if tree.resolve() not in path.parents:
            raise SystemExit(f"{module.__name__} came from {path}, not from the tree {tree}")
        lines.append(f"{module.__name__}={path}")
    return lines


def register_kernels() -> None:
    """The tree's kernels in nsa_core's registry, as an install's entry point puts them there.

    A tree run from its sources has no entry points; without this every row would time the
    PyTorch reference.
    """
    from nsa_core.registry import register_backend
    from nsa_kernels.registration import register

    register(register_backend)


def serve(tree: Path) -> int:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("the bench gate needs a CUDA GPU (torch sees none)")
    where = check_tree(tree)
    register_kernels()
    print("ready " + " ".join(where), flush=True)
    rows: dict[str, Call] = {}
    for line in sys.stdin:
        request = json.loads(line)
        name = request["row"]
        try:
            spec = row_spec(name)
            per_call = DECODE_REPLAYS if spec.kernel == "decode_step" else 1
            if name not in rows:
                rows[name] = BUILDERS[spec.kernel](spec)
                time_calls(rows[name], 2, per_call)  # compile, autotune, allocate
            answer: dict[str, Any] = {
                "row": name,
                "ms": time_calls(rows[name], int(request["calls"]), per_call),
            }
        except Exception as err:  # the gate reports the row as not runnable in this tree
            answer = {"row": name, "error": f"{type(err).__name__}: {err}"}
        print(json.dumps(answer), flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description="One tree's side of the bench gate.")
    parser.add_argument("--tree", type=Path, required=True, help="checkout whose packages run")
    return serve(parser.parse_args().tree)


if __name__ == "__main__":
    sys.exit(main())
