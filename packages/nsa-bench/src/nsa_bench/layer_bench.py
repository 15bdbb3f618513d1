"""``nsa-bench layer``: the whole NSA layer against full attention and fla-core, over T.

For each head-dim pair (``--head-dims``, default the dk=dv=128 shape and the paper's 192/128),
each length T (``--seqlens``, default 8k..128k) and each mode (``fwd``, ``fwdbwd``) every method
runs on the same random inputs (B=1, HQ=64, H=4, l=32, d=16, l'=64, n=16, w=512, bf16 by
default) and is timed with ``triton.testing.do_bench`` medians on CUDA (the host clock on CPU,
for smoke runs at tiny shapes):

- ``nsa_core``: ``nsa_core.nsa_attention(q, k, v, gates, config)``, i.e. compress, select, the
  three branches and the gated combine, with one K/V shared by the three branches;
- ``nsa_module``: ``nsa_core.NSAAttention(config, hidden_size)`` on x [B, T, hidden]: the
  projections, RoPE, the gate MLP and the output projection included;
- ``fla``: fla-core's ``parallel_nsa``, compression and selection with its own top-n (its
  compression mean-pools l'-token blocks: l = d = l'), cmp and slc gates, no window;
- ``sdpa``: torch SDPA, causal, GQA through ``enable_gqa=True`` (kv heads repeated only on a
  torch without it, and the row says so);
- ``fa2``: ``flash_attn_func``, causal, native GQA (v zero-padded to dk when dv != dk).

Every row has ``vs_<peer>``: the peer's median over this row's median in the same
(head dims, T, mode) case, so > 1 means faster than that peer. The core is also timed step
by step (``compress``, ``select_blocks``, ``compressed``, ``selected``, ``sliding``,
``combine``), each through nsa_core's public op with the backend the registry routes it to named
in the row, and its share of the whole core, in the modes of ``--step-modes`` (default the
forward; ``fwdbwd`` times each step's forward and backward). ``--step-backends
sliding=triton_win`` adds a ``sliding@triton_win`` row timed with that backend pinned, to
compare backends of one step in one run. ``peak_mib`` is
``torch.cuda.max_memory_allocated`` over the row's runs (inputs included), ``work_mib`` the part
above what was allocated when the row started.

A peer that refuses a shape, a missing package and an out-of-memory case each become a row whose
``status`` says why (``skipped: ``, ``refused: ``, ``oom: ``, ``error: ``), never a crash. Under
``--out`` (default ``artifacts/bench/layer/``): ``layer.csv`` and ``layer.json`` (one schema, the
environment as ``env_*`` in every row, rewritten after every case so a stopped run keeps what it
measured), ``layer.png`` (ms against T, log-log, one line per method and mode; needs matplotlib,
``nsa-bench[plot]``) and ``layer.md``, the Markdown tables that are also printed last.
``--merge A.csv B.csv`` rebuilds every output from earlier runs' rows (e.g. one run per T range).
"""

from __future__ import annotations

import argparse
import csv
import gc
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import nsa_core
from nsa_bench.cli_args import (
    add_device_arg,
    add_layer_blocks_args,
    add_layer_heads_args,
    blocks_config,
    parse_length,
    parse_names,
    parse_pairs,
)
from nsa_bench.env import collect_columns
from nsa_bench.tables import finite_or_dash, write_env_tables
from nsa_bench.timing import clear_grads, do_bench_median_ms, median_ms
from nsa_core import NSAConfig
from nsa_core.registry import OpContext
from nsa_core.toggles import BACKEND_TOGGLE, toggles_overridden

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NSA_METHODS = ("nsa_core", "nsa_module")
PEERS = ("fla", "sdpa", "fa2")
METHODS = NSA_METHODS + PEERS
MODES = ("fwd", "fwdbwd")
# Step of the core forward -> the public nsa_core function and the registry op that routes it.
STEPS: tuple[tuple[str, str], ...] = (
    ("compress", "compress"),
    ("compressed", "compressed_attention"),
    ("select_blocks", "select_blocks"),
    ("selected", "selected_attention"),
    ("sliding", "sliding_attention"),
    ("combine", "gated_combine"),
)
MIB = 1 << 20


@dataclass
class Row:
    """One timed (case, method) or (case, step of the core forward).

    ``kind`` is ``method`` or ``step``; ``step`` is empty for methods. ``share``: a step's ms
    over the core forward's ms. ``vs_<peer>``: the peer's ms over this row's ms, same case.
    """

    kind: str
    method: str
    step: str
    mode: str
    dtype: str
    B: int
    T: int
    HQ: int
    H: int
    G: int
    dk: int
    dv: int
    cmp_block: int
    cmp_stride: int
    sel_block: int
    num_selected: int
    window: int
    hidden_size: int = 0
    ms: float = math.nan
    peak_mib: float = math.nan
    work_mib: float = math.nan
    share: float = math.nan
    vs_fla: float = math.nan
    vs_sdpa: float = math.nan
    vs_fa2: float = math.nan
    backend: str = ""
    status: str = "ok"
    note: str = ""
    env: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok" and math.isfinite(self.ms)

    def case_key(self) -> tuple[str, int, int, int, int, int, str, int]:
        """Rows with equal keys ran the same problem and are compared with each other."""
        return (self.dtype, self.B, self.HQ, self.H, self.dk, self.dv, self.mode, self.T)


