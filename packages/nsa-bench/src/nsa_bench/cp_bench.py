"""``nsa-bench cp``: context-parallel NSA forward + backward per world size, with comm apart.

For each world size W (``--world-sizes``, default 1,2,4,8; on CUDA those above the visible GPU
count become ``skipped`` rows) and each length T (``--seqlens``, default 128k..1M, ascending),
every rank holds its shard of random q, k, v (one K/V shared by the three branches) and gates
(B=1, HQ=64, H=4, dk=192, dv=128, l=32, d=16, l'=64, n=16, w=512, bf16 on CUDA by default) and
runs :func:`nsa_core.context_parallel.context_parallel_nsa_attention` forward and backward.
Methods: ``cp`` (the sharded core, for each ``--sel-exchanges`` mode and ``--layout``) and, at
W=1, ``single`` (plain :func:`nsa_core.nsa_attention`, the baseline of ``vs_single``).

Per row: ``step_ms`` the median over ``--iters`` steps of the slowest rank's forward + backward
(all ranks start together after a barrier), ``tokens_per_s`` = B*T / step, ``vs_single`` = the
single-GPU step at that T over this row's (> 1 is faster). The exchanges are timed apart in
``--comm-iters`` more steps with a :class:`~nsa_core.context_parallel.CommTimer`, which
synchronizes around each exchange: ``comm_fwd_ms`` and ``comm_bwd_ms`` (slowest rank, mean per
step), ``comm_share`` their sum over that run's step time (``timed_step_ms``). ``peak_mib`` is
the largest per-rank peak (``torch.cuda.max_memory_allocated`` on CUDA; the process's peak RSS
on CPU, ``memory`` says which) and ``peak_mib_ranks`` every rank's, ``;``-separated.

Launch: by default the command spawns W processes per world size itself (one spawn per W,
lengths ascending: a failure, e.g. out of memory, ends that W's spawn and the longer lengths
become ``skipped`` rows). Under ``torchrun`` (``WORLD_SIZE`` set) it runs on that group only.
Process groups are NCCL on CUDA and gloo on CPU. Under ``--out`` (default
``artifacts/bench/cp/``): ``cp.csv`` and ``cp.json`` (one schema, the environment as ``env_*``
in every row), rewritten after every world size, and the Markdown table printed last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import resource
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

from nsa_bench.cases import DTYPES, MIB, Shape, failure_status, free_memory, row_columns
from nsa_bench.cli_args import (
    BLOCK_FLAGS,
    add_layer_blocks_args,
    add_layer_heads_args,
    add_seed_arg,
    block_geometry,
    blocks_config,
    device_name,
    names,
    non_negative_int,
    nsa_config,
    pair,
    positive_float,
    positive_int,
    positive_ints,
    seqlens,
)
from nsa_bench.env import collect_columns
from nsa_bench.tables import finite_or_dash, write_env_tables
from nsa_bench.timing import synchronize
from nsa_core import NSAConfig, nsa_attention
from nsa_core.context_parallel import (
    LAYOUTS,
    SEL_EXCHANGES,
    CommTimer,
    Layout,
    SelExchange,
    ShardPlan,
    context_parallel_nsa_attention,
)


@dataclass
class Row:
    """One timed (W, T, method, exchange); ``status`` is ``ok`` or why there is no time."""

    world_size: int
    T: int
    method: str
    sel_exchange: str
    layout: str
    dtype: str
    device: str
    status: str = "ok"
    step_ms: float = math.nan
    tokens_per_s: float = math.nan
    vs_single: float = math.nan
    comm_fwd_ms: float = math.nan
    comm_bwd_ms: float = math.nan
    timed_step_ms: float = math.nan
    comm_share: float = math.nan
    peak_mib: float = math.nan
    peak_mib_ranks: str = ""
    memory: str = ""
    iters: int = 0
    env: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


ROW_COLUMNS = row_columns(Row)


@dataclass(frozen=True)
class Settings:
    """What every rank of one world size runs (picklable for the spawned processes): one shape
    per length, ascending, all of one NSA config."""

    shapes: tuple[Shape, ...]
    config: NSAConfig
    device: str
    layout: Layout
    sel_exchanges: tuple[SelExchange, ...]
    iters: int
    warmup: int
    comm_iters: int
    seed: int
    timeout_s: float


# The settings that are flags of the same name, taken as the command line gives them.
SETTINGS_AS_GIVEN = ("device", "iters", "warmup", "comm_iters", "seed", "timeout_s")


# ------------------------------------------------------------------------------------- one rank


def _peak_mib(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / MIB, "cuda_max_allocated"
    # ru_maxrss is in KiB on Linux: the process's peak, imports included.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "cpu_max_rss"


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _local_inputs(
    shape: Shape, seed: int, plan: ShardPlan, rank: int, device: torch.device
) -> list[torch.Tensor]:
    """This rank's q, k, v, gates and output gradient, [B, T_local, ...], drawn on the device."""
    gen = torch.Generator(device=device).manual_seed(seed * 1009 + rank)
    dtype = shape.torch_dtype
    b, t_local = shape.batch, plan.local_tokens(rank)
    hq, h, dk, dv = shape.num_q_heads, shape.num_kv_heads, shape.head_dim_qk, shape.head_dim_v

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=device, dtype=dtype)

    gates = torch.rand(b, t_local, hq, 3, generator=gen, device=device, dtype=dtype)
    tensors = [rand(b, t_local, hq, dk), rand(b, t_local, h, dk), rand(b, t_local, h, dv), gates]
    return [*(t.requires_grad_() for t in tensors), rand(b, t_local, hq, dv)]


