"""``nsa-bench needle``'s command line: its flags (one per setting), and the run that trains or
loads each variant, evaluates it and writes the report after every model."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from nsa_bench.cli_args import parse_floats, parse_ints
from nsa_bench.needle.evaluate import Cell, evaluate, selection_statistics
from nsa_bench.needle.model import VARIANTS, NeedleModel
from nsa_bench.needle.report import device_names, merge_runs, report, write_outputs
from nsa_bench.needle.settings import NeedleSettings, use_autocast
from nsa_bench.needle.train import TrainBudget, load_checkpoint, save_checkpoint, train
from nsa_bench.sel_stats import SelStats
from nsa_core.registry import OpContext, routing_report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="output folder (checkpoints, tables, PNGs)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="models to train/evaluate")
    parser.add_argument("--budget-s", type=float, default=90.0, help="training seconds per model")
    parser.add_argument("--steps", type=int, default=100_000, help="training step cap per model")
    parser.add_argument("--eval-only", action="store_true", help="load --ckpt, skip training")
    parser.add_argument("--ckpt", default=None, help="folder of <variant>.pt (with --eval-only)")
    parser.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="DIR",
        help="write --out's tables from the needle.json of runs that trained the variants apart "
        "(one per GPU, say); trains nothing",
    )
    parser.add_argument("--lengths", default="2048,4096,8192,16384", help="evaluation lengths")
    parser.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9", help="needle depths in [0, 1]")
    parser.add_argument("--samples", type=int, default=32, help="sequences per (length, depth)")
    parser.add_argument("--eval-batch", type=int, default=16, help="sequences per eval forward")
    parser.add_argument(
        "--stats-lens",
        default="16384,65536",
        help="lengths of the held-out sequences for the selection statistics ('': none)",
    )
    parser.add_argument("--stats-batch", type=int, default=1, help="sequences for the statistics")
    parser.add_argument("--log-every-s", type=float, default=5.0, help="progress line period")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    defaults = NeedleSettings()
    for f in dataclasses.fields(NeedleSettings):
        value = getattr(defaults, f.name)
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            type=type(value),
            default=value,
            help=f"model/task/training setting (default {value})",
        )


def settings_from_args(args: argparse.Namespace) -> NeedleSettings:
    """The settings the command line gives (one option per field of :class:`NeedleSettings`)."""
    return NeedleSettings(
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(NeedleSettings)}
    )


def run(args: argparse.Namespace) -> int:
    if args.merge:
        return merge_runs([Path(d) for d in args.merge], Path(args.out))
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {VARIANTS}")
    if args.eval_only and not args.ckpt:
        raise SystemExit("--eval-only needs --ckpt DIR")
    lengths, depths = parse_ints(args.lengths), parse_floats(args.depths)
    cells: list[Cell] = []
    trained: dict[str, dict[str, Any]] = {}
    settings = settings_from_args(args)
    routes = routing(settings, device)
    print(f"# routing at T={settings.train_len}, training:\n{routes}", file=sys.stderr, flush=True)
    stats: list[SelStats] = []
    notes: list[str] = []
    for variant in variants:
        # One variant failing (a kernel error, memory) leaves the others' results standing.
        try:
            settings, info, found, found_stats = _one_variant(
                args, variant, settings, device, out, lengths, depths
            )
            trained[variant] = info
            cells += found
            stats += found_stats
        except Exception as exc:
            traceback.print_exc()
            trained[variant] = {"error": f"{type(exc).__name__}: {exc}"}
        if device.type == "cuda":
            torch.cuda.empty_cache()
        # Written after every model: a run cut short keeps what it finished.
        notes = write_outputs(
            out, cells, stats, trained, variants, settings, device_names(device), routes
        )
    return report(notes, cells, stats, trained, variants)


def _train_or_load(
    args: argparse.Namespace,
    variant: str,
    settings: NeedleSettings,
    device: torch.device,
    out: Path,
) -> tuple[NeedleModel, NeedleSettings, dict[str, Any]]:
    """The variant's model from --ckpt, or trained and saved; either way its bf16 weights, so
    an --eval-only run reproduces the numbers of the run that trained it."""
    if args.eval_only:
        return load_checkpoint(Path(args.ckpt) / f"{variant}.pt", variant, device)
    model = settings.build(variant, device)
    budget = TrainBudget(args.budget_s, args.steps, args.log_every_s)
    result = train(model, variant, settings, device, budget)
    save_checkpoint(out / f"{variant}.pt", model, settings, dataclasses.asdict(result))
    del model
    return load_checkpoint(out / f"{variant}.pt", variant, device)


def _one_variant(
    args: argparse.Namespace,
    variant: str,
    settings: NeedleSettings,
    device: torch.device,
    out: Path,
    lengths: list[int],
    depths: list[float],
) -> tuple[NeedleSettings, dict[str, Any], list[Cell], list[SelStats]]:
    """Train (or load) one model, evaluate it, and for ``nsa`` take its selection statistics."""
    model, settings, info = _train_or_load(args, variant, settings, device, out)
    cells = evaluate(
        model, variant, settings, device, lengths, depths, args.samples, args.eval_batch
    )
    stats: list[SelStats] = []
    if variant == "nsa":
        stats = _statistics(model, settings, device, parse_ints(args.stats_lens), args, out)
    return settings, info, cells, stats


def _statistics(
    model: NeedleModel,
    settings: NeedleSettings,
    device: torch.device,
    lengths: list[int],
    args: argparse.Namespace,
    out: Path,
) -> list[SelStats]:
    """Selection statistics at each length; a length that runs out of memory is skipped."""
    stats: list[SelStats] = []
    for length in lengths:
        try:
            stats += selection_statistics(model, settings, device, length, args.stats_batch, out)
        except torch.cuda.OutOfMemoryError as exc:
            print(f"# selection statistics at T={length}: {exc}", file=sys.stderr)
            torch.cuda.empty_cache()
    for s in stats:
        print(
            f"# sel stats {s.source} layer {s.layer} T={s.T}: share t,t+1 {s.share_next:.3f}, "
            f"saved /16 {s.saved_16:.3f}, /64 {s.saved_64:.3f}",
            file=sys.stderr,
            flush=True,
        )
    return stats


def routing(settings: NeedleSettings, device: torch.device) -> str:
    """The backend each op gets for a training call of these shapes, and why (registry)."""
    ctx = OpContext.for_config(
        settings.nsa_config(),
        device=device,
        dtype=torch.bfloat16 if use_autocast(device) else torch.float32,
        seq_len=settings.train_len,
        requires_grad=True,
    )
    return routing_report(ctx)