ROW_COLUMNS = [f.name for f in fields(Row) if f.name != "env"]


@dataclass(frozen=True)
class Shape:
    """One problem: q [B, T, HQ, dk], k [B, T, H, dk], v [B, T, H, dv] and the NSA geometry."""

    batch: int
    seq_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_v: int
    cmp_block: int
    cmp_stride: int
    sel_block: int
    num_selected: int
    window: int
    dtype: str

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def scale(self) -> float:
        return float(self.head_dim_qk**-0.5)

    def config(self) -> NSAConfig:
        heads = (self.num_q_heads, self.num_kv_heads)
        return blocks_config(self, heads, (self.head_dim_qk, self.head_dim_v))

    def row(self, kind: str, method: str, mode: str, step: str = "", **extra: Any) -> Row:
        return Row(
            kind=kind,
            method=method,
            step=step,
            mode=mode,
            dtype=self.dtype,
            B=self.batch,
            T=self.seq_len,
            HQ=self.num_q_heads,
            H=self.num_kv_heads,
            G=self.group,
            dk=self.head_dim_qk,
            dv=self.head_dim_v,
            cmp_block=self.cmp_block,
            cmp_stride=self.cmp_stride,
            sel_block=self.sel_block,
            num_selected=self.num_selected,
            window=self.window,
            **extra,
        )


# ---------------------------------------------------------------------------------------------
# Timing and failures


Timer = Callable[[Callable[[], object], Sequence[torch.Tensor]], float]


def make_timer(
    device: torch.device, *, warmup_ms: float, rep_ms: float, iters: int, warmup: int
) -> Timer:
    """Median ms of ``fn``: do_bench on CUDA (grads of ``leaves`` reset between runs), else the
    host clock over ``iters`` runs after ``warmup``."""
    if device.type == "cuda":

        def bench_cuda(fn: Callable[[], object], leaves: Sequence[torch.Tensor]) -> float:
            return do_bench_median_ms(fn, warmup_ms=warmup_ms, rep_ms=rep_ms, grads=leaves)

        return bench_cuda

    def bench_host(fn: Callable[[], object], leaves: Sequence[torch.Tensor]) -> float:
        setup = clear_grads(leaves)
        return median_ms(fn, iters=iters, warmup=warmup, device=device, setup=setup)

    return bench_host


def failure_status(exc: BaseException) -> str:
    """``oom: ``, ``refused: `` (the callee rejected the arguments) or ``error: `` + the message."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return "oom: " + text
    if isinstance(exc, (AssertionError, ValueError, NotImplementedError)):
        return "refused: " + text
    return "error: " + text


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(
    row: Row,
    fn: Callable[[], object],
    leaves: Sequence[torch.Tensor],
    timer: Timer,
    device: torch.device,
) -> Row:
    """Run ``fn`` once (compile, autotune, surface refusals), then time it; fill ms and memory.

    Any exception becomes the row's status; the row is returned either way.
    """
    base = 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    try:
        fn()
        for t in leaves:
            t.grad = None
        row.ms = timer(fn, leaves)
    except Exception as exc:  # a refusal or an OOM is a result, not a crash
        row.status = failure_status(exc)
        row.ms = math.nan
    if device.type == "cuda":
        try:
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device)
            row.peak_mib = peak / MIB
            row.work_mib = (peak - base) / MIB
        except Exception as exc:  # a kernel fault poisons the context: say so, keep the row
            row.status += f"; memory not read: {type(exc).__name__}: {exc}"
    for t in leaves:
        t.grad = None
    if row.status.startswith("oom"):
        _free(device)
    return row


# ---------------------------------------------------------------------------------------------
# Peers


@dataclass(frozen=True)
class Peer:
    """A peer's callable, or the reason it cannot run here; ``info`` names the version."""

    fn: Callable[..., torch.Tensor] | None
    info: str


def load_fla() -> Peer:
    """fla-core's ``parallel_nsa``, or why it cannot be imported."""
    try:
        import fla
        from fla.ops.nsa.parallel import parallel_nsa
    except Exception as exc:  # any import failure means "no peer", with the reason recorded
        return Peer(None, f"fla-core not importable ({type(exc).__name__}: {exc})")
    return Peer(parallel_nsa, f"fla-core {getattr(fla, '__version__', '?')}")


def load_fa2() -> Peer:
    """flash_attn's ``flash_attn_func``, or why it cannot be imported."""
    try:
        import flash_attn
    except Exception as exc:  # a broken build raises more than ImportError
        return Peer(None, f"flash_attn not importable ({type(exc).__name__}: {exc})")
    return Peer(flash_attn.flash_attn_func, f"flash_attn {getattr(flash_attn, '__version__', '?')}")


