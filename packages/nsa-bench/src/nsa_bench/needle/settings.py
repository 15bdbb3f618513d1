"""Everything a needle run depends on, stored in each checkpoint, and the precision it trains
and evaluates in."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nsa_bench.cli_args import blocks_config
from nsa_bench.needle.model import NeedleModel
from nsa_bench.needle.task import NeedleBatch, NeedleTask, needle_batch
from nsa_core import NSAConfig


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

    def sequences(
        self, size: int, length: int, generator: torch.Generator, *, depth: float | None = None
    ) -> NeedleBatch:
        """``size`` task sequences of ``length`` tokens, the needle beyond this model's windows
        (:func:`~nsa_bench.needle.task.needle_batch`)."""
        task, reach, sel_block = self.task(), self.reach, self.sel_block
        return needle_batch(task, size, length, reach, sel_block, generator, depth=depth)

    def build(self, variant: str, device: torch.device) -> NeedleModel:
        """The model of ``variant`` with weights from ``seed`` (the same for every variant)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = NeedleModel(
                self.nsa_config(), self.task().vocab_size, self.hidden, self.layers, variant
            )
        return model.to(device)


def use_autocast(device: torch.device) -> bool:
    """bf16 autocast over float32 weights on CUDA (the Triton routes); float32 elsewhere."""
    return device.type == "cuda"


def autocast(device: torch.device) -> torch.autocast:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast(device))
