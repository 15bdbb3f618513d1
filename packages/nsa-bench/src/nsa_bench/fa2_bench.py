"""``nsa-bench fa2``: FlashAttention-2 against its torch fallbacks, per branch, over T and D.

For each branch (sliding, compressed), head dim D (dk = dv = D) and length T, every method
(``fa2``, ``flex``, ``sdpa``, optionally ``reference``) runs the same op on the same inputs and is
timed with ``triton.testing.do_bench`` (median ms) on CUDA, or the host clock on CPU (smoke runs
only). Modes: ``fwd`` and ``fwd_bwd`` (forward plus backward of a fixed upstream gradient).

One CSV row per (branch, mode, D, T, method) with the shapes, ``ms``, ``fa2_speedup`` (this
method's time over FA-2's: how many times faster FA-2 is), ``status`` and the environment as
``env_*`` columns. The summary names, per branch, the smallest T from which FA-2 is at least
``--min-speedup`` (1.2x) faster than the best fallback at every measured T and D: the value to
give NSA_WIN_FA2_MIN_LEN / NSA_CMP_FA2_MIN_LEN. It also says from which T FlexAttention beats the
chunked SDPA fallback.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nsa_bench.cli_args import (
    add_batch_arg,
    add_compression_args,
    add_device_arg,
    add_do_bench_args,
    add_seed_arg,
    names,
    positive_float,
    positive_int,
    positive_ints,
    require_multiple,
    seqlens,
)
from nsa_bench.env import collect
from nsa_bench.timing import clear_grads, do_bench_median_ms, median_ms
from nsa_core.blocks import num_cmp_blocks
from nsa_core.reference import compressed_attention, sliding_attention

BRANCHES = ("sliding", "compressed")
METHODS = ("fa2", "flex", "sdpa", "reference")
FALLBACKS = ("flex", "sdpa")
MODES = ("fwd", "fwd_bwd")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
CSV_COLUMNS = (
    "branch",
    "mode",
    "method",
    "dtype",
    "B",
    "T",
    "HQ",
    "H",
    "dk",
    "dv",
    "window",
    "cmp_block",
    "cmp_stride",
    "ms",
    "fa2_speedup",
    "status",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--branches", type=names(BRANCHES), default="sliding,compressed", help="sliding,compressed"
    )
    parser.add_argument(
        "--seqlens",
        type=seqlens,
        default="256,512,1024,2048,4096,8192,16384",
        help="lengths T (8192 or 8k), comma-separated",
    )
    parser.add_argument(
        "--head-dims", type=positive_ints, default="64,128", help="head dims D (dk = dv) to sweep"
    )
    add_batch_arg(parser)
    parser.add_argument("--heads", type=positive_int, default=64, help="query heads HQ")
    parser.add_argument("--kv-heads", type=positive_int, default=4, help="kv heads H")
    parser.add_argument("--window", type=positive_int, default=512, help="sliding window w")
    add_compression_args(parser)
    parser.add_argument(
        "--methods", type=names(METHODS), default="fa2,flex,sdpa", help="fa2,flex,sdpa,reference"
    )
    parser.add_argument("--modes", type=names(MODES), default="fwd,fwd_bwd", help="fwd,fwd_bwd")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    add_device_arg(parser)
    add_do_bench_args(parser)
    parser.add_argument("--min-speedup", type=positive_float, default=1.2, help="cutoff rule")
    parser.add_argument("--csv", default="fa2_bench.csv", help="output CSV path")
    add_seed_arg(parser)


@dataclass(frozen=True)
class Case:
    branch: str
    mode: str
    dtype: torch.dtype
    batch: int
    length: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    window: int
    cmp_block: int
    cmp_stride: int


def _methods() -> dict[str, dict[str, Callable[..., torch.Tensor]]]:
    from nsa_kernels.common.flex import compressed_attention_flex, sliding_attention_flex
    from nsa_kernels.common.sdpa import compressed_attention_sdpa, sliding_attention_sdpa
    from nsa_kernels.compressed.fa2 import compressed_attention_fa2
    from nsa_kernels.sliding.fa2 import sliding_attention_fa2

    return {
        "sliding": {
            "fa2": sliding_attention_fa2,
            "flex": sliding_attention_flex,
            "sdpa": sliding_attention_sdpa,
            "reference": sliding_attention,
        },
        "compressed": {
            "fa2": compressed_attention_fa2,
            "flex": compressed_attention_flex,
            "sdpa": compressed_attention_sdpa,
            "reference": compressed_attention,
        },
    }


def unavailable_reason(method: str, case: Case, device: torch.device) -> str | None:
    """Why ``method`` cannot run ``case`` here (reported in the CSV), or None."""
    if method == "fa2":
        from nsa_kernels.common.flash import unsupported_reason

        return unsupported_reason(device, case.dtype, case.head_dim, case.head_dim)
    if method == "flex":
        from nsa_kernels.common.flex import flex_missing_reason

        if device.type != "cuda":
            return "FlexAttention is timed compiled, on CUDA only"
        return flex_missing_reason()
    return None


def make_call(
    case: Case, fn: Callable[..., torch.Tensor], device: torch.device, seed: int
) -> tuple[Callable[[], Any], list[torch.Tensor]]:
    """A zero-argument call of ``fn`` on fresh inputs for ``case`` and the tensors to un-grad."""
    gen = torch.Generator(device=device).manual_seed(seed)
    grad = case.mode == "fwd_bwd"
    b, t, hq, h, d = case.batch, case.length, case.num_q_heads, case.num_kv_heads, case.head_dim
    tk = t if case.branch == "sliding" else num_cmp_blocks(t, case.cmp_block, case.cmp_stride)

    def rand(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, device=device, generator=gen).to(case.dtype)
        return x.requires_grad_(grad)

    q, k, v = rand(b, t, hq, d), rand(b, tk, h, d), rand(b, tk, h, d)
    if case.branch == "sliding":

        def forward() -> torch.Tensor:
            return fn(q, k, v, case.window)
    else:

        def forward() -> torch.Tensor:
            return fn(q, k, v, case.cmp_block, case.cmp_stride)

    if not grad:

        def call() -> Any:
            with torch.no_grad():
                return forward()

        return call, []
    upstream = torch.randn(b, t, hq, d, device=device, generator=gen).to(case.dtype)

    def call_bwd() -> Any:
        torch.autograd.backward(forward(), upstream)

    return call_bwd, [q, k, v]


def time_ms(
    call: Callable[[], Any],
    grads: list[torch.Tensor],
    device: torch.device,
    warmup: float,
    rep: float,
) -> float:
    """Median milliseconds of ``call``: triton's do_bench on CUDA, the host clock elsewhere."""
    if device.type == "cuda":
        return do_bench_median_ms(call, warmup_ms=warmup, rep_ms=rep, grads=grads)
    return median_ms(call, iters=3, warmup=1, device=device, setup=clear_grads(grads))