def sdpa_has_gqa() -> bool:
    """Whether this torch's SDPA takes ``enable_gqa`` (torch >= 2.5)."""
    q = torch.zeros(1, 2, 1, 8)
    kv = torch.zeros(1, 1, 1, 8)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except TypeError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# One case


@dataclass
class Inputs:
    """q [B, T, HQ, dk], k [B, T, H, dk], v [B, T, H, dv], gates [B, T, HQ, 3] in (0, 1),
    upstream gradient do [B, T, HQ, dv]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    gates: torch.Tensor
    do: torch.Tensor


def make_inputs(shape: Shape, device: torch.device, seed: int) -> Inputs:
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = DTYPES[shape.dtype]
    b, t, hq, h = shape.batch, shape.seq_len, shape.num_q_heads, shape.num_kv_heads
    dk, dv = shape.head_dim_qk, shape.head_dim_v

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, device=device, generator=gen, dtype=torch.float32).to(dtype)

    return Inputs(
        q=randn(b, t, hq, dk),
        k=randn(b, t, h, dk),
        v=randn(b, t, h, dv),
        gates=torch.sigmoid(randn(b, t, hq, 3)),
        do=randn(b, t, hq, dv),
    )


def _leaves(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_() for t in tensors]


def _run(
    forward: Callable[..., torch.Tensor],
    tensors: Sequence[torch.Tensor],
    upstream: torch.Tensor,
    mode: str,
    extra_leaves: Sequence[torch.Tensor] = (),
) -> tuple[Callable[[], object], list[torch.Tensor]]:
    """The zero-argument call of ``mode`` and the tensors whose grads it fills."""
    if mode == "fwd":

        def call_fwd() -> object:
            with torch.no_grad():
                return forward(*tensors)

        return call_fwd, []
    leaves = _leaves(tensors)

    def call_fwdbwd() -> object:
        torch.autograd.backward(forward(*leaves), upstream)
        return None

    return call_fwdbwd, [*leaves, *extra_leaves]


def routed_backend(op: str, ctx: OpContext) -> str:
    """The backend nsa_core's registry picks for ``op`` in ``ctx``, or why it cannot say."""
    from nsa_core import registry

    if op not in registry.OPS:
        return f"reference ({op} is not a registry op)"
    try:
        return registry.resolve(op, ctx).backend.name
    except Exception as exc:  # reported in the row, the timing still runs
        return f"unknown ({type(exc).__name__}: {exc})"


def op_context(shape: Shape, device: torch.device, requires_grad: bool) -> OpContext:
    """The registry's routing context of the core's calls at ``shape`` (dense, no varlen)."""
    return OpContext.for_config(
        shape.config(),
        device=device,
        dtype=DTYPES[shape.dtype],
        seq_len=shape.seq_len,
        requires_grad=requires_grad,
    )


def core_routing(shape: Shape, device: torch.device, requires_grad: bool) -> str:
    """``op=backend`` for every op the registry routes, as the core's calls would be routed."""
    from nsa_core import registry

    try:
        ctx = op_context(shape, device, requires_grad)
    except Exception as exc:  # the row says so; timing goes on
        return f"unknown (OpContext: {type(exc).__name__}: {exc})"
    return ";".join(f"{op}={routed_backend(op, ctx)}" for op in registry.OPS)


def bench_nsa_core(shape: Shape, inp: Inputs, mode: str, timer: Timer, device: torch.device) -> Row:
    row = shape.row(
        "method",
        "nsa_core",
        mode,
        backend=core_routing(shape, device, mode == "fwdbwd"),
        note="one K/V shared by the three branches",
    )
    config = shape.config()

    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> Any:
        return nsa_core.nsa_attention(q, k, v, g, config)

    call, leaves = _run(forward, (inp.q, inp.k, inp.v, inp.gates), inp.do, mode)
    return measure(row, call, leaves, timer, device)


def bench_nsa_module(
    shape: Shape, mode: str, hidden_size: int, timer: Timer, device: torch.device, seed: int
) -> Row:
    row = shape.row(
        "method",
        "nsa_module",
        mode,
        hidden_size=hidden_size,
        backend=core_routing(shape, device, mode == "fwdbwd"),
        note=(
            f"NSAAttention, hidden_size={hidden_size}: q/k/v projections per branch, RoPE, "
            "gate MLP and output projection included"
        ),
    )
    try:
        torch.manual_seed(seed)  # the parameters' initialisation draws from the global generator
        layer = nsa_core.NSAAttention(shape.config(), hidden_size)
        layer = layer.to(device=device, dtype=DTYPES[shape.dtype])
        gen = torch.Generator(device=device).manual_seed(seed)
        size = (shape.batch, shape.seq_len, hidden_size)
        x = torch.randn(*size, device=device, generator=gen).to(DTYPES[shape.dtype])
        dy = torch.randn(*size, device=device, generator=gen).to(DTYPES[shape.dtype])
    except Exception as exc:  # e.g. out of memory for the parameters or x
        row.status = failure_status(exc)
        _free(device)
        return row
    if mode == "fwdbwd":
        layer.train()
    else:
        layer.eval()
    call, leaves = _run(layer, (x,), dy, mode, extra_leaves=list(layer.parameters()))
    measure(row, call, leaves, timer, device)
    del layer, x, dy, call, leaves
    return row