def _max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(x) for x in t.tolist()]


def _gather_floats(value: float, world: int, device: torch.device) -> list[float]:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t)
    return [float(x.item()) for x in out]


def time_case(
    s: Settings,
    shape: Shape,
    exchange: SelExchange | None,
    rank: int,
    world: int,
    device: torch.device,
) -> Row:
    """One row (``exchange`` None: the single-process baseline); every rank runs it and gets
    the complete row."""
    plan = ShardPlan(shape.seq_len, world, s.layout)
    row = case_row(s, world, shape, exchange, iters=s.iters)
    _reset_peak(device)
    q, k, v, gates, grad_out = _local_inputs(shape, s.seed, plan, rank, device)
    leaves = (q, k, v, gates)

    def step(timer: CommTimer | None) -> None:
        for t in leaves:
            t.grad = None
        if exchange is None:
            out = nsa_attention(q, k, v, gates, s.config)
        else:
            out = context_parallel_nsa_attention(
                q,
                k,
                v,
                gates,
                s.config,
                plan,
                sel_exchange=exchange,
                timer=timer,
            )
        torch.autograd.backward(out, grad_out)

    def timed(timer: CommTimer | None) -> float:
        synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        step(timer)
        synchronize(device)
        return (time.perf_counter() - start) * 1e3

    for _ in range(s.warmup):
        timed(None)
    steps = [timed(None) for _ in range(s.iters)]
    steps = _max_over_ranks(steps, device)  # a step lasts as long as its slowest rank
    row.step_ms = statistics.median(steps)
    row.tokens_per_s = shape.batch * shape.seq_len / (row.step_ms / 1e3)
    if exchange is not None and s.comm_iters > 0:
        timer = CommTimer()
        timed_steps = [timed(timer) for _ in range(s.comm_iters)]
        fwd, bwd, whole = _max_over_ranks(
            [
                timer.total("fwd:") / s.comm_iters * 1e3,
                timer.total("bwd:") / s.comm_iters * 1e3,
                statistics.mean(timed_steps),
            ],
            device,
        )
        row.comm_fwd_ms, row.comm_bwd_ms, row.timed_step_ms = fwd, bwd, whole
        row.comm_share = (fwd + bwd) / whole
    peak, row.memory = _peak_mib(device)
    peaks = _gather_floats(peak, world, device)
    row.peak_mib = max(peaks)
    row.peak_mib_ranks = ";".join(f"{p:.0f}" for p in peaks)
    return row


