"""``nsa-bench layer``'s command line: its flags, the sweep over head dims, lengths, modes and
methods (outputs rewritten after every case), and ``--merge``."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

from nsa_bench.cases import free_memory
from nsa_bench.cli_args import (
    BLOCK_FLAGS,
    add_device_arg,
    add_do_bench_args,
    add_dtype_arg,
    add_layer_blocks_args,
    add_layer_heads_args,
    add_seed_arg,
    block_geometry,
    existing_file,
    names,
    non_negative_int,
    nsa_config,
    pairs,
    positive_int,
    seqlens,
)
from nsa_bench.env import collect_columns
from nsa_bench.layer.inputs import make_inputs
from nsa_bench.layer.nsa import bench_nsa_core, bench_nsa_module
from nsa_bench.layer.peers import (
    Peer,
    bench_fa2,
    bench_fla,
    bench_sdpa,
    load_fa2,
    load_fla,
    sdpa_has_gqa,
)
from nsa_bench.layer.plot import write_plot
from nsa_bench.layer.rows import (
    COMPILED_METHODS,
    DEFAULT_METHODS,
    METHODS,
    MODES,
    LayerShape,
    Row,
    add_ratios,
    read_rows,
    write_tables,
)
from nsa_bench.layer.steps import bench_steps, parse_step_backends
from nsa_bench.layer.tables import markdown
from nsa_bench.timing import make_timer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--seqlens",
        type=seqlens,
        default="8k,16k,32k,64k,128k",
        help="lengths T (8192 or 8k), comma-separated",
    )
    add_layer_heads_args(parser)
    parser.add_argument(
        "--head-dims", type=pairs, default="128/128,192/128", help="dk/dv pairs, comma-separated"
    )
    add_layer_blocks_args(parser)
    parser.add_argument(
        "--hidden-size", type=positive_int, default=2048, help="nsa_module's hidden size"
    )
    add_dtype_arg(parser)
    parser.add_argument("--modes", type=names(MODES), default="fwd,fwdbwd", help="fwd,fwdbwd")
    parser.add_argument(
        "--methods",
        type=names(METHODS),
        default=",".join(DEFAULT_METHODS),
        help=f"from {','.join(METHODS)} (the *_compiled ones run under torch.compile)",
    )
    parser.add_argument(
        "--no-steps", action="store_true", help="skip the per-step breakdown of the core"
    )
    parser.add_argument(
        "--step-modes",
        type=names(MODES),
        default="fwd",
        help="modes of the per-step breakdown: fwd, fwdbwd or fwd,fwdbwd",
    )
    parser.add_argument(
        "--step-backends",
        type=parse_step_backends,
        default="",
        help="extra step rows with a backend pinned, e.g. sliding=triton_win (STEP@BACKEND)",
    )
    parser.add_argument("--out", default="artifacts/bench/layer/", help="output folder")
    parser.add_argument(
        "--merge",
        nargs="+",
        type=existing_file,
        default=None,
        metavar="CSV",
        help="time nothing: rebuild every output from these layer.csv files",
    )
    add_device_arg(parser)
    add_do_bench_args(parser)
    parser.add_argument("--iters", type=positive_int, default=3, help="timed runs on CPU")
    parser.add_argument("--warmup", type=non_negative_int, default=1, help="warm-up runs on CPU")
    add_seed_arg(parser)


def check_arguments(args: argparse.Namespace) -> None:
    """Each dk/dv pair with the heads and the block geometry makes an NSA config (checked here,
    before the first case is timed)."""
    if args.merge:
        return  # times nothing: the shape flags are not used
    hq, h = args.heads
    flags = {"num_q_heads": "--heads HQ", "num_kv_heads": "--heads H", **BLOCK_FLAGS}
    for dk, dv in args.head_dims:
        flags |= {"head_dim_qk": f"--head-dims dk ({dk}/{dv})", "head_dim_v": "--head-dims dv"}
        nsa_config(
            flags,
            num_q_heads=hq,
            num_kv_heads=h,
            head_dim_qk=dk,
            head_dim_v=dv,
            **block_geometry(args),
        )


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
    hq, h = args.heads
    head_dims, modes, methods = args.head_dims, args.modes, args.methods
    step_modes, pins = args.step_modes, args.step_backends
    timer = make_timer(
        device,
        use_do_bench=device.type == "cuda",
        warmup_ms=args.warmup_ms,
        rep_ms=args.rep_ms,
        iters=args.iters,
        warmup=args.warmup,
    )
    fla = load_fla() if "fla" in methods else Peer(None, "not requested")
    fa2 = load_fa2() if "fa2" in methods else Peer(None, "not requested")
    has_gqa = sdpa_has_gqa()
    _log(f"[layer] fla: {fla.info}; fa2: {fa2.info}; sdpa enable_gqa: {has_gqa}; on {device}")
    env = collect_columns()
    rows: list[Row] = []
    for dk, dv in head_dims:
        for length in args.seqlens:
            shape = LayerShape(
                args.batch, length, hq, h, dk, dv, args.dtype, **block_geometry(args)
            )
            shape.config()  # a bad geometry stops the run here, before anything is timed
            free_memory(device)
            inp = make_inputs(shape, device, args.seed)
            here: list[Row] = []
            for mode in modes:
                for method in methods:
                    compiled = method in COMPILED_METHODS
                    if method in ("nsa_core", "nsa_core_compiled"):
                        row = bench_nsa_core(shape, inp, mode, timer, device, compiled=compiled)
                    elif method in ("nsa_module", "nsa_module_compiled"):
                        row = bench_nsa_module(
                            shape, mode, args.hidden_size, timer, device, args.seed,
                            compiled=compiled,
                        )  # fmt: skip
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