def bench_fla(
    shape: Shape, inp: Inputs, mode: str, peer: Peer, timer: Timer, device: torch.device
) -> Row:
    row = shape.row(
        "method",
        "fla",
        mode,
        backend=peer.info,
        note=(
            f"parallel_nsa: compression pools l'={shape.sel_block}-token blocks (l = d = l'), "
            f"its own top-n with block_counts={shape.num_selected}, cmp and slc gates, no window"
        ),
    )
    if peer.fn is None:
        row.status = "skipped: " + peer.info
        return row
    fla_nsa = peer.fn
    g_cmp = inp.gates[..., 0].contiguous()
    g_slc = inp.gates[..., 1].contiguous()

    def forward(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gc_: torch.Tensor, gs: torch.Tensor
    ) -> torch.Tensor:
        return fla_nsa(
            q,
            k,
            v,
            g_cmp=gc_,
            g_slc=gs,
            block_counts=shape.num_selected,
            block_size=shape.sel_block,
            window_size=0,
            scale=shape.scale,
        )

    call, leaves = _run(forward, (inp.q, inp.k, inp.v, g_cmp, g_slc), inp.do, mode)
    return measure(row, call, leaves, timer, device)


def bench_sdpa(
    shape: Shape, inp: Inputs, mode: str, has_gqa: bool, timer: Timer, device: torch.device
) -> Row:
    g = shape.group
    if has_gqa:
        note = "causal, enable_gqa=True, inputs in SDPA's [B, H, T, D] layout"
    else:
        note = (
            "causal; this torch's SDPA lacks enable_gqa: kv heads repeated with "
            "repeat_interleave inside the timed call"
        )
    row = shape.row("method", "sdpa", mode, backend=f"torch {torch.__version__}", note=note)
    # SDPA's own layout, made once outside the timed call: [B, heads, T, D].
    q, k, v, do = (x.transpose(1, 2).contiguous() for x in (inp.q, inp.k, inp.v, inp.do))

    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if has_gqa:
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=shape.scale, enable_gqa=True
            )
        k_rep = k.repeat_interleave(g, dim=1)
        v_rep = v.repeat_interleave(g, dim=1)
        return F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True, scale=shape.scale)

    call, leaves = _run(forward, (q, k, v), do, mode)
    measure(row, call, leaves, timer, device)
    del q, k, v, do, call, leaves
    return row


def bench_fa2(
    shape: Shape, inp: Inputs, mode: str, peer: Peer, timer: Timer, device: torch.device
) -> Row:
    dk, dv = shape.head_dim_qk, shape.head_dim_v
    note = "causal, native GQA"
    if dv != dk:
        note += f"; v (and the upstream gradient) zero-padded from dv={dv} to dk={dk}"
    row = shape.row("method", "fa2", mode, backend=peer.info, note=note)
    if peer.fn is None:
        row.status = "skipped: " + peer.info
        return row
    if device.type != "cuda":
        row.status = f"skipped: FA-2 needs a CUDA device, this run is on {device.type}"
        return row
    flash = peer.fn
    # FA-2 takes one head dim for q, k and v.
    v = F.pad(inp.v, (0, dk - dv)) if dv < dk else inp.v
    do = F.pad(inp.do, (0, dk - dv)) if dv < dk else inp.do

    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return flash(q, k, v, softmax_scale=shape.scale, causal=True)

    call, leaves = _run(forward, (inp.q, inp.k, v), do, mode)
    measure(row, call, leaves, timer, device)
    del v, do, call, leaves
    return row


# What each step of the core forward reads from the steps before it.
STEP_NEEDS: dict[str, tuple[str, ...]] = {
    "compress": (),
    "select_blocks": ("compress", "compressed"),
    "compressed": ("compress",),
    "selected": ("select_blocks",),
    "sliding": (),
    "combine": ("compressed", "selected", "sliding"),
}


@dataclass(frozen=True)
class StepCall:
    """One step as a function of its tensor inputs: ``fn(*inputs)`` -> its output(s).

    ``grad_outputs``: how many leading outputs carry a gradient in ``fwdbwd`` (0: the step
    takes none, as block scoring, and is timed forward only).
    """

    fn: Callable[..., Any]
    inputs: tuple[torch.Tensor, ...]
    grad_outputs: int


def _as_tuple(out: Any) -> tuple[Any, ...]:
    return out if isinstance(out, tuple) else (out,)