def _cases(s: Settings, world: int) -> list[tuple[Shape, SelExchange | None]]:
    """(shape, exchange) in run order: lengths ascending, the baseline (None) first at W=1."""
    cases: list[tuple[Shape, SelExchange | None]] = []
    for shape in s.shapes:
        if world == 1:
            cases.append((shape, None))
        cases += [(shape, exchange) for exchange in s.sel_exchanges]
    return cases


def _case_key(exchange: SelExchange | None) -> tuple[str, str]:
    """(method, sel_exchange) as the rows write them."""
    return ("single", "-") if exchange is None else ("cp", exchange)


def case_row(
    s: Settings, world: int, shape: Shape, exchange: SelExchange | None, **extra: Any
) -> Row:
    """The row of one case, its numbers still to come (``extra`` sets any column)."""
    method, name = _case_key(exchange)
    return Row(world, shape.seq_len, method, name, s.layout, shape.dtype, s.device, **extra)


def run_ranks(rank: int, world: int, s: Settings, rows_path: str, device: torch.device) -> None:
    """One rank of one world size: every case, rows appended to ``rows_path`` by rank 0.

    On a failure the rank records it (``<rows_path>.failed.<rank>``) and re-raises: its peers
    are stuck in a collective, so the launcher ends the whole world size.
    """
    if not dist.is_initialized():
        raise RuntimeError("run_ranks needs an initialized process group")
    for shape, exchange in _cases(s, world):
        try:
            row = time_case(s, shape, exchange, rank, world, device)
        except BaseException as exc:
            with open(f"{rows_path}.failed.{rank}", "w") as f:
                failure = {"T": shape.seq_len, "exchange": exchange, "status": failure_status(exc)}
                json.dump(failure, f)
            raise
        if rank == 0:
            with open(rows_path, "a") as f:
                f.write(json.dumps(asdict(row)) + "\n")
            _log(_progress(row))


def spawned_rank(rank: int, world: int, s: Settings, store_path: str, rows_path: str) -> None:
    """One rank of :func:`run_world`: a spawned process, or this one when ``world == 1``."""
    from nsa_bench.cli import register_kernels

    register_kernels()  # a spawned process starts with only the entry points' backends
    backend = "nccl" if s.device == "cuda" else "gloo"
    device = torch.device("cpu") if s.device == "cpu" else torch.device("cuda", rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif world > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(
        backend,
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=s.timeout_s),
    )
    try:
        dist.barrier()  # the communicator exists before the first point-to-point exchange
        run_ranks(rank, world, s, rows_path, device)
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------ launcher


def _read_rows(rows_path: Path) -> list[Row]:
    if not rows_path.exists():
        return []
    rows = []
    for line in rows_path.read_text().splitlines():
        rec = json.loads(line)
        rows.append(Row(**rec))
    return rows


def _failure_rows(s: Settings, world: int, done: list[Row], rows_path: Path, why: str) -> list[Row]:
    """Rows for the cases a failed world size left: the failing one with its status, then
    ``skipped`` for the rest."""
    failures = sorted(rows_path.parent.glob(rows_path.name + ".failed.*"))
    status = why
    if failures:
        status = json.loads(failures[0].read_text())["status"]
    finished = {(r.T, r.method, r.sel_exchange) for r in done}
    rows = []
    for shape, exchange in _cases(s, world):
        if (shape.seq_len, *_case_key(exchange)) in finished:
            continue
        rows.append(case_row(s, world, shape, exchange, status=status))
        status = "skipped: an earlier case of this world size failed"
    return rows


