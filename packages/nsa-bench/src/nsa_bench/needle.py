"""``nsa-bench needle``: a small NSA language model learns passkey retrieval beyond its window.

Task (passkey). A sequence of T tokens is random filler with one needle, ``KEY v1 .. vL``
written ``needle_repeats`` times in a row (the classic passkey prompt states its key twice), and
ends in ``QUERY v1 .. vL``: the model must repeat the L value tokens after QUERY. Value token k
is drawn from its own range of ``value_vocab`` ids (k = 1..L), so the answer is a lookup of the
one token of range k+1 in the sequence; filler never uses those ids. The loss covers the L answer
tokens only (the predictions at QUERY, v1, .., v(L-1)). Accuracy is the exact match of the L
greedy tokens under teacher forcing, which equals greedy decoding: a decode that went wrong at
token k fails the match either way. Chance is ``value_vocab ** -L`` (one token: 1/value_vocab).

Depth. The needle starts at ``p = lo + round(depth * (hi - lo))``: ``lo = l'`` keeps it out of
the forced initial selection block; ``hi`` puts its last token just beyond the reach of the
stacked sliding windows of the QUERY row, ``layers * (w - 1)`` tokens (a window-only model
relays one window per layer), so no scored row can see it through the windows or its two forced
local blocks (``2 l' <= w``). Training draws p uniformly in [lo, hi].

Models (``--variants``), trained one after the other under the same step cap and time budget:

- ``nsa``: :class:`nsa_core.NSAAttention` as it is, every op through the backend registry (the
  Triton kernels on a GPU);
- ``window``: the sliding branch alone, ``o = g_win * o_win`` (the compressed and selected
  branches are not computed);
- ``random``: NSA with the top-n replaced by random blocks: the forced blocks plus random
  distinct valid ones, drawn afresh per call (:func:`nsa_bench.sel_bench.nsa_block_indices`).

Each model: token embedding, ``--layers`` pre-norm blocks (attention, then a GELU MLP), final
norm and LM head; bf16 autocast over float32 weights on CUDA, float32 on CPU.

After training: accuracy per (length, depth) cell over ``--samples`` sequences, for every model
on the same sequences; the selection statistics of the ``nsa`` model on a held-out sequence of
each of ``--stats-lens`` tokens (:mod:`nsa_bench.sel_stats`), with its per-layer indices saved for
``nsa-bench sel --indices``. ``--eval-only --ckpt DIR`` reloads the checkpoints instead of
training.

Outputs under ``--out``: ``<variant>.pt`` (bf16 state dict and the run's settings),
``needle.csv`` and ``needle.json`` (one row per model, length and depth),
``needle_<variant>.png`` (depth x length heat map; needs matplotlib), ``sel_stats.csv``,
``sel_indices_T<T>_layer<i>.pt``, and ``needle.md``, the Markdown tables also printed last.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nsa_bench.cli_args import blocks_config, parse_floats, parse_ints
from nsa_bench.sel_bench import nsa_block_indices
from nsa_bench.sel_stats import SelStats, format_stats_table, save_indices, selection_stats
from nsa_core import NSAAttention, NSAConfig, ops
from nsa_core.registry import OpContext, routing_report

VARIANTS = ("nsa", "window", "random")
IGNORE = -100  # cross_entropy's ignore_index: positions that carry no loss


# ---------------------------------------------------------------------------------------------
# Task


@dataclass(frozen=True)
class NeedleTask:
    """Token layout of the passkey task.

    Ids: filler [0, filler_vocab), then KEY, QUERY, then ``value_len`` ranges of ``value_vocab``
    ids, one per answer position. The needle is ``KEY v1 .. vL`` written ``needle_repeats``
    times in a row.
    """

    filler_vocab: int = 16
    value_len: int = 4
    value_vocab: int = 16
    needle_repeats: int = 1

    @property
    def needle_len(self) -> int:
        """Tokens of the whole needle, its repeats included."""
        return self.needle_repeats * (self.value_len + 1)

    @property
    def key_id(self) -> int:
        return self.filler_vocab

    @property
    def query_id(self) -> int:
        return self.filler_vocab + 1

    def value_base(self, k: int) -> int:
        """First id of answer position k's range (k = 0..value_len-1)."""
        return self.filler_vocab + 2 + k * self.value_vocab

    @property
    def vocab_size(self) -> int:
        return self.value_base(self.value_len)