def step_timed_call(
    step: StepCall, mode: str, seed: int
) -> tuple[Callable[[], object], list[torch.Tensor]]:
    """The zero-argument call that times ``step`` in ``mode`` and the leaves whose grads it fills.

    ``fwdbwd``: the step's inputs become leaves and its differentiable outputs get random
    upstream gradients (drawn once, from ``seed``), as the layer's backward hands them down.
    """
    if mode == "fwd" or step.grad_outputs == 0:

        def call_fwd() -> object:
            with torch.no_grad():
                return step.fn(*step.inputs)

        return call_fwd, []
    leaves = [
        t.detach().clone().requires_grad_() if t.is_floating_point() else t for t in step.inputs
    ]
    with torch.no_grad():
        outs = _as_tuple(step.fn(*step.inputs))[: step.grad_outputs]
    gen = torch.Generator(device=outs[0].device).manual_seed(seed)
    upstream = [torch.randn(o.shape, generator=gen, device=o.device).to(o.dtype) for o in outs]

    def call_fwdbwd() -> object:
        outs = _as_tuple(step.fn(*leaves))[: step.grad_outputs]
        torch.autograd.backward(list(outs), upstream)
        return None

    return call_fwdbwd, [t for t in leaves if t.requires_grad]


def parse_step_backends(text: str) -> list[tuple[str, str]]:
    """``sliding=triton_win,selected=reference`` -> [(step, backend)], steps checked."""
    pairs = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        step, sep, backend = item.partition("=")
        if not sep or not backend or step not in dict(STEPS):
            raise argparse.ArgumentTypeError(
                f"--step-backends takes STEP=BACKEND pairs with STEP one of "
                f"{', '.join(s for s, _ in STEPS)}; got {item!r}"
            )
        if dict(STEPS)[step] not in BACKEND_TOGGLE:
            raise argparse.ArgumentTypeError(f"step {step!r} has one backend, nothing to pin")
        pairs.append((step, backend))
    return pairs


def bench_steps(
    shape: Shape,
    inp: Inputs,
    timer: Timer,
    device: torch.device,
    modes: Sequence[str] = ("fwd",),
    pins: Sequence[tuple[str, str]] = (),
    seed: int = 0,
) -> list[Row]:
    """The core step by step, each through its public nsa_core op, routed backends named.

    For every mode, each step is timed alone: ``fwd``, or ``fwdbwd`` (its forward and its
    backward from random upstream gradients; ``select_blocks`` takes no gradient and is timed
    forward). Each step runs once more untimed to hand its outputs to the steps after it; a step
    whose input step failed is reported as skipped, with the reason. ``pins`` (step, backend)
    add rows named ``step@backend``, timed with that backend pinned (``NSA_<STEP>_BACKEND``).
    """
    cmp_block, cmp_stride, sel_block = shape.cmp_block, shape.cmp_stride, shape.sel_block
    num_selected, window, scale = shape.num_selected, shape.window, shape.scale
    done: dict[str, Any] = {}

    # Looked up on nsa_core at call time: the public, routed ops. As the core runs them: the
    # compressed branch first, its lse (where its backend yields one) handed to block scoring.
    def step_call(step: str) -> StepCall:
        if step == "compress":
            return StepCall(
                lambda k, v: (
                    nsa_core.compress(k, cmp_block, cmp_stride),
                    nsa_core.compress(v, cmp_block, cmp_stride),
                ),
                (inp.k, inp.v),
                2,
            )
        if step == "compressed":
            return StepCall(
                lambda q, k_cmp, v_cmp: nsa_core.compressed_attention_with_lse(
                    q, k_cmp, v_cmp, cmp_block, cmp_stride, scale
                ),
                (inp.q, *done["compress"]),
                1,
            )
        if step == "select_blocks":
            return StepCall(
                lambda q, k_cmp, lse: nsa_core.select_blocks(
                    q, k_cmp, cmp_block, cmp_stride, sel_block, num_selected, scale, lse=lse
                )[0],
                (inp.q, done["compress"][0], done["compressed"][1]),
                0,
            )
        if step == "selected":
            indices = done["select_blocks"]
            return StepCall(
                lambda q, k, v: nsa_core.selected_attention(q, k, v, indices, sel_block, scale),
                (inp.q, inp.k, inp.v),
                1,
            )
        if step == "sliding":
            return StepCall(
                lambda q, k, v: nsa_core.sliding_attention(q, k, v, window, scale),
                (inp.q, inp.k, inp.v),
                1,
            )
        return StepCall(
            nsa_core.gated_combine,
            (done["compressed"][0], done["selected"], done["sliding"], inp.gates),
            1,
        )

    def routed(op: str, requires_grad: bool) -> str:
        try:
            return routed_backend(op, op_context(shape, device, requires_grad))
        except Exception as exc:  # said in the row; the timing still runs
            return f"unknown (OpContext: {type(exc).__name__}: {exc})"

    rows: list[Row] = []
    plan = [(step, op, "") for step, op in STEPS]
    plan += [(step, dict(STEPS)[step], backend) for step, backend in pins]
    for mode in modes:
        for step, op, pinned in plan:
            name = f"{step}@{pinned}" if pinned else step
            row = shape.row("step", "nsa_core", mode, step=name)
            rows.append(row)
            missing = [s for s in STEP_NEEDS[step] if s not in done]
            if missing:
                row.status = f"skipped: needs the output of {', '.join(missing)}, which failed"
                continue
            pin = {BACKEND_TOGGLE[op]: pinned} if pinned else {}
            with toggles_overridden(**pin):
                row.backend = routed(op, mode == "fwdbwd")
                try:
                    call = step_call(step)
                    timed, leaves = step_timed_call(call, mode, seed)
                except Exception as exc:  # e.g. an OOM drawing the upstream gradients
                    row.status = failure_status(exc)
                    continue
                measure(row, timed, leaves, timer, device)
                if row.status == "ok" and step not in done and not pinned:
                    with torch.no_grad():
                        done[step] = call.fn(*call.inputs)
            del timed, leaves
    return rows


