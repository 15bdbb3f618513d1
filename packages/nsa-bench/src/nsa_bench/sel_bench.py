"""``nsa-bench sel``: Triton selected attention against its fallbacks and against fla-core.

Two modes (``--mode``).

Rows mode (default, ``--mode rows``): N query rows (``--query-rows``) at the end of a sequence of
L keys (``--seqlens``), HQ=8 query heads sharing one kv head by default, each row selecting
``min(n, blocks)`` blocks of l' keys drawn by ``--dist`` (few: one contiguous run ending at the
row's own block; many: scattered distinct blocks; mixed: half of each). Methods: ``triton`` (this
package), ``sdpa`` (the packed peer: gather each row's selected keys, one SDPA call),
``reference`` (nsa_core's op, the registered fallback), and on request ``cuda`` (the
experimental CUDA C++ kernel of nsa_kernels.selected.cuda, forward only). Per L it reports the
speedup of Triton over the faster fallback, and recommends ``NSA_SEL_TRITON_MIN_LEN``: the
smallest L from which Triton is at least ``--min-speedup`` (1.2x) faster at that L and every
larger one, rounded up to a power of two. ``--mode seeds``, the earlier name of this mode, still
works and warns.

Prefill mode (``--mode prefill`` or ``--prefill``): B=1, T in ``--seqlens`` (8k..64k), HQ=64, H=4,
dk=dv=128, n=16, l'=64, bf16 (all configurable), forward and forward+backward,
``triton.testing.do_bench`` medians, with fla-core's selection kernel (``ParallelNSAFunction``,
i.e. ``parallel_nsa`` without compression or window) given the same block indices as a peer when
importable. ``--groups 1,2,4,8`` repeats the largest T with HQ = G * H; ``--configs
"a=1,b=2;..."`` times each tile config (:class:`nsa_kernels.selected.function.SelConfig`
fields) at the largest T.

Indices for prefill (:func:`nsa_block_indices`): forced {0, jt-1, jt} (the valid ones) plus
random distinct valid blocks up to n, ascending, -1 padded at the end: what NSA's top-n emits.
``--indices FILE`` takes a trained model's selections instead (:mod:`nsa_bench.sel_stats`; rows
``dist=file``): the first T rows of the file's first sequence, its kv heads cycled over H.

Every CSV row carries the environment (``env_*`` columns, :func:`nsa_bench.env.collect`). A short
table is printed last.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor

from nsa_bench.cases import DTYPES, Shape, row_columns
from nsa_bench.cli_args import (
    UsageError,
    add_do_bench_args,
    add_seed_arg,
    add_selection_args,
    check_tile_configs,
    comma_list,
    existing_file,
    names,
    non_negative_int,
    positive_float,
    positive_int,
    require_multiple,
    seqlens,
    why_no_cuda,
)
from nsa_bench.sel_stats import indices_for_bench
from nsa_bench.timing import make_timer

ROWS_METHODS = ("triton", "sdpa", "reference")
# Every method either mode can time (``_call``): the rows mode's, its opt-in ``cuda``, and the
# fla-core peer of the prefill mode.
METHODS = (*ROWS_METHODS, "cuda", "fla")
PASSES = ("fwd", "fwd_bwd")
MODES = ("rows", "prefill")
# Earlier name of the rows mode, still accepted (with a DeprecationWarning) for one release.
DEPRECATED_MODES = {"seeds": "rows"}
# Methods with a forward only: their fwd_bwd rows say so instead of timing anything.
FORWARD_ONLY = ("cuda",)
FALLBACKS = ("sdpa", "reference")


@dataclass
class Row:
    """One timed (shape, pass, method)."""

    mode: str
    pass_: str
    method: str
    dtype: str
    B: int
    T: int
    N: int
    HQ: int
    H: int
    G: int
    dk: int
    dv: int
    n: int
    sel_block: int
    dist: str
    config: str = ""
    ms: float = math.nan
    tflops: float = math.nan
    kv_gbps: float = math.nan
    speedup: float = math.nan
    status: str = "ok"


CSV_COLUMNS = row_columns(Row)


# ---------------------------------------------------------------------------------------------
# Block indices


def nsa_block_indices(
    batch: int, tq: int, h: int, n: int, sel_block: int, *, q_start: int = 0,
    generator: torch.Generator | None = None, device: torch.device | str = "cpu",
    chunk: int = 2048,
) -> torch.Tensor:  # fmt: skip
    """int32 [B, Tq, H, n]: forced {0, jt-1, jt} plus random distinct valid blocks, -1 padded.

    Row r sits at t = q_start + r and ``jt = t // sel_block``; valid blocks are 0..jt. The
    forced blocks that are valid always appear; the remaining slots take distinct valid blocks
    uniformly at random; a row with fewer than n valid blocks takes all of them. Ascending, with
    -1 padding at the end. Built ``chunk`` rows at a time (random keys per valid block, top-n).
    """
    out = torch.empty(batch, tq, h, n, dtype=torch.int32, device=device)
    for c0 in range(0, tq, chunk):
        c1 = min(tq, c0 + chunk)
        jt = (q_start + torch.arange(c0, c1, device=device)) // sel_block
        num_blocks = int(jt.max()) + 1
        blocks = torch.arange(num_blocks, device=device)
        keys = torch.rand(batch, c1 - c0, h, num_blocks, device=device, generator=generator)
        jt4 = jt.view(1, -1, 1, 1)
        forced = (blocks == 0) | (blocks == jt4) | (blocks == jt4 - 1)
        keys = torch.where(forced, 2.0, keys)
        keys = torch.where(blocks > jt4, -1.0, keys)
        top = torch.topk(keys, min(n, num_blocks), dim=-1)
        chosen = torch.where(top.values >= 0, top.indices, num_blocks + 1)
        chosen = torch.sort(chosen, dim=-1).values
        chosen = torch.where(chosen > num_blocks, -1, chosen)
        if chosen.shape[-1] < n:
            pad = chosen.new_full((*chosen.shape[:-1], n - chosen.shape[-1]), -1)
            chosen = torch.cat([chosen, pad], dim=-1)
        out[:, c0:c1] = chosen.to(torch.int32)
    return out


def dist_block_indices(
    batch: int, tq: int, h: int, n: int, sel_block: int, dist: str, *, q_start: int = 0,
    generator: torch.Generator | None = None, device: torch.device | str = "cpu",
) -> torch.Tensor:  # fmt: skip
    """int32 [B, Tq, H, n] for the rows mode's distributions (ascending, distinct, -1 at the end).

    ``few``: the run jt-n+1..jt; ``many``: n scattered distinct valid blocks; ``mixed``: the
    last n/2 blocks of the run plus scattered ones.
    """
    if dist not in ("few", "many", "mixed"):
        raise ValueError(f"dist must be few, many or mixed, got {dist!r}")
    jt = ((q_start + torch.arange(tq, device=device)) // sel_block).view(1, tq, 1, 1)
    num_blocks = int(jt.max()) + 1
    keys = torch.rand(batch, tq, h, num_blocks, device=device, generator=generator)
    keys = torch.where(torch.arange(num_blocks, device=device) > jt, -1.0, keys)
    top = torch.topk(keys, min(n, num_blocks), dim=-1)
    scattered = torch.where(top.values >= 0, top.indices, -1)
    run = jt - torch.arange(n, device=device)
    if dist == "few":
        idx = run.expand(batch, tq, h, n)
    elif dist == "many":
        idx = scattered
    else:
        half = n // 2
        idx = torch.cat([run[..., :half].expand(batch, tq, h, half), scattered], dim=-1)
    big = 1 << 30
    idx = torch.sort(torch.where(idx < 0, big, idx), dim=-1).values
    idx[..., 1:] = torch.where(idx[..., 1:] == idx[..., :-1], big, idx[..., 1:])
    idx = torch.sort(idx, dim=-1).values[..., :n]
    idx = torch.where(idx >= big, -1, idx)
    if idx.shape[-1] < n:
        idx = torch.cat([idx, idx.new_full((*idx.shape[:-1], n - idx.shape[-1]), -1)], -1)
    return idx.to(torch.int32)


def visible_keys(idx: torch.Tensor, sel_block: int, q_start: int, num_keys: int) -> int:
    """Sum over (batch, row, kv head) of the tokens each row sees (distinct blocks assumed)."""
    t = (q_start + torch.arange(idx.shape[1], device=idx.device)).view(1, -1, 1, 1)
    start = idx.to(torch.int64) * sel_block
    end = torch.minimum(torch.minimum(start + sel_block, t + 1), torch.tensor(num_keys))
    return int(torch.where(idx >= 0, (end - start).clamp_min(0), 0).sum())


# ---------------------------------------------------------------------------------------------
# Methods


def gathered_sdpa(
    q: Tensor, k: Tensor, v: Tensor, idx: Tensor, sel_block: int, q_start: int = 0
) -> Tensor:
    """The packed peer: gather each row's selected keys, then one masked SDPA call.

    q [B, Tq, HQ, dk], k/v [B, Tk, H, *], idx [B, Tq, H, n] -> o [B, Tq, HQ, dv]. Memory
    O(B * Tq * H * n * l' * (dk + dv)): for the rows mode's shapes, not for long prefill.
    """
    batch, tq, hq, dk = q.shape
    h, dv = k.shape[2], v.shape[3]
    g = hq // h
    offs = torch.arange(sel_block, device=q.device)
    pos = (idx.to(torch.int64).clamp_min(0).unsqueeze(-1) * sel_block + offs).flatten(-2)
    t = (q_start + torch.arange(tq, device=q.device)).view(1, tq, 1, 1)
    live = (idx >= 0).repeat_interleave(sel_block, dim=-1) & (pos <= t)
    pos = pos.clamp_max(k.shape[1] - 1)
    b_ix = torch.arange(batch, device=q.device).view(batch, 1, 1, 1)
    h_ix = torch.arange(h, device=q.device).view(1, 1, h, 1)
    kg = k[b_ix, pos, h_ix]  # [B, Tq, H, L, dk]
    vg = v[b_ix, pos, h_ix]
    qq = q.view(batch * tq * h, 1, g, dk)
    mask = live.view(batch * tq * h, 1, 1, -1)
    o = torch.nn.functional.scaled_dot_product_attention(
        qq, kg.view(batch * tq * h, 1, -1, dk), vg.view(batch * tq * h, 1, -1, dv), attn_mask=mask
    )
    return torch.nan_to_num(o, nan=0.0).view(batch, tq, hq, dv)


def load_fla() -> tuple[Callable[..., torch.Tensor] | None, str]:
    """fla-core's selection autograd Function and its version, or (None, why not)."""
    try:
        import fla
        from fla.ops.nsa.parallel import ParallelNSAFunction
    except Exception as exc:  # any import failure means "no peer", with the reason recorded
        return None, f"fla unavailable: {type(exc).__name__}: {exc}"
    return ParallelNSAFunction.apply, str(getattr(fla, "__version__", "?"))


def _timer(
    args: argparse.Namespace, device: torch.device
) -> Callable[[Callable[[], object]], float]:
    """do_bench in prefill mode on CUDA, else ``--iters`` runs after ``--warmup``."""
    timer = make_timer(
        device,
        use_do_bench=args.prefill and device.type == "cuda",
        warmup_ms=args.warmup_ms,
        rep_ms=args.rep_ms,
        iters=args.iters,
        warmup=args.warmup,
    )
    return lambda fn: timer(fn, ())


@dataclass
class Problem:
    """``shape`` holds the T keys; q, do [B, N, HQ, *] are the N query rows at their end
    (``q_start = T - N``); idx [B, N, H, n] their selected blocks of ``sel_block`` keys."""

    shape: Shape
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    idx: torch.Tensor
    do: torch.Tensor
    sel_block: int
    q_start: int

    @property
    def group(self) -> int:
        return self.shape.group

    def row(self, mode: str, pass_: str, method: str, dist: str, **extra: Any) -> Row:
        """A row of this problem, its measurements still to come (``extra`` sets any column)."""
        rows, n = self.q.shape[1], self.idx.shape[-1]
        problem = {**self.shape.columns(), "N": rows, "n": n, "sel_block": self.sel_block}
        return Row(mode=mode, pass_=pass_, method=method, **problem, dist=dist, **extra)


def _call(
    method: str,
    p: Problem,
    config: Any,
    fla_fn: Callable[..., torch.Tensor] | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> torch.Tensor:
    if method == "triton":
        from nsa_kernels.selected.function import selected_attention_triton

        return selected_attention_triton(
            q, k, v, p.idx, p.sel_block, q_start=p.q_start, config=config
        )
    if method == "sdpa":
        return gathered_sdpa(q, k, v, p.idx, p.sel_block, p.q_start)
    if method == "reference":
        from nsa_core.reference.selected_attention import selected_attention

        return selected_attention(q, k, v, p.idx, p.sel_block, q_start=p.q_start)
    if method == "cuda":
        from nsa_kernels.selected.cuda.selected import selected_attention_cuda

        return selected_attention_cuda(q, k, v, p.idx, p.sel_block, q_start=p.q_start)
    if method == "fla":
        assert fla_fn is not None
        if p.q_start:
            raise ValueError("fla peer runs prefill only (q_start == 0)")
        n = p.idx.shape[-1]
        return fla_fn(q, k, v, p.idx, n, p.sel_block, q.shape[-1] ** -0.5, None)
    raise ValueError(f"unknown method {method!r}")


def time_method(
    method: str,
    p: Problem,
    pass_: str,
    bench: Callable[[Callable[[], object]], float],
    *,
    config: Any = None,
    fla_fn: Callable[..., torch.Tensor] | None = None,
) -> tuple[float, str]:
    """(median ms, status) of one pass; failures give (nan, the error) instead of raising."""
    if pass_ != "fwd" and method in FORWARD_ONLY:
        return math.nan, f"n/a: {method} is forward only"
    try:
        if pass_ == "fwd":
            with torch.no_grad():
                _call(method, p, config, fla_fn, p.q, p.k, p.v)
                ms = bench(lambda: _call(method, p, config, fla_fn, p.q, p.k, p.v))
        else:
            leaves = [t.detach().clone().requires_grad_() for t in (p.q, p.k, p.v)]

            def step() -> None:
                for t in leaves:
                    t.grad = None
                out = _call(method, p, config, fla_fn, *leaves)
                out.backward(p.do)  # type: ignore[no-untyped-call]

            step()
            ms = bench(step)
    except Exception as exc:  # a method that cannot run a shape is reported, not fatal
        msg = f"{type(exc).__name__}: {exc}".replace("\n", " ")
        return math.nan, ("refused: " if "Group size" in msg else "error: ") + msg[:200]
    return ms, "ok"


def _fill_rates(row: Row, p: Problem, visible: int, blocks: int) -> None:
    if not math.isfinite(row.ms) or row.ms <= 0:
        return
    flops = 2.0 * visible * p.group * (row.dk + row.dv)
    if row.pass_ == "fwd_bwd":
        flops *= 3.5  # backward counted as 2.5x the forward's matmuls (the usual convention)
    row.tflops = flops / (row.ms * 1e9)
    kv = blocks * p.sel_block * (row.dk + row.dv) * p.q.element_size()
    row.kv_gbps = kv / (row.ms * 1e6)


def make_problem(
    shape: Shape, tq: int, n: int, sel_block: int, device: torch.device, dist: str, seed: int
) -> Problem:
    """``tq`` query rows at the end of ``shape``'s keys, each selecting ``n`` blocks as ``dist``
    draws them (``nsa``: :func:`nsa_block_indices`, else :func:`dist_block_indices`)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    batch, tk, hq, h = shape.batch, shape.seq_len, shape.num_q_heads, shape.num_kv_heads
    dk, dv, dtype = shape.head_dim_qk, shape.head_dim_v, shape.torch_dtype
    q_start = tk - tq
    q = torch.randn(batch, tq, hq, dk, device=device, generator=gen).to(dtype)
    k = torch.randn(batch, tk, h, dk, device=device, generator=gen).to(dtype)
    v = torch.randn(batch, tk, h, dv, device=device, generator=gen).to(dtype)
    do = torch.randn(batch, tq, hq, dv, device=device, generator=gen).to(dtype)
    if dist == "nsa":
        idx = nsa_block_indices(
            batch, tq, h, n, sel_block, q_start=q_start, generator=gen, device=device
        )
    else:
        idx = dist_block_indices(
            batch, tq, h, n, sel_block, dist, q_start=q_start, generator=gen, device=device
        )
    return Problem(shape, q, k, v, idx, do, sel_block, q_start)


# ---------------------------------------------------------------------------------------------
# Threshold


def recommend_min_l(rows: Sequence[Row], min_speedup: float) -> int | None:
    """Smallest L (rounded up to a power of two) from which Triton is >= min_speedup faster than
    the faster fallback at that L and at every larger measured L; None if there is none."""
    by_l: dict[int, float] = {}
    for row in rows:
        if row.method == "triton" and math.isfinite(row.speedup):
            by_l[row.T] = min(by_l.get(row.T, math.inf), row.speedup)
    best: int | None = None
    for length in sorted(by_l, reverse=True):
        if by_l[length] < min_speedup:
            break
        best = length
    if best is None:
        return None
    return 1 << (best - 1).bit_length()


# ---------------------------------------------------------------------------------------------
# CLI


# Defaults that differ by mode, (rows, prefill): the flags of these names default to None and
# take the value of the mode that runs.
MODE_DEFAULTS: dict[str, tuple[Any, Any]] = {
    "heads": (8, 64),
    "kv_heads": (1, 4),
    "seqlens": ((64, 128, 256, 512, 1024), (8192, 16384, 32768, 65536)),
    "dtype": ("fp16", "bf16"),
    "methods": (ROWS_METHODS, ("triton", "fla")),
    "passes": (("fwd",), PASSES),
}
# Flags that only the prefill mode reads, by dest: given in rows mode they are refused, not
# ignored.
PREFILL_ONLY = {
    "groups": "--groups",
    "configs": "--configs",
    "probe": "--probe",
    "indices": "--indices",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mode",
        choices=(*MODES, *DEPRECATED_MODES),
        default=None,
        help="rows (default): N query rows at the end of L keys; prefill: long prefill "
        "(as --prefill); 'seeds' is the earlier name of rows, deprecated",
    )
    parser.add_argument(
        "--query-rows", type=positive_int, default=1024, help="query rows N (rows mode)"
    )
    parser.add_argument(
        "--heads",
        type=positive_int,
        default=None,
        help="query heads HQ (default 8 rows, 64 prefill)",
    )
    parser.add_argument(
        "--kv-heads", type=positive_int, default=None, help="kv heads H (default 1 rows, 4 prefill)"
    )
    parser.add_argument("--dk", type=positive_int, default=128, help="query/key head dim")
    parser.add_argument("--dv", type=positive_int, default=128, help="value head dim")
    parser.add_argument(
        "--seqlens",
        type=seqlens,
        default=None,
        help="lengths: keys L (rows mode, default 64..1024) or prefill T (default 8k..64k)",
    )
    parser.add_argument(
        "--dist",
        default="many",
        choices=("few", "many", "mixed", "nsa"),
        help="block distribution (rows mode)",
    )
    add_selection_args(parser)
    parser.add_argument(
        "--dtype",
        default=None,
        choices=sorted(DTYPES),
        help="default fp16 (rows mode), bf16 (prefill)",
    )
    parser.add_argument(
        "--methods",
        type=names(METHODS),
        default=None,
        help="rows: triton,sdpa,reference (default), cuda; prefill: triton,fla (default), cuda",
    )
    parser.add_argument(
        "--pass",
        dest="passes",
        type=names(PASSES),
        default=None,
        help="fwd,fwd_bwd (default: fwd in rows mode, both in prefill)",
    )
    parser.add_argument("--iters", type=positive_int, default=50, help="timed runs (rows mode)")
    parser.add_argument(
        "--warmup", type=non_negative_int, default=10, help="warm-up runs (rows mode)"
    )
    parser.add_argument("--min-speedup", type=positive_float, default=1.2, help="threshold rule")
    parser.add_argument("--prefill", action="store_true", help="long-prefill mode (--mode prefill)")
    parser.add_argument(
        "--groups",
        type=comma_list(positive_int, empty_ok=True),
        default="",
        help="prefill: G sweep at the largest T, e.g. 1,2,4,8",
    )
    parser.add_argument(
        "--configs",
        default="",
        help="prefill: ';'-separated SelConfig strings timed at the largest T",
    )
    parser.add_argument(
        "--probe",
        action="store_true",
        help="prefill: also time the K/V gather alone (bandwidth ceiling)",
    )
    parser.add_argument(
        "--indices",
        type=existing_file,
        default=None,
        help="prefill: block indices from FILE (nsa_bench.sel_stats, e.g. `nsa-bench needle`'s "
        "sel_indices_T<T>_layer<i>.pt) instead of random ones; kv heads cycled, T up to the file's",
    )
    add_do_bench_args(parser)
    add_seed_arg(parser)
    parser.add_argument(
        "--csv",
        nargs="?",
        const="-",
        default=None,
        help="write CSV rows to PATH (no PATH: to stdout)",
    )
    parser.add_argument("--json", default=None, help="write JSON rows to PATH")


def with_mode_defaults(args: argparse.Namespace, mode: str) -> argparse.Namespace:
    """``args`` with the :data:`MODE_DEFAULTS` of ``mode`` where a flag was not given."""
    values = vars(args).copy()
    for dest, defaults in MODE_DEFAULTS.items():
        if values[dest] is None:
            values[dest] = defaults[MODES.index(mode)]
    return argparse.Namespace(**values)


def check_arguments(args: argparse.Namespace) -> None:
    """One mode, its flags only, a CUDA GPU for prefill, heads that group, and prefill's tile
    configs known to SelConfig."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # run() gives the warning
        try:
            mode = resolve_mode(args.mode, args.prefill)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    if mode == "rows":
        given = [flag for dest, flag in PREFILL_ONLY.items() if getattr(args, dest)]
        if given:
            raise UsageError(f"{', '.join(given)}: read in prefill mode only (--mode prefill)")
    elif not torch.cuda.is_available():
        raise UsageError(f"--mode prefill needs a CUDA GPU ({why_no_cuda()})")
    full = with_mode_defaults(args, mode)
    require_multiple(full.heads, "--heads", full.kv_heads, "--kv-heads")
    if mode == "prefill" and args.configs:
        from nsa_kernels.selected.function import parse_config

        check_tile_configs("--configs", parse_config, [c for c in args.configs.split(";") if c])


def _env() -> dict[str, str]:
    try:
        from nsa_bench.env import collect_columns
    except ImportError as exc:
        return {"env_error": str(exc)}
    return collect_columns()


def _rows(args: argparse.Namespace, device: torch.device) -> list[Row]:
    dtype, methods, passes = args.dtype, args.methods, args.passes
    bench = _timer(args, device)
    rows: list[Row] = []
    for length in args.seqlens:
        tq = min(args.query_rows, length)
        n = min(args.num_selected, -(-length // args.sel_block))
        shape = Shape(1, length, args.heads, args.kv_heads, args.dk, args.dv, dtype)
        p = make_problem(shape, tq, n, args.sel_block, device, args.dist, args.seed)
        visible = visible_keys(p.idx, p.sel_block, p.q_start, length)
        blocks = int((p.idx >= 0).sum())
        for pass_ in passes:
            here = []
            for method in methods:
                ms, status = time_method(method, p, pass_, bench)
                row = p.row("rows", pass_, method, args.dist, ms=ms, status=status)
                _fill_rates(row, p, visible, blocks)
                here.append(row)
            fallback = min(
                (r.ms for r in here if r.method in FALLBACKS and math.isfinite(r.ms)),
                default=math.nan,
            )
            for row in here:
                row.speedup = fallback / row.ms if math.isfinite(row.ms) else math.nan
            rows += here
    return rows


def _prefill(args: argparse.Namespace, device: torch.device) -> list[Row]:
    from nsa_kernels.selected.function import parse_config

    dtype, methods, passes = args.dtype, args.methods, args.passes
    bench = _timer(args, device)
    fla_fn, fla_info = load_fla() if "fla" in methods else (None, "not requested")
    print(f"# fla peer: {fla_info}", file=sys.stderr)
    lengths = args.seqlens
    h = args.kv_heads
    runs: list[tuple[str, int, int, str]] = [("prefill", t, args.heads, "") for t in lengths]
    runs += [("groups", max(lengths), g * h, "") for g in args.groups]
    runs += [("configs", max(lengths), args.heads, c) for c in args.configs.split(";") if c]
    rows: list[Row] = []

    def prefill_problem(t: int, hq: int) -> Problem:
        """B = 1, Tq = Tk = t, hq query heads over the h kv heads, NSA's index rows."""
        shape = Shape(1, t, hq, h, args.dk, args.dv, dtype)
        return make_problem(shape, t, args.num_selected, args.sel_block, device, "nsa", args.seed)

    cache: dict[tuple[int, int], Problem] = {}
    for mode, t, hq, cfg_text in runs:
        key = (t, hq)
        if key not in cache:
            cache.clear()
            torch.cuda.empty_cache() if device.type == "cuda" else None
            cache[key] = prefill_problem(t, hq)
            if args.indices:
                # Real selections from a trained model in place of the random ones.
                real = indices_for_bench(args.indices, t, h, args.num_selected, args.sel_block)
                cache[key].idx = real.to(device)
        p = cache[key]
        visible = visible_keys(p.idx, p.sel_block, 0, t)
        blocks = int((p.idx >= 0).sum())
        config = parse_config(cfg_text) if cfg_text else None
        for pass_ in passes:
            here = []
            for method in methods if mode != "configs" else ["triton"]:
                if method == "fla" and fla_fn is None:
                    ms, status = math.nan, fla_info
                else:
                    ms, status = time_method(method, p, pass_, bench, config=config, fla_fn=fla_fn)
                dist = "file" if args.indices else "nsa"
                row = p.row(mode, pass_, method, dist, config=cfg_text, ms=ms, status=status)
                _fill_rates(row, p, visible, blocks)
                here.append(row)
                print(
                    f"# {mode} T={t} G={p.group} {pass_} {method} {cfg_text} {ms:.3f} ms {status}",
                    file=sys.stderr,
                    flush=True,
                )
            peer = next((r.ms for r in here if r.method == "fla" and math.isfinite(r.ms)), math.nan)
            for row in here:
                row.speedup = peer / row.ms if math.isfinite(row.ms) else math.nan
            rows += here
    if args.probe:
        t = max(lengths)
        p = prefill_problem(t, args.heads)
        # The probe's kernel needs triton (and TMA descriptors): imported only when asked for.
        from nsa_bench.gather_probe import run_probe

        for name, ms, gbps in run_probe(p.k, p.v, p.idx, p.sel_block, bench):
            row = p.row("probe", "fwd", "gather", "nsa", config=name, ms=ms, kv_gbps=gbps)
            print(f"# probe {name} {ms:.3f} ms {gbps:.0f} GB/s", file=sys.stderr, flush=True)
            rows.append(row)
    return rows


def _write(rows: Sequence[Row], env: dict[str, str], args: argparse.Namespace) -> None:
    columns = CSV_COLUMNS + sorted(env)
    records = []
    for row in rows:
        record: dict[str, Any] = asdict(row)
        record.update(env)
        records.append(record)
    if args.csv:
        stream = sys.stdout if args.csv == "-" else open(args.csv, "w", newline="")  # noqa: SIM115
        try:
            writer = csv.DictWriter(stream, fieldnames=columns)
            writer.writeheader()
            writer.writerows(records)
        finally:
            if stream is not sys.stdout:
                stream.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1, default=str)


def format_table(rows: Sequence[Row]) -> str:
    head = (
        f"{'mode':8s} {'pass':7s} {'method':9s} {'T':>6s} {'G':>3s} {'ms':>9s} "
        f"{'TFLOP/s':>8s} {'KV GB/s':>8s} {'speedup':>7s}  config/status"
    )
    lines = [head]
    for r in rows:
        note = r.config if r.status == "ok" else r.status[:60]
        lines.append(
            f"{r.mode:8s} {r.pass_:7s} {r.method:9s} {r.T:6d} {r.G:3d} {r.ms:9.3f} "
            f"{r.tflops:8.1f} {r.kv_gbps:8.0f} {r.speedup:7.2f}  {note}"
        )
    return "\n".join(lines)


def resolve_mode(mode: str | None, prefill: bool) -> str:
    """The mode of ``--mode`` and ``--prefill``: ``rows`` or ``prefill``.

    A deprecated name warns (DeprecationWarning) and gives its current one; ``--prefill`` with
    another ``--mode`` is a contradiction and raises ValueError.
    """
    if mode in DEPRECATED_MODES:
        current = DEPRECATED_MODES[mode]
        warnings.warn(
            f"nsa-bench sel --mode {mode} is deprecated; use --mode {current}",
            DeprecationWarning,
            stacklevel=2,
        )
        mode = current
    if prefill:
        if mode not in (None, "prefill"):
            raise ValueError(f"--prefill contradicts --mode {mode}")
        return "prefill"
    return mode or "rows"


def run(args: argparse.Namespace) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    mode = resolve_mode(args.mode, args.prefill)
    args = with_mode_defaults(args, mode)
    # The timers and the recommendation read the flag; the mode sets it.
    args.prefill = mode == "prefill"
    rows = _prefill(args, device) if args.prefill else _rows(args, device)
    _write(rows, _env(), args)
    print(format_table(rows))
    if not args.prefill:
        rec = recommend_min_l(rows, args.min_speedup)
        print(
            f"recommended NSA_SEL_TRITON_MIN_LEN: {rec if rec is not None else 'none'} "
            f"(smallest L with Triton >= {args.min_speedup}x the faster fallback from there on)"
        )
    return 0