@dataclass
class NeedleBatch:
    """tokens [B, T] int64; targets [B, L+1] int64 for the last L+1 positions (IGNORE on the last
    one: its prediction runs past the sequence); starts [B] (the first KEY); answers [B, L]."""

    tokens: torch.Tensor
    targets: torch.Tensor
    starts: torch.Tensor
    answers: torch.Tensor


def needle_span(task: NeedleTask, seq_len: int, reach: int, sel_block: int) -> tuple[int, int]:
    """(lo, hi): the KEY positions allowed, inclusive.

    The first scored row is QUERY at ``q0 = T - L - 1``; through the windows it can see tokens
    [q0 - reach + 1, q0] (``reach = layers * (w - 1) + 1``), the later scored rows less far back.
    The needle [p, p + N) (N = ``needle_len``) must end before that: ``p + N - 1 <= q0 - reach``.
    ``lo = l'`` skips block 0.
    """
    q0 = seq_len - task.value_len - 1
    lo, hi = sel_block, q0 - reach - task.needle_len + 1
    if hi < lo:
        raise ValueError(
            f"T={seq_len} is too short for a needle beyond the windows' reach of {reach} tokens "
            f"and past block 0 (l'={sel_block})"
        )
    return lo, hi


def needle_batch(
    task: NeedleTask,
    batch: int,
    seq_len: int,
    reach: int,
    sel_block: int,
    generator: torch.Generator,
    *,
    depth: float | None = None,
) -> NeedleBatch:
    """A batch on the CPU; ``depth`` in [0, 1] fixes where the needle sits, None draws it.

    ``reach``: how far back the windows let the QUERY row see (:func:`needle_span`).
    """
    lo, hi = needle_span(task, seq_len, reach, sel_block)
    tokens = torch.randint(0, task.filler_vocab, (batch, seq_len), generator=generator)
    bases = torch.tensor([task.value_base(k) for k in range(task.value_len)])
    answers = bases + torch.randint(
        0, task.value_vocab, (batch, task.value_len), generator=generator
    )
    if depth is None:
        starts = torch.randint(lo, hi + 1, (batch,), generator=generator)
    else:
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth must be in [0, 1], got {depth}")
        starts = torch.full((batch,), lo + round(depth * (hi - lo)), dtype=torch.int64)
    rows = torch.arange(batch)
    offsets = torch.arange(1, task.value_len + 1)
    for copy in range(task.needle_repeats):
        first = starts + copy * (task.value_len + 1)
        tokens[rows, first] = task.key_id
        tokens[rows.unsqueeze(1), first.unsqueeze(1) + offsets] = answers
    q0 = seq_len - task.value_len - 1
    tokens[:, q0] = task.query_id
    tokens[:, q0 + 1 :] = answers
    targets = torch.full((batch, task.value_len + 1), IGNORE, dtype=torch.int64)
    targets[:, : task.value_len] = answers
    return NeedleBatch(tokens=tokens, targets=targets, starts=starts, answers=answers)