# ---------------------------------------------------------------------------------------------
# Derived columns


def add_ratios(rows: Sequence[Row]) -> None:
    """Fill ``vs_<peer>`` of method rows and ``share`` of step rows from rows of the same case."""
    by_case: dict[tuple[Any, ...], dict[str, Row]] = {}
    for row in rows:
        if row.kind == "method":
            by_case.setdefault(row.case_key(), {})[row.method] = row
    for case in by_case.values():
        for row in case.values():
            for peer in PEERS:
                other = case.get(peer)
                ratio = math.nan
                if row.ok and other is not None and other.ok and row.ms > 0:
                    ratio = other.ms / row.ms
                setattr(row, f"vs_{peer}", ratio)
    for row in rows:
        if row.kind != "step":
            continue
        core = by_case.get(row.case_key(), {}).get("nsa_core")  # same mode
        ok = row.ok and core is not None and core.ok and core.ms > 0
        row.share = row.ms / core.ms if ok and core is not None else math.nan


# ---------------------------------------------------------------------------------------------
# Outputs


def write_tables(rows: Sequence[Row], out: Path) -> tuple[Path, Path]:
    """layer.csv and layer.json under ``out`` (one schema; missing numbers are empty)."""
    return write_env_tables(ROW_COLUMNS, rows, out, "layer")


def read_rows(path: Path) -> list[Row]:
    """Rows of a ``layer.csv`` written by :func:`write_tables` (``env_*`` columns kept)."""
    types = {f.name: f.type for f in fields(Row)}
    rows = []
    with path.open(newline="") as f:
        for rec in csv.DictReader(f):
            values: dict[str, Any] = {}
            env = {}
            for key, text in rec.items():
                if key.startswith("env_"):
                    env[key] = text
                elif key in types:
                    kind = types[key]
                    if kind == "int":
                        values[key] = int(text)
                    elif kind == "float":
                        values[key] = float(text) if text != "" else math.nan
                    else:
                        values[key] = text
            rows.append(Row(**values, env=env))
    return rows


def _ms(row: Row | None) -> str:
    if row is None:
        return "-"
    if not row.ok:
        return row.status.split(":", 1)[0]
    return f"{row.ms:.3f}"


def _fmt(value: float, spec: str = ".3f") -> str:
    return finite_or_dash(value, spec)


def methods_table(rows: Sequence[Row]) -> list[str]:
    """One line per (head dims, mode, T): every method's ms, nsa_core's ratios and memory."""
    if not rows:
        return []
    first = rows[0]
    hidden = max(r.hidden_size for r in rows)
    lines = [
        f"### NSA layer: {first.dtype}, B={first.B}, HQ={first.HQ}, H={first.H}, "
        f"l={first.cmp_block}, d={first.cmp_stride}, l'={first.sel_block}, "
        f"n={first.num_selected}, w={first.window}"
        + (f"; nsa_module at hidden size {hidden}" if hidden else ""),
        "",
        "Medians in ms; `core vs X` is X's ms over nsa_core's (> 1: NSA is faster).",
        "",
        "| dk/dv | mode | T | "
        + " | ".join(f"{m} ms" for m in METHODS)
        + " | core vs fla | core vs sdpa | core vs fa2 | core peak MiB |",
        "|---|---|---:|" + "---:|" * (len(METHODS) + 4),
    ]
    by_case: dict[tuple[Any, ...], dict[str, Row]] = {}
    for r in rows:
        by_case.setdefault(r.case_key(), {})[r.method] = r
    for key in sorted(by_case, key=lambda k: (k[4], k[5], MODES.index(k[6]), k[7])):
        case = by_case[key]
        core = case.get("nsa_core")
        cells = [_ms(case.get(m)) for m in METHODS]
        if core is None:
            cells += ["-"] * (len(PEERS) + 1)
        else:
            cells += [_fmt(getattr(core, f"vs_{p}"), ".2f") for p in PEERS]
            cells.append(_fmt(core.peak_mib, ".0f"))
        lines.append(f"| {key[4]}/{key[5]} | {key[6]} | {key[7]} | " + " | ".join(cells) + " |")
    return lines