def run_world(s: Settings, world: int) -> list[Row]:
    """Run ``world`` ranks on this host and return their rows (failures become rows).

    ``world == 1`` runs in this process (a group of one); more ranks are spawned processes.
    """
    if s.device == "cuda" and world > torch.cuda.device_count():
        why = f"skipped: needs {world} GPUs, {torch.cuda.device_count()} visible"
        return [case_row(s, world, shape, e, status=why) for shape, e in _cases(s, world)]
    with tempfile.TemporaryDirectory(prefix="nsa-cp-") as tmp:
        rows_path = Path(tmp) / "rows.jsonl"
        args = (world, s, str(Path(tmp) / "store"), str(rows_path))
        try:
            if world == 1:
                try:
                    spawned_rank(0, *args)
                finally:
                    # The later world sizes' rank 0 shares GPU 0 with this process: give back
                    # what its caching allocator holds.
                    free_memory(torch.device(s.device))
            else:
                spawn(spawned_rank, args=args, nprocs=world, join=True)  # type: ignore[no-untyped-call]
        except Exception as exc:  # a rank failed: keep what finished, say why for the rest
            done = _read_rows(rows_path)
            first = str(exc).strip().splitlines()
            why = "error: " + (first[-1] if first else type(exc).__name__)[:300]
            return done + _failure_rows(s, world, done, rows_path, why)
        return _read_rows(rows_path)


def add_ratios(rows: Sequence[Row]) -> None:
    """vs_single: the single-process step at the same T over the row's step."""
    single = {r.T: r.step_ms for r in rows if r.method == "single" and r.ok}
    for row in rows:
        if row.ok and row.T in single:
            row.vs_single = single[row.T] / row.step_ms


# --------------------------------------------------------------------------------------- output


def write_tables(rows: Sequence[Row], out: Path) -> tuple[Path, Path]:
    """cp.csv and cp.json under ``out``."""
    return write_env_tables(ROW_COLUMNS, rows, out, "cp")


def table(rows: Sequence[Row]) -> list[str]:
    """The Markdown table of every row."""
    lines = [
        "| W | T | method | sel exchange | step ms | tokens/s | vs single | comm fwd ms "
        "| comm bwd ms | comm share | peak MiB/rank | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.world_size} | {r.T} | {r.method} | {r.sel_exchange} | "
            f"{finite_or_dash(r.step_ms, '.2f')} | {finite_or_dash(r.tokens_per_s, '.0f')} | "
            f"{finite_or_dash(r.vs_single, '.2f')} | {finite_or_dash(r.comm_fwd_ms, '.2f')} | "
            f"{finite_or_dash(r.comm_bwd_ms, '.2f')} | {finite_or_dash(r.comm_share, '.1%')} | "
            f"{finite_or_dash(r.peak_mib, '.0f')} | {r.status} |"
        )
    return lines


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _progress(row: Row) -> str:
    return (
        f"[cp] W={row.world_size} T={row.T:<8d} {row.method:6s} {row.sel_exchange:10s} "
        f"{finite_or_dash(row.step_ms, '10.2f')} ms  "
        f"comm {finite_or_dash(row.comm_fwd_ms, '.2f')}+"
        f"{finite_or_dash(row.comm_bwd_ms, '.2f')} ms  "
        f"peak {finite_or_dash(row.peak_mib, '.0f')} MiB  {row.status}"
    )