def answer_hits(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, P, V], targets [B, P] (IGNORE where unscored) -> (exact [B] bool, token [B]).

    ``exact``: every scored greedy token is right; ``token``: the share of scored tokens right.
    """
    scored = targets != IGNORE
    right = (logits.argmax(-1) == targets) & scored
    exact = (right | ~scored).all(dim=-1)
    token = right.sum(-1).float() / scored.sum(-1).clamp_min(1).float()
    return exact, token


# ---------------------------------------------------------------------------------------------
# Model


class NeedleAttention(NSAAttention):
    """NSAAttention with the variant's branches; the same parameters, so checkpoints load alike.

    ``recorded``: when a list, the ``nsa`` variant appends each forward's block indices
    [B, T, H, n] (int32) to it.
    """

    def __init__(self, config: NSAConfig, hidden_size: int, variant: str) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        super().__init__(config, hidden_size)
        self.variant = variant
        self.recorded: list[torch.Tensor] | None = None
        self.generator: torch.Generator | None = None  # for the random variant's blocks

    def random_block_indices(self, batch: int, t: int, device: torch.device) -> torch.Tensor:
        """int32 [B, T, H, n]: the forced blocks plus random distinct valid ones, ascending,
        -1 padded (the index contract of ``select_blocks``), drawn from ``self.generator``."""
        cfg = self.config
        return nsa_block_indices(
            batch,
            t,
            cfg.num_kv_heads,
            cfg.num_selected,
            cfg.sel_block,
            generator=self.generator,
            device=device,
        )

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden], causal (no packed sequences here)."""
        if cu_seqlens is not None:
            raise ValueError("the needle model takes no packed sequences")
        if self.variant == "nsa" and self.recorded is None:
            return super().forward(x)
        cfg = self.config
        scale = cfg.softmax_scale
        self._check_x(x)
        inp = self.branch_inputs(x, torch.arange(x.shape[1], device=x.device))
        if self.variant == "window":
            o_win = ops.sliding_attention(inp.q, inp.k["win"], inp.v["win"], cfg.window, scale)
            o = o_win * inp.gates[..., 2:3]
        else:
            k_cmp, v_cmp = self.compress_kv(inp.k["cmp"], inp.v["cmp"])
            if self.variant == "nsa":
                o_cmp, o_slc, o_win, indices = self.branch_outputs(
                    inp.q, k_cmp, v_cmp, inp.k["slc"], inp.v["slc"], inp.k["win"], inp.v["win"]
                )
                if self.recorded is not None:
                    self.recorded.append(indices.detach())
            else:
                o_cmp = ops.compressed_attention(
                    inp.q, k_cmp, v_cmp, cfg.cmp_block, cfg.cmp_stride, scale
                )
                indices = self.random_block_indices(x.shape[0], x.shape[1], x.device)
                o_slc = ops.selected_attention(
                    inp.q, inp.k["slc"], inp.v["slc"], indices, cfg.sel_block, scale
                )
                o_win = ops.sliding_attention(inp.q, inp.k["win"], inp.v["win"], cfg.window, scale)
            o = ops.gated_combine(o_cmp, o_slc, o_win, inp.gates)
        y: torch.Tensor = self.o_proj(o.flatten(2))
        return y


class Block(nn.Module):
    """Pre-norm residual block: x + attn(LN(x)), then x + MLP(LN(x)) (4x, GELU)."""

    def __init__(self, config: NSAConfig, hidden: int, variant: str) -> None:
        super().__init__()
        self.norm_attn = nn.LayerNorm(hidden)
        self.attn = NeedleAttention(config, hidden, variant)
        self.norm_mlp = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(
            nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_attn(x))
        out: torch.Tensor = x + self.mlp(self.norm_mlp(x))
        return out


class NeedleModel(nn.Module):
    """tokens [B, T] -> logits [B, last, V] of the last ``last`` positions (the answer rows)."""

    def __init__(
        self, config: NSAConfig, vocab: int, hidden: int, layers: int, variant: str
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList([Block(config, hidden, variant) for _ in range(layers)])
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)

    def attentions(self) -> list[NeedleAttention]:
        return [block.attn for block in self.blocks if isinstance(block, Block)]

    def forward(self, tokens: torch.Tensor, last: int) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        # Only the answer rows carry loss: the head runs on them alone.
        logits: torch.Tensor = self.head(self.norm(x[:, -last:]))
        return logits