def steps_table(step_rows: Sequence[Row], method_rows: Sequence[Row]) -> list[str]:
    """One line per (head dims, mode, T): each step's ms, share of the core and backend.

    Steps timed with a pinned backend (``step@backend``) follow the sum, outside it.
    """
    if not step_rows:
        return []
    steps = [s for s, _ in STEPS]
    pinned = sorted({r.step for r in step_rows if "@" in r.step})
    lines = [
        "### Where the core's time goes: ms (share of nsa_core) backend",
        "",
        "Each step timed alone through its public op; fwdbwd: its forward and backward "
        "(select_blocks takes no gradient: forward).",
        "",
        "| dk/dv | mode | T | nsa_core ms | "
        + " | ".join(steps)
        + " | steps sum | other |"
        + "".join(f" {p} |" for p in pinned),
        "|---|---|---:|---:|" + "---|" * len(steps) + "---:|---:|" + "---|" * len(pinned),
    ]
    by_case: dict[tuple[Any, ...], dict[str, Row]] = {}
    for row in step_rows:
        by_case.setdefault(row.case_key(), {})[row.step] = row
    core_rows = {r.case_key(): r for r in method_rows if r.method == "nsa_core"}

    def cell(timed: Row) -> str:
        share = f" ({100 * timed.share:.0f}%)" if math.isfinite(timed.share) else ""
        # The table names the backend; the CSV keeps the full routing text.
        return f"{timed.ms:.3f}{share} {timed.backend.split(' (')[0]}"

    for key in sorted(by_case, key=lambda k: (k[4], k[5], MODES.index(k[6]), k[7])):
        case = by_case[key]
        cells = []
        total = 0.0
        for step in steps:
            timed = case.get(step)
            if timed is None or not timed.ok:
                cells.append(_ms(timed))
                total = math.nan
                continue
            total += timed.ms
            cells.append(cell(timed))
        extra = [cell(t) if t is not None and t.ok else _ms(t) for t in map(case.get, pinned)]
        core = core_rows.get(key)
        core_ms = core.ms if core is not None and core.ok else math.nan
        lines.append(
            f"| {key[4]}/{key[5]} | {key[6]} | {key[7]} | {_ms(core)} | "
            + " | ".join(cells)
            + f" | {_fmt(total)} | {_fmt(core_ms - total)} |"
            + "".join(f" {c} |" for c in extra)
        )
    return lines


def failures(rows: Sequence[Row]) -> list[str]:
    """Every row without a time: one line per (method or step, reason) with the cases it hit."""
    groups: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        if not r.ok:
            what = r.method + (f"/{r.step}" if r.step else "")
            groups.setdefault((what, r.status), []).append(f"{r.dk}/{r.dv} {r.mode} T={r.T}")
    lines = [
        f"- {what}: {status} ({len(cases)} case{'s' * (len(cases) > 1)}: {', '.join(cases)})"
        for (what, status), cases in groups.items()
    ]
    return ["### Rows without a time", "", *lines] if lines else []


def markdown(rows: Sequence[Row]) -> str:
    """The closing tables: the methods with their ratios, where the core forward's time goes,
    and the rows that did not run with their reasons."""
    method_rows = [r for r in rows if r.kind == "method"]
    step_rows = [r for r in rows if r.kind == "step"]
    parts = [methods_table(method_rows), steps_table(step_rows, method_rows), failures(rows)]
    return "\n\n".join("\n".join(p) for p in parts if p)


def write_plot(rows: Sequence[Row], path: Path) -> str | None:
    """layer.png, or why it was not written."""
    try:
        from nsa_bench.plot import plot_ms_vs_t
    except ImportError as exc:
        return f"PNG not written: {exc} (install nsa-bench[plot] for matplotlib)"
    series: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for r in rows:
        if r.kind == "method" and r.ok:
            panel = f"dk/dv = {r.dk}/{r.dv}"
            series.setdefault(panel, {}).setdefault(f"{r.method} {r.mode}", []).append((r.T, r.ms))
    first = next((r for r in rows if r.kind == "method"), None)
    title = "NSA layer vs peers"
    if first is not None:
        title += f" ({first.dtype}, HQ={first.HQ}, H={first.H}, B={first.B})"
    plot_ms_vs_t(series, path, title)
    return None


def write_outputs(rows: list[Row], out: Path, *, plot: bool) -> list[str]:
    """Ratios, CSV, JSON and (with ``plot``) the PNG and Markdown; returns the notes to print."""
    add_ratios(rows)
    csv_path, json_path = write_tables(rows, out)
    notes = [f"wrote {csv_path}", f"wrote {json_path}"]
    if plot:
        (out / "layer.md").write_text(markdown(rows) + "\n")
        notes.append(f"wrote {out / 'layer.md'}")
        why_not = write_plot(rows, out / "layer.png")
        notes.append(why_not or f"wrote {out / 'layer.png'}")
    return notes


