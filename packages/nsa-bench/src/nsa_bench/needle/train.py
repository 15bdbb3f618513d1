"""Training one needle model under a step cap and a time budget, and its bf16 checkpoints."""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nsa_bench.needle.model import NeedleModel
from nsa_bench.needle.settings import NeedleSettings, autocast
from nsa_bench.needle.task import IGNORE, NeedleBatch
from nsa_bench.timing import synchronize


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
    with autocast(device):
        logits = model(tokens, targets.shape[1])
    return nn.functional.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE
    )


@dataclass(frozen=True)
class TrainBudget:
    """When one model's training stops (``seconds`` or ``max_steps``, whichever comes first) and
    how often it reports its progress."""

    seconds: float
    max_steps: int
    log_every_s: float


def train(
    model: NeedleModel,
    variant: str,
    settings: NeedleSettings,
    device: torch.device,
    budget: TrainBudget,
) -> TrainResult:
    """AdamW with linear warm-up, then cosine decay to 10% over the time budget (or the step cap,
    whichever ends first). One unscored forward and backward first compiles the kernels so that
    the budget counts training only."""
    gen = torch.Generator().manual_seed(settings.seed + 1)  # same batches for every variant
    for attn in model.attentions():
        attn.generator = torch.Generator(device=device).manual_seed(settings.seed + 2)
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.01)

    def batch(generator: torch.Generator) -> NeedleBatch:
        return settings.sequences(settings.batch, settings.train_len, generator)

    warm = batch(torch.Generator().manual_seed(settings.seed + 3))
    warm_start = time.perf_counter()
    torch.autograd.backward(_step_loss(model, warm, device))
    opt.zero_grad(set_to_none=True)
    synchronize(device)
    start = time.perf_counter()
    print(
        f"# train {variant} warm-up step (kernel compile) {start - warm_start:.1f}s",
        file=sys.stderr,
        flush=True,
    )
    last_log = start
    step, loss_value, recent = 0, math.nan, []
    max_steps = budget.max_steps
    while step < max_steps:
        elapsed = time.perf_counter() - start
        if elapsed >= budget.seconds:
            break
        progress = max(elapsed / budget.seconds, step / max_steps)
        lr = settings.lr * min(1.0, (step + 1) / settings.warmup_steps)
        lr *= 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        for group in opt.param_groups:
            group["lr"] = lr
        loss = _step_loss(model, batch(gen), device)
        opt.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        recent.append(loss.detach())
        now = time.perf_counter()
        if now - last_log >= budget.log_every_s or step == max_steps:
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
    synchronize(device)
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