# ---------------------------------------------------------------------------------------------
# Settings


@dataclass(frozen=True)
class NeedleSettings:
    """Everything a run depends on; stored in each checkpoint."""

    layers: int = 2
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    cmp_block: int = 32
    cmp_stride: int = 16
    sel_block: int = 64
    num_selected: int = 16
    window: int = 256
    filler_vocab: int = 16
    value_len: int = 4
    value_vocab: int = 16
    needle_repeats: int = 4
    train_len: int = 2048
    batch: int = 16
    lr: float = 2e-3
    warmup_steps: int = 100
    seed: int = 0

    def nsa_config(self) -> NSAConfig:
        return blocks_config(self, (self.heads, self.kv_heads), (self.head_dim, self.head_dim))

    def task(self) -> NeedleTask:
        return NeedleTask(self.filler_vocab, self.value_len, self.value_vocab, self.needle_repeats)

    @property
    def reach(self) -> int:
        """Tokens a row sees through the sliding windows of all layers, itself included."""
        return self.layers * (self.window - 1) + 1

    def build(self, variant: str, device: torch.device) -> NeedleModel:
        """The model of ``variant`` with weights from ``seed`` (the same for every variant)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = NeedleModel(
                self.nsa_config(), self.task().vocab_size, self.hidden, self.layers, variant
            )
        return model.to(device)


def _use_autocast(device: torch.device) -> bool:
    """bf16 autocast over float32 weights on CUDA (the Triton routes); float32 elsewhere."""
    return device.type == "cuda"


def _autocast(device: torch.device) -> torch.autocast:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=_use_autocast(device))


# ---------------------------------------------------------------------------------------------
# Training


@dataclass
class TrainResult:
    """What one model's training did: steps, seconds (kernel compile excluded), the mean loss of
    its last logging period and the tokens per second it processed."""

    variant: str
    steps: int
    seconds: float
    final_loss: float
    tokens_per_s: float


def _step_loss(model: NeedleModel, batch: NeedleBatch, device: torch.device) -> torch.Tensor:
    """Scalar cross-entropy over the answer tokens of tokens [B, T] (targets [B, L+1])."""
    tokens = batch.tokens.to(device, non_blocking=True)
    targets = batch.targets.to(device, non_blocking=True)
    with _autocast(device):
        logits = model(tokens, targets.shape[1])
    return nn.functional.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE
    )


def train(
    model: NeedleModel,
    variant: str,
    settings: NeedleSettings,
    device: torch.device,
    *,
    budget_s: float,
    max_steps: int,
    log_every_s: float,
) -> TrainResult:
    """AdamW with linear warm-up, then cosine decay to 10% over the time budget (or the step cap,
    whichever ends first). One unscored forward and backward first compiles the kernels so that
    the budget counts training only."""
    task = settings.task()
    gen = torch.Generator().manual_seed(settings.seed + 1)  # same batches for every variant
    for attn in model.attentions():
        attn.generator = torch.Generator(device=device).manual_seed(settings.seed + 2)
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.01)

    def batch() -> NeedleBatch:
        return needle_batch(
            task, settings.batch, settings.train_len, settings.reach, settings.sel_block, gen
        )

    warm = needle_batch(
        task,
        settings.batch,
        settings.train_len,
        settings.reach,
        settings.sel_block,
        torch.Generator().manual_seed(settings.seed + 3),
    )
    warm_start = time.perf_counter()
    torch.autograd.backward(_step_loss(model, warm, device))
    opt.zero_grad(set_to_none=True)
    _sync(device)
    start = time.perf_counter()
    print(
        f"# train {variant} warm-up step (kernel compile) {start - warm_start:.1f}s",
        file=sys.stderr,
        flush=True,
    )
    last_log = start
    step, loss_value, recent = 0, math.nan, []
    while step < max_steps:
        elapsed = time.perf_counter() - start
        if elapsed >= budget_s:
            break
        progress = max(elapsed / budget_s, step / max_steps)
        lr = settings.lr * min(1.0, (step + 1) / settings.warmup_steps)
        lr *= 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        for group in opt.param_groups:
            group["lr"] = lr
        loss = _step_loss(model, batch(), device)
        opt.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        recent.append(loss.detach())
        now = time.perf_counter()
        if now - last_log >= log_every_s or step == max_steps:
            loss_value = float(torch.stack(recent).mean())
            recent.clear()
            tok_s = step * settings.batch * settings.train_len / (now - start)
            print(
                f"# train {variant} step {step} loss {loss_value:.4f} lr {lr:.2e} "
                f"tok/s {tok_s:.0f} elapsed {now - start:.1f}s",
                file=sys.stderr,
                flush=True,
            )
            last_log = now
    _sync(device)
    seconds = time.perf_counter() - start
    if recent:
        loss_value = float(torch.stack(recent).mean())
    return TrainResult(
        variant=variant,
        steps=step,
        seconds=seconds,
        final_loss=loss_value,
        tokens_per_s=step * settings.batch * settings.train_len / max(seconds, 1e-9),
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------
# Evaluation


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
    task = settings.task()
    model.eval()
    cells: list[Cell] = []
    began = time.perf_counter()
    for length in lengths:
        for d_index, depth in enumerate(depths):
            gen = torch.Generator().manual_seed(_cell_seed(settings.seed, length, d_index))
            for attn in model.attentions():
                attn.generator = torch.Generator(device=device).manual_seed(
                    _cell_seed(settings.seed, length, d_index)
                )
            exact_sum, token_sum, done = 0.0, 0.0, 0
            try:
                while done < samples:
                    size = min(eval_batch, samples - done)
                    nb = needle_batch(
                        task,
                        size,
                        length,
                        settings.reach,
                        settings.sel_block,
                        gen,
                        depth=depth,
                    )
                    tokens = nb.tokens.to(device)
                    with _autocast(device):
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
    task = settings.task()
    gen = torch.Generator().manual_seed(settings.seed + 4)
    nb = needle_batch(task, batch, length, settings.reach, settings.sel_block, gen, depth=0.5)
    attns = model.attentions()
    for attn in attns:
        attn.recorded = []
    model.eval()
    try:
        with _autocast(device):
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
    baseline = nsa_block_indices(
        batch,
        length,
        settings.kv_heads,
        settings.num_selected,
        settings.sel_block,
        generator=torch.Generator(device=device).manual_seed(settings.seed + 5),
        device=device,
    )
    stats.append(selection_stats(baseline, settings.sel_block, source="random", layer=-1))
    return stats


# ---------------------------------------------------------------------------------------------
# Checkpoints


def save_checkpoint(path: Path, model: NeedleModel, settings: NeedleSettings, info: Any) -> None:
    """bf16 state dict with the settings and the training result."""
    state = {k: v.detach().to("cpu", torch.bfloat16) for k, v in model.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state": state, "settings": dataclasses.asdict(settings), "train": info}, path)


def load_checkpoint(
    path: Path, variant: str, device: torch.device
) -> tuple[NeedleModel, NeedleSettings, dict[str, Any]]:
    """A model of ``variant`` with the checkpoint's weights (bf16 values in float32 parameters),
    its settings and its training record."""
    payload = torch.load(path, map_location="cpu", weights_only=True)
    settings = NeedleSettings(**payload["settings"])
    model = settings.build(variant, device)
    dtype = next(model.parameters()).dtype
    model.load_state_dict({k: v.to(dtype) for k, v in payload["state"].items()})
    return model, settings, dict(payload.get("train") or {})


# ---------------------------------------------------------------------------------------------
# Reports


def accuracy_table(cells: list[Cell], variants: list[str]) -> str:
    """Markdown: one row per (length, depth), one exact-match column per model."""
    by_key = {(c.variant, c.length, c.depth): c for c in cells}
    keys = sorted({(c.length, c.depth) for c in cells})
    lines = ["| T | depth | " + " | ".join(variants) + " |", "|---|---|" + "---|" * len(variants)]
    for length, depth in keys:
        values = []
        for v in variants:
            cell = by_key.get((v, length, depth))
            values.append("-" if cell is None else f"{cell.exact:.2f}")
        lines.append(f"| {length} | {depth:.2f} | " + " | ".join(values) + " |")
    lines.append("")
    lines.append("| T | " + " | ".join(f"{v} (mean)" for v in variants) + " |")
    lines.append("|---|" + "---|" * len(variants))
    for length in sorted({c.length for c in cells}):
        values = []
        for v in variants:
            found = [c.exact for c in cells if c.variant == v and c.length == length]
            values.append(f"{sum(found) / len(found):.2f}" if found else "-")
        lines.append(f"| {length} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def write_heatmap(cells: list[Cell], variant: str, path: Path) -> str | None:
    """PNG: exact-match accuracy, depth (rows) x length (columns); a note when not written."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        return f"PNG not written: {exc} (install nsa-bench[plot] for matplotlib)"
    mine = [c for c in cells if c.variant == variant]
    lengths = sorted({c.length for c in mine})
    depths = sorted({c.depth for c in mine})
    grid = [[math.nan] * len(lengths) for _ in depths]
    for c in mine:
        grid[depths.index(c.depth)][lengths.index(c.length)] = c.exact
    fig = Figure(figsize=(1.2 * len(lengths) + 2.5, 0.6 * len(depths) + 1.8), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(t) for t in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            colour = "black" if value > 0.6 else "white"
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", color=colour, fontsize=8)
    ax.set_xlabel("context length T (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(f"passkey exact match: {variant}")
    fig.colorbar(image, ax=ax)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return None


# ---------------------------------------------------------------------------------------------
# CLI


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
        notes = _write_outputs(
            out, cells, stats, trained, variants, settings, _device_names(device), routes
        )
    return _report(notes, cells, stats, trained, variants)


def _report(
    notes: list[str],
    cells: list[Cell],
    stats: list[SelStats],
    trained: dict[str, dict[str, Any]],
    variants: list[str],
) -> int:
    """The notes and the failed models on stderr, the tables on stdout; 1 if a model failed."""
    for note in notes:
        print(f"# {note}", file=sys.stderr)
    print(_markdown(cells, stats, trained, variants))
    failed = [v for v in variants if "error" in trained.get(v, {})]
    if failed:
        print(f"# failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


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
    result = train(
        model,
        variant,
        settings,
        device,
        budget_s=args.budget_s,
        max_steps=args.steps,
        log_every_s=args.log_every_s,
    )
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
        dtype=torch.bfloat16 if _use_autocast(device) else torch.float32,
        seq_len=settings.train_len,
        requires_grad=True,
    )
    return routing_report(ctx)


def _markdown(
    cells: list[Cell],
    stats: list[SelStats],
    trained: dict[str, dict[str, Any]],
    variants: list[str],
) -> str:
    parts = [
        "## Training",
        "",
        "| model | steps | seconds | final loss | tokens/s |",
        "|---|---|---|---|---|",
    ]
    for v in variants:
        info = trained.get(v, {})
        if "error" in info:
            parts.append(f"| {v} | failed: {info['error'][:120]} | | | |")
            continue
        parts.append(
            f"| {v} | {info.get('steps', '-')} | {float(info.get('seconds', math.nan)):.1f} | "
            f"{float(info.get('final_loss', math.nan)):.4f} | "
            f"{float(info.get('tokens_per_s', math.nan)):.0f} |"
        )
    if stats:
        parts += ["", "## Selection statistics", "", format_stats_table(stats)]
    parts += ["", "## Passkey exact match", "", accuracy_table(cells, variants)]
    return "\n".join(parts)


def _write_outputs(
    out: Path,
    cells: list[Cell],
    stats: list[SelStats],
    trained: dict[str, dict[str, Any]],
    variants: list[str],
    settings: NeedleSettings,
    devices: tuple[str, str],
    routes: str,
) -> list[str]:
    """needle.csv, sel_stats.csv, needle.json, the heat maps and needle.md under ``out``;
    ``devices``: (device, device_name) as :func:`_device_names` gives them."""
    notes = []
    columns = [f.name for f in dataclasses.fields(Cell)]
    with open(out / "needle.csv", "w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=columns)
        writer.writeheader()
        writer.writerows(dataclasses.asdict(c) for c in cells)
    if stats:
        with open(out / "sel_stats.csv", "w", newline="") as stream:
            writer = csv.DictWriter(stream, fieldnames=list(stats[0].as_dict()))
            writer.writeheader()
            writer.writerows(s.as_dict() for s in stats)
    record = {
        "device": devices[0],
        "device_name": devices[1],
        "settings": dataclasses.asdict(settings),
        "routing": routes.splitlines(),
        "train": trained,
        "cells": [dataclasses.asdict(c) for c in cells],
        "sel_stats": [s.as_dict() for s in stats],
    }
    (out / "needle.json").write_text(json.dumps(record, indent=1))
    for variant in sorted({c.variant for c in cells}, key=variants.index):
        why_not = write_heatmap(cells, variant, out / f"needle_{variant}.png")
        if why_not:
            notes.append(why_not)
            break
    (out / "needle.md").write_text(_markdown(cells, stats, trained, variants) + "\n")
    return notes


def _device_names(device: torch.device) -> tuple[str, str]:
    """(device, device_name) as needle.json records them."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return str(device), name


def merge_runs(dirs: list[Path], out: Path) -> int:
    """One report from runs that trained the variants apart (``--variants nsa`` on one GPU,
    ``--variants window`` on another): their needle.json merged, in VARIANTS order.

    The runs must share every setting (the same task, model and seeds), or their accuracies
    would not be comparable; a variant in two runs is refused."""
    records = []
    for d in dirs:
        path = d / "needle.json"
        if not path.is_file():
            raise SystemExit(f"--merge: {path} not found (did that run finish?)")
        records.append(json.loads(path.read_text()))
    settings = records[0]["settings"]
    for d, record in zip(dirs[1:], records[1:], strict=True):
        if record["settings"] != settings:
            changed = sorted(k for k in settings if record["settings"].get(k) != settings[k])
            raise SystemExit(f"--merge: {d} ran with other settings ({', '.join(changed)})")
    trained: dict[str, dict[str, Any]] = {}
    cells: list[Cell] = []
    stats: list[SelStats] = []
    for d, record in zip(dirs, records, strict=True):
        twice = sorted(set(record["train"]) & set(trained))
        if twice:
            raise SystemExit(f"--merge: {d} repeats variants {twice}")
        trained.update(record["train"])
        cells += [Cell(**c) for c in record["cells"]]
        stats += [SelStats(**x) for x in record["sel_stats"]]
    variants = [v for v in VARIANTS if v in trained]
    devices = sorted({(r["device"], r["device_name"]) for r in records})
    device_names = (
        ", ".join(d for d, _ in devices),
        ", ".join(sorted({name for _, name in devices})),
    )
    out.mkdir(parents=True, exist_ok=True)
    notes = _write_outputs(
        out,
        cells,
        stats,
        trained,
        variants,
        NeedleSettings(**settings),
        device_names,
        "\n".join(records[0]["routing"]),
    )
    return _report(notes, cells, stats, trained, variants)