# ---------------------------------------------------------------------------------------------
# CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--seqlens", default="8k,16k,32k,64k,128k", help="lengths T (8192 or 8k), comma-separated"
    )
    add_layer_heads_args(parser)
    parser.add_argument(
        "--head-dims", default="128/128,192/128", help="dk/dv pairs, comma-separated"
    )
    add_layer_blocks_args(parser)
    parser.add_argument("--hidden-size", type=int, default=2048, help="nsa_module's hidden size")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--modes", default="fwd,fwdbwd", help="fwd,fwdbwd")
    parser.add_argument("--methods", default=",".join(METHODS), help=",".join(METHODS))
    parser.add_argument(
        "--no-steps", action="store_true", help="skip the per-step breakdown of the core"
    )
    parser.add_argument(
        "--step-modes",
        default="fwd",
        help="modes of the per-step breakdown: fwd, fwdbwd or fwd,fwdbwd",
    )
    parser.add_argument(
        "--step-backends",
        default="",
        help="extra step rows with a backend pinned, e.g. sliding=triton_win (STEP@BACKEND)",
    )
    parser.add_argument("--out", default="artifacts/bench/layer/", help="output folder")
    parser.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="CSV",
        help="time nothing: rebuild every output from these layer.csv files",
    )
    add_device_arg(parser)
    parser.add_argument("--warmup-ms", type=float, default=25.0, help="do_bench warm-up (ms)")
    parser.add_argument("--rep-ms", type=float, default=100.0, help="do_bench repetition (ms)")
    parser.add_argument("--iters", type=int, default=3, help="timed runs on CPU")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up runs on CPU")
    parser.add_argument("--seed", type=int, default=0)


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _progress(row: Row) -> None:
    what = row.method + (f"/{row.step}" if row.step else "")
    ms = f"{row.ms:10.3f} ms" if math.isfinite(row.ms) else f"{'-':>10s} ms"
    peak = f" peak {row.peak_mib:8.0f} MiB" if math.isfinite(row.peak_mib) else ""
    _log(
        f"[layer] dk/dv={row.dk}/{row.dv} T={row.T:<7d} {row.mode:6s} {what:24s} "
        f"{ms}{peak}  {row.status}" + (f"  [{row.backend}]" if row.kind == "step" else "")
    )


def sweep(args: argparse.Namespace, out: Path) -> list[Row]:
    """Time every (head dims, T, mode, method) and the core's steps; outputs after every case."""
    device = torch.device(args.device)
    heads = parse_pairs(args.heads)
    if len(heads) != 1:
        raise argparse.ArgumentTypeError(f"--heads takes one HQ/H pair, got {args.heads!r}")
    hq, h = heads[0]
    head_dims = parse_pairs(args.head_dims)
    lengths = [parse_length(x) for x in args.seqlens.split(",") if x.strip()]
    modes = parse_names(args.modes, MODES)
    step_modes = parse_names(args.step_modes, MODES)
    pins = parse_step_backends(args.step_backends)
    methods = parse_names(args.methods, METHODS)
    timer = make_timer(
        device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, iters=args.iters, warmup=args.warmup
    )
    fla = load_fla() if "fla" in methods else Peer(None, "not requested")
    fa2 = load_fa2() if "fa2" in methods else Peer(None, "not requested")
    has_gqa = sdpa_has_gqa()
    _log(f"[layer] fla: {fla.info}; fa2: {fa2.info}; sdpa enable_gqa: {has_gqa}; on {device}")
    env = collect_columns()
    rows: list[Row] = []
    for dk, dv in head_dims:
        for length in lengths:
            shape = Shape(
                args.batch,
                length,
                hq,
                h,
                dk,
                dv,
                args.cmp_block,
                args.cmp_stride,
                args.sel_block,
                args.num_selected,
                args.window,
                args.dtype,
            )
            shape.config()  # a bad geometry stops the run here, before anything is timed
            _free(device)
            inp = make_inputs(shape, device, args.seed)
            here: list[Row] = []
            for mode in modes:
                for method in methods:
                    if method == "nsa_core":
                        row = bench_nsa_core(shape, inp, mode, timer, device)
                    elif method == "nsa_module":
                        row = bench_nsa_module(
                            shape, mode, args.hidden_size, timer, device, args.seed
                        )
                    elif method == "fla":
                        row = bench_fla(shape, inp, mode, fla, timer, device)
                    elif method == "sdpa":
                        row = bench_sdpa(shape, inp, mode, has_gqa, timer, device)
                    else:
                        row = bench_fa2(shape, inp, mode, fa2, timer, device)
                    _progress(row)
                    here.append(row)
            if not args.no_steps:
                for row in bench_steps(shape, inp, timer, device, step_modes, pins, args.seed):
                    _progress(row)
                    here.append(row)
            for row in here:
                row.env = dict(env)
            rows += here
            del inp
            write_outputs(rows, out, plot=False)
    return rows


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.merge:
        rows = [row for path in args.merge for row in read_rows(Path(path))]
    else:
        rows = sweep(args, out)
    notes = write_outputs(rows, out, plot=True)
    for note in notes:
        _log(f"[layer] {note}")
    print(markdown(rows))
    return 0
