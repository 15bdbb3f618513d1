"""``nsa-bench needle``'s command line: its flags (one per setting), and the run that trains or
loads each variant, evaluates it and writes the report after every model."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nsa_bench.cli_args import (
    BLOCK_FLAGS,
    UsageError,
    block_geometry,
    comma_list,
    device_name,
    existing_dir,
    fraction,
    names,
    non_negative_float,
    non_negative_int,
    nsa_config,
    positive_float,
    positive_int,
    seed,
    seqlen,
    seqlens,
)
from nsa_bench.needle.evaluate import Cell, evaluate, selection_statistics
from nsa_bench.needle.model import VARIANTS, NeedleModel
from nsa_bench.needle.report import device_names, merge_runs, report, write_outputs
from nsa_bench.needle.settings import NeedleSettings, use_autocast
from nsa_bench.needle.task import needle_span
from nsa_bench.needle.train import TrainBudget, load_checkpoint, save_checkpoint, train
from nsa_bench.sel_stats import SelStats
from nsa_core.registry import OpContext, routing_report

# NeedleSettings fields that may be 0 besides the seed (every other number is a size, a count or
# a rate: > 0).
ZERO_OK = ("warmup_steps",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="output folder (checkpoints, tables, PNGs)")
    parser.add_argument(
        "--variants",
        type=names(VARIANTS),
        default=",".join(VARIANTS),
        help="models to train/evaluate",
    )
    parser.add_argument(
        "--budget-s", type=positive_float, default=90.0, help="training seconds per model"
    )
    parser.add_argument(
        "--steps", type=positive_int, default=100_000, help="training step cap per model"
    )
    parser.add_argument("--eval-only", action="store_true", help="load --ckpt, skip training")
    parser.add_argument(
        "--ckpt", type=existing_dir, default=None, help="folder of <variant>.pt (with --eval-only)"
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        type=existing_dir,
        default=None,
        metavar="DIR",
        help="write --out's tables from the needle.json of runs that trained the variants apart "
        "(one per GPU, say); trains nothing",
    )
    parser.add_argument(
        "--lengths", type=seqlens, default="2048,4096,8192,16384", help="evaluation lengths"
    )
    parser.add_argument(
        "--depths",
        type=comma_list(fraction),
        default="0.1,0.3,0.5,0.7,0.9",
        help="needle depths in [0, 1]",
    )
    parser.add_argument(
        "--samples", type=positive_int, default=32, help="sequences per (length, depth)"
    )
    parser.add_argument(
        "--eval-batch", type=positive_int, default=16, help="sequences per eval forward"
    )
    parser.add_argument(
        "--stats-lens",
        type=comma_list(seqlen, empty_ok=True),
        default="16384,65536",
        help="lengths of the held-out sequences for the selection statistics ('': none)",
    )
    parser.add_argument(
        "--stats-batch", type=positive_int, default=1, help="sequences for the statistics"
    )
    parser.add_argument(
        "--log-every-s", type=non_negative_float, default=5.0, help="progress line period"
    )
    parser.add_argument(
        "--device",
        type=device_name,
        default=None,
        help="default: cuda when available, else cpu",
    )
    defaults = NeedleSettings()
    for f in dataclasses.fields(NeedleSettings):
        value = getattr(defaults, f.name)
        if f.name == "seed":
            kind: Callable[[str], Any] = seed
        elif isinstance(value, float):
            kind = positive_float
        else:
            kind = non_negative_int if f.name in ZERO_OK else positive_int
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            type=kind,
            default=value,
            help=f"model/task/training setting (default {value})",
        )


def check_arguments(args: argparse.Namespace) -> None:
    """--eval-only has its checkpoints; a model to train has settings that make an NSA config
    and lengths that hold a needle beyond its windows."""
    if args.merge:
        return  # trains nothing: the settings come from the merged runs
    if args.eval_only:
        if not args.ckpt:
            raise UsageError("--eval-only needs --ckpt DIR")
        return  # the settings come from the checkpoints
    heads = {"num_q_heads": "--heads", "num_kv_heads": "--kv-heads"}
    dims = {"head_dim_qk": "--head-dim", "head_dim_v": "--head-dim"}
    nsa_config(
        heads | dims | BLOCK_FLAGS,
        num_q_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim_qk=args.head_dim,
        head_dim_v=args.head_dim,
        **block_geometry(args),
    )
    settings = settings_from_args(args)
    for flag, values in (("--train-len", [args.train_len]), ("--lengths", args.lengths)):
        for seq_len in values:
            try:
                needle_span(settings.task(), seq_len, settings.reach, settings.sel_block)
            except ValueError as exc:
                raise UsageError(f"{flag}: {exc}") from None


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
    variants = args.variants
    lengths, depths = args.lengths, args.depths
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
        stats = _statistics(model, settings, device, args.stats_lens, args, out)
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