# ------------------------------------------------------------------------------------------ CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--world-sizes",
        type=positive_ints,
        default="1,2,4,8",
        help="ranks per run, comma-separated (spawned here)",
    )
    parser.add_argument(
        "--seqlens",
        type=seqlens,
        default="128k,256k,512k,1m",
        help="lengths T (131072, 128k or 1m)",
    )
    add_layer_heads_args(parser)
    parser.add_argument("--head-dims", type=pair, default="192/128", help="dk/dv")
    add_layer_blocks_args(parser)
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="bf16 on CUDA, fp32 on CPU by default"
    )
    parser.add_argument("--layout", choices=LAYOUTS, default="zigzag", help="how T is split")
    parser.add_argument(
        "--sel-exchanges",
        type=names(SEL_EXCHANGES),
        default="all_gather",
        help=f"selected-branch K/V exchanges to time, comma-separated: {', '.join(SEL_EXCHANGES)}",
    )
    parser.add_argument(
        "--device",
        type=device_name,
        choices=("cuda", "cpu"),
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="NCCL ranks on cuda, gloo ranks on cpu",
    )
    parser.add_argument("--iters", type=positive_int, default=5, help="timed steps per row")
    parser.add_argument("--warmup", type=non_negative_int, default=2, help="untimed steps first")
    parser.add_argument(
        "--comm-iters",
        type=non_negative_int,
        default=2,
        help="more steps with the exchanges timed apart (0: none)",
    )
    parser.add_argument(
        "--timeout-s", type=positive_float, default=600.0, help="collective timeout"
    )
    add_seed_arg(parser)
    parser.add_argument("--out", default="artifacts/bench/cp/", help="output folder")


def check_arguments(args: argparse.Namespace) -> None:
    """The heads, head dims and block geometry make an NSA config."""
    (hq, h), (dk, dv) = args.heads, args.head_dims
    nsa_config(
        {"num_q_heads": "--heads HQ", "num_kv_heads": "--heads H", **BLOCK_FLAGS}
        | {"head_dim_qk": "--head-dims dk", "head_dim_v": "--head-dims dv"},
        num_q_heads=hq,
        num_kv_heads=h,
        head_dim_qk=dk,
        head_dim_v=dv,
        **block_geometry(args),
    )


def settings(args: argparse.Namespace) -> Settings:
    """The run's settings from the parsed flags."""
    hq, h = args.heads
    dk, dv = args.head_dims
    # The exchanges in the order of SEL_EXCHANGES, each once.
    exchanges = tuple(x for x in SEL_EXCHANGES if x in args.sel_exchanges)
    layout = next(x for x in LAYOUTS if x == args.layout)
    dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    shapes = tuple(Shape(args.batch, t, hq, h, dk, dv, dtype) for t in sorted(args.seqlens))
    config = blocks_config(args, (hq, h), (dk, dv))
    given = {name: getattr(args, name) for name in SETTINGS_AS_GIVEN}
    return Settings(shapes, config, layout=layout, sel_exchanges=exchanges, **given)


def _finish(rows: list[Row], out: Path) -> None:
    add_ratios(rows)
    env = collect_columns()
    for row in rows:
        row.env = env
    csv_path, json_path = write_tables(rows, out)
    print("\n".join(table(rows)))
    _log(f"[cp] wrote {csv_path} and {json_path}")


def run(args: argparse.Namespace) -> int:
    s = settings(args)
    out = Path(args.out)
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return _run_under_torchrun(s, out)
    rows: list[Row] = []
    for world in args.world_sizes:
        _log(f"[cp] world size {world}: {', '.join(str(shape.seq_len) for shape in s.shapes)}")
        rows += run_world(s, world)
        _finish(rows, out)
    return 0 if all(r.ok or r.status.startswith(("skipped", "oom")) for r in rows) else 1


def _run_under_torchrun(s: Settings, out: Path) -> int:
    """One world size: the group torchrun made (env:// rendezvous)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cpu") if s.device == "cpu" else torch.device("cuda", local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if s.device == "cuda" else "gloo",
        timeout=datetime.timedelta(seconds=s.timeout_s),
    )
    try:
        dist.barrier()
        with tempfile.TemporaryDirectory(prefix="nsa-cp-") as tmp:
            rows_path = Path(tmp) / "rows.jsonl"
            try:
                run_ranks(rank, world, s, str(rows_path), device)
            except Exception:
                traceback.print_exc()
                raise
            if rank == 0:
                _finish(_read_rows(rows_path), out)
    finally:
        dist.destroy_process_group()
    return 0
