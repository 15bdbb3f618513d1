"""transformers' Trainer trains the NSA Llama model: the loss of a learnable task goes down."""

from __future__ import annotations

from pathlib import Path

import torch
from hf_lib import tiny_model
from transformers import Trainer, TrainingArguments


class CountingData(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Sequences that count up by a per-sequence step modulo 63 (ids 1..63): each next token
    follows from the two before it, a task a two-layer model learns in a few steps."""

    def __init__(self, size: int, length: int) -> None:
        gen = torch.Generator().manual_seed(0)
        start = torch.randint(0, 63, (size, 1), generator=gen)
        step = torch.randint(1, 4, (size, 1), generator=gen)
        self.ids = (start + step * torch.arange(length)) % 63 + 1

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def test_twenty_trainer_steps_lower_the_loss(tmp_path: Path) -> None:
    model = tiny_model(seed=0, initializer_range=0.02).train()
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=20,
        per_device_train_batch_size=8,
        learning_rate=1e-2,
        warmup_steps=0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=CountingData(size=160, length=40))
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert len(losses) == 20
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    # The untrained loss is near ln(64) = 4.16; learning the counting takes off at least 0.5.
    assert last < first - 0.5, f"loss went from {first:.3f} to {last:.3f}"