def _case_columns(case: Case) -> dict[str, Any]:
    return {
        "branch": case.branch,
        "mode": case.mode,
        "dtype": str(case.dtype).replace("torch.", ""),
        "B": case.batch,
        "T": case.length,
        "HQ": case.num_q_heads,
        "H": case.num_kv_heads,
        "dk": case.head_dim,
        "dv": case.head_dim,
        "window": case.window,
        "cmp_block": case.cmp_block,
        "cmp_stride": case.cmp_stride,
    }


def measure(
    cases: Iterable[Case],
    methods: Sequence[str],
    device: torch.device,
    *,
    warmup: float,
    rep: float,
    seed: int,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """Time every method on every case; one row per (case, method), speedups filled in."""
    table = _methods()
    rows: list[dict[str, Any]] = []
    for case in cases:
        case_rows = []
        for method in methods:
            row = {**_case_columns(case), "method": method, "ms": "", "fa2_speedup": ""}
            reason = unavailable_reason(method, case, device)
            if reason is not None:
                row["status"] = f"unavailable: {reason}"
            else:
                try:
                    call, grads = make_call(case, table[case.branch][method], device, seed)
                    row["ms"] = round(time_ms(call, grads, device, warmup, rep), 4)
                    row["status"] = "ok"
                except Exception as exc:  # an OOM or a failing backend is a result, not a crash
                    row["status"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            log(
                f"{case.branch:10s} {case.mode:7s} D={case.head_dim:<4d} T={case.length:<6d} "
                f"{method:9s} {row['ms'] or '-':>10} ms  {row['status']}"
            )
            case_rows.append(row)
        fa2_ms = next((r["ms"] for r in case_rows if r["method"] == "fa2" and r["ms"] != ""), None)
        for row in case_rows:
            if fa2_ms and row["ms"] != "":
                row["fa2_speedup"] = round(float(row["ms"]) / float(fa2_ms), 3)
        rows.extend(case_rows)
    return rows


def _smallest_from_which(ok_by_length: dict[int, bool]) -> int | None:
    """Smallest T such that ``ok`` holds at T and at every larger measured T."""
    answer = None
    for length in sorted(ok_by_length, reverse=True):
        if not ok_by_length[length]:
            break
        answer = length
    return answer


def _best_fallback_ms(rows: list[dict[str, Any]]) -> float | None:
    times = [float(r["ms"]) for r in rows if r["method"] in FALLBACKS and r["ms"] != ""]
    return min(times) if times else None


def recommend(rows: list[dict[str, Any]], min_speedup: float) -> dict[str, dict[str, Any]]:
    """Per (branch, mode): the FA-2 cutoff and the T from which flex beats sdpa.

    ``fa2_min_len``: smallest measured T from which FA-2 is >= ``min_speedup`` x faster than the
    best fallback at every larger T and every D (None: never). ``flex_min_len`` likewise for
    flex being faster than sdpa.
    """
    groups: dict[tuple[str, str], dict[tuple[int, int], list[dict[str, Any]]]] = {}
    for row in rows:
        key = (row["branch"], row["mode"])
        groups.setdefault(key, {}).setdefault((int(row["T"]), int(row["dk"])), []).append(row)
    out: dict[str, dict[str, Any]] = {}
    for (branch, mode), by_case in groups.items():
        fa2_ok: dict[int, bool] = {}
        flex_ok: dict[int, bool] = {}
        ratios: dict[int, list[float]] = {}
        for (length, _), case_rows in by_case.items():
            ms = {r["method"]: float(r["ms"]) for r in case_rows if r["ms"] != ""}
            best = _best_fallback_ms(case_rows)
            fa2_here = "fa2" in ms and best is not None and best / ms["fa2"] >= min_speedup
            fa2_ok[length] = fa2_ok.get(length, True) and fa2_here
            if "fa2" in ms and best is not None:
                ratios.setdefault(length, []).append(best / ms["fa2"])
            if "flex" in ms and "sdpa" in ms:
                flex_ok[length] = flex_ok.get(length, True) and ms["flex"] < ms["sdpa"]
        out[f"{branch}/{mode}"] = {
            "fa2_min_len": _smallest_from_which(fa2_ok),
            "flex_min_len": _smallest_from_which(flex_ok) if flex_ok else None,
            "median_fa2_vs_best_fallback": {
                t: round(statistics.median(r), 2) for t, r in sorted(ratios.items())
            },
        }
    return out


def write_csv(path: Path, rows: list[dict[str, Any]], env: dict[str, Any]) -> None:
    env_columns = {f"env_{key}": value for key, value in env.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*CSV_COLUMNS, *env_columns])
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, **env_columns})


