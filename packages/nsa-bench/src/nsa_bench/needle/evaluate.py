"""Evaluating a trained needle model: accuracy per (length, depth) on sequences every model
shares, and the statistics of the blocks the ``nsa`` model selects."""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from nsa_bench.needle.model import NeedleModel, random_selection
from nsa_bench.needle.settings import NeedleSettings, autocast
from nsa_bench.needle.task import answer_hits
from nsa_bench.sel_stats import SelStats, save_indices, selection_stats


@dataclass
class Cell:
    """Accuracy of one model at one (length, depth)."""

    variant: str
    length: int
    depth: float
    samples: int
    exact: float
    token: float
    status: str = "ok"


def _cell_seed(seed: int, length: int, depth_index: int) -> int:
    """The eval sequences of a cell depend on the seed, length and depth only: every model sees
    the same ones, and they never repeat the training stream (seed + 1)."""
    return seed * 1_000_003 + length * 101 + depth_index + 7


@torch.no_grad()
def evaluate(
    model: NeedleModel,
    variant: str,
    settings: NeedleSettings,
    device: torch.device,
    lengths: list[int],
    depths: list[float],
    samples: int,
    eval_batch: int,
) -> list[Cell]:
    """Exact-match and per-token accuracy per (length, depth) over ``samples`` sequences."""
    model.eval()
    cells: list[Cell] = []
    began = time.perf_counter()
    for length in lengths:
        for d_index, depth in enumerate(depths):
            seed = _cell_seed(settings.seed, length, d_index)
            gen = torch.Generator().manual_seed(seed)
            for attn in model.attentions():
                attn.generator = torch.Generator(device=device).manual_seed(seed)
            exact_sum, token_sum, done = 0.0, 0.0, 0
            try:
                while done < samples:
                    size = min(eval_batch, samples - done)
                    nb = settings.sequences(size, length, gen, depth=depth)
                    tokens = nb.tokens.to(device)
                    with autocast(device):
                        logits = model(tokens, nb.targets.shape[1]).float()
                    exact, token = answer_hits(logits.cpu(), nb.targets)
                    exact_sum += float(exact.float().sum())
                    token_sum += float(token.sum())
                    done += size
                status = "ok"
            except torch.cuda.OutOfMemoryError as exc:
                status = f"out of memory: {str(exc).splitlines()[0]}"
                torch.cuda.empty_cache()
            cell = Cell(
                variant,
                length,
                depth,
                done,
                exact_sum / done if done else math.nan,
                token_sum / done if done else math.nan,
                status if done == samples else f"{done}/{samples} samples: {status}",
            )
            cells.append(cell)
            print(
                f"# eval {variant} T={length} depth={depth:.2f} exact {cell.exact:.3f} "
                f"token {cell.token:.3f} {cell.status}",
                file=sys.stderr,
                flush=True,
            )
    model.train()
    print(f"# eval {variant} took {time.perf_counter() - began:.1f}s", file=sys.stderr, flush=True)
    return cells


@torch.no_grad()
def selection_statistics(
    model: NeedleModel,
    settings: NeedleSettings,
    device: torch.device,
    length: int,
    batch: int,
    out: Path,
) -> list[SelStats]:
    """Per-layer statistics of the indices the model selects on held-out needle sequences of
    ``length`` tokens (depth 0.5), a random-selection baseline of the same shape, and each
    layer's indices saved to ``sel_indices_T<length>_layer<i>.pt``."""
    gen = torch.Generator().manual_seed(settings.seed + 4)
    nb = settings.sequences(batch, length, gen, depth=0.5)
    attns = model.attentions()
    for attn in attns:
        attn.recorded = []
    model.eval()
    try:
        with autocast(device):
            model(nb.tokens.to(device), 1)
    finally:
        model.train()
        recorded = [attn.recorded or [] for attn in attns]
        for attn in attns:
            attn.recorded = None
    stats: list[SelStats] = []
    for layer, found in enumerate(recorded):
        indices = found[0]
        stats.append(selection_stats(indices, settings.sel_block, source="nsa", layer=layer))
        save_indices(
            out / f"sel_indices_T{length}_layer{layer}.pt",
            indices,
            {
                "sel_block": settings.sel_block,
                "num_selected": settings.num_selected,
                "layer": layer,
                "source": "nsa-bench needle: trained nsa model, passkey sequence, depth 0.5",
                "settings": dataclasses.asdict(settings),
            },
        )
    generator = torch.Generator(device=device).manual_seed(settings.seed + 5)
    baseline = random_selection(settings.nsa_config(), batch, length, generator, device)
    stats.append(selection_stats(baseline, settings.sel_block, source="random", layer=-1))
    return stats