def summary_table(rows: list[dict[str, Any]], methods: Sequence[str]) -> str:
    """One line per (branch, mode, D, T): each method's ms and FA-2 over the best fallback."""
    by_case: dict[tuple[str, str, int, int], dict[str, str]] = {}
    for row in rows:
        key = (row["branch"], row["mode"], int(row["dk"]), int(row["T"]))
        by_case.setdefault(key, {})[row["method"]] = str(row["ms"]) if row["ms"] != "" else "-"
    header = (
        f"{'branch':10s} {'mode':7s} {'D':>4s} {'T':>6s} "
        + " ".join(f"{m + ' ms':>12s}" for m in methods)
        + f" {'fa2 vs best':>12s}"
    )
    lines = [header]
    for (branch, mode, d, t), ms in sorted(by_case.items()):
        fallback = [float(ms[m]) for m in FALLBACKS if ms.get(m, "-") != "-"]
        ratio = "-"
        if ms.get("fa2", "-") != "-" and fallback:
            ratio = f"{min(fallback) / float(ms['fa2']):.2f}x"
        cells = " ".join(f"{ms.get(m, '-'):>12s}" for m in methods)
        lines.append(f"{branch:10s} {mode:7s} {d:>4d} {t:>6d} {cells} {ratio:>12s}")
    return "\n".join(lines)


def check_arguments(args: argparse.Namespace) -> None:
    """Heads that group and, where the compressed branch is timed, a stride dividing the block
    (otherwise every row would only report the same refusal)."""
    require_multiple(args.heads, "--heads", args.kv_heads, "--kv-heads")
    if "compressed" in args.branches:
        require_multiple(args.cmp_block, "--cmp-block", args.cmp_stride, "--cmp-stride")


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    branches, methods, modes = args.branches, args.methods, args.modes
    cases = [
        Case(
            branch,
            mode,
            DTYPES[args.dtype],
            args.batch,
            length,
            args.heads,
            args.kv_heads,
            d,
            args.window,
            args.cmp_block,
            args.cmp_stride,
        )
        for branch in branches
        for mode in modes
        for d in args.head_dims
        for length in args.seqlens
    ]
    rows = measure(
        cases,
        methods,
        device,
        warmup=args.warmup_ms,
        rep=args.rep_ms,
        seed=args.seed,
        log=lambda line: print(line, file=sys.stderr, flush=True),
    )
    write_csv(Path(args.csv), rows, dict(collect()))
    print(summary_table(rows, methods))
    print()
    toggle = {"sliding": "NSA_WIN_FA2_MIN_LEN", "compressed": "NSA_CMP_FA2_MIN_LEN"}
    shortest = min((int(r["T"]) for r in rows), default=None)
    for key, rec in recommend(rows, args.min_speedup).items():
        branch, _mode = key.split("/")
        cutoff = rec["fa2_min_len"]
        if not rec["median_fa2_vs_best_fallback"]:
            advice = "no FA-2/fallback pair was timed (see the status column): no cutoff"
        elif cutoff is None:
            advice = f"FA-2 is not >= {args.min_speedup}x up to the largest T: keep it off here"
        elif cutoff == shortest:
            # The sweep's shortest T already favours FA-2: the cutoff lies at or below it.
            advice = (
                f"{toggle[branch]}<={cutoff} (FA-2 is ahead from the shortest T timed; "
                "time shorter T to place it)"
            )
        else:
            advice = f"{toggle[branch]}={cutoff}"
        print(
            f"{key:22s} {advice}; flex beats sdpa from T={rec['flex_min_len']}; "
            f"FA-2 vs best fallback (median over D) {rec['median_fa2_vs_best_fallback']}"
        )
    print(f"\nwrote {args.csv}")
    return 0
