"""Train smoke: a two-layer model built on NSAAttention learns a task that needs sparse attention.

Task (fixed-offset recall): the input is i.i.d. uniform tokens; the target at position t is the
token at ``t - D``. The current token says nothing about the target, so without attention the
best is chance (1/V). D is larger than the window w and reaches past the forced initial and local
selection blocks, so the model must route the far token through the selected branch, whose free
slot is chosen from the compressed-branch scores (and the compressed branch itself, which only
sees block averages).

Measured while writing this test (final eval accuracy, loss / initial loss), QUICK on CPU: intact
0.99, 0.02; every op replaced by "attend to key 0 only" 0.11, 0.94; selection ignoring the scores
(forced blocks plus the lowest-index others) 0.71, 0.29; selected branch switched off 0.33, 0.60.
LONG on an H100: intact 1.00, 0.0002; key 0 only 0.06, 0.95; scores ignored 0.60, 0.31; no
selected branch 0.31, 0.47. Each recipe's thresholds reject all three broken variants.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from nsa_core import NSAAttention, NSAConfig


class Block(nn.Module):
    """Pre-norm residual block: x + NSA(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, config: NSAConfig, hidden: int) -> None:
        super().__init__()
        self.norm_attn = nn.LayerNorm(hidden)
        self.attn = NSAAttention(config, hidden)
        self.norm_mlp = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(
            nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_attn(x))
        out: torch.Tensor = x + self.mlp(self.norm_mlp(x))
        return out


class TinyNSAModel(nn.Module):
    """tokens [B, T] -> logits [B, T, V]: embedding, 2 NSA blocks (phi avg, then phi mlp), head."""

    def __init__(self, config: NSAConfig, vocab: int, hidden: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(
            [Block(config, hidden), Block(dataclasses.replace(config, phi="mlp"), hidden)]
        )
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


@dataclass(frozen=True)
class Recipe:
    config: NSAConfig
    vocab: int
    seq_len: int
    offset: int  # D
    hidden: int
    batch: int
    steps: int
    lr: float


def recall_batch(
    recipe: Recipe, batch: int, gen: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [batch, T] and targets [batch, T - D] (target at t >= D is tokens[t - D])."""
    tokens = torch.randint(0, recipe.vocab, (batch, recipe.seq_len), generator=gen)
    tokens = tokens.to(device)
    return tokens, tokens[:, : recipe.seq_len - recipe.offset]


def loss_and_accuracy(
    model: TinyNSAModel, recipe: Recipe, tokens: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, float]:
    logits = model(tokens)[:, recipe.offset :]
    loss = nn.functional.cross_entropy(logits.reshape(-1, recipe.vocab), targets.reshape(-1))
    accuracy = float((logits.argmax(-1) == targets).float().mean())
    return loss, accuracy


def train(recipe: Recipe, device: torch.device, seed: int) -> tuple[float, float, float]:
    """Train from scratch; -> (initial eval loss, final eval loss, final eval accuracy)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyNSAModel(recipe.config, recipe.vocab, recipe.hidden).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0)
    eval_tokens, eval_targets = recall_batch(recipe, 64, gen, device)
    with torch.no_grad():
        initial, _ = loss_and_accuracy(model, recipe, eval_tokens, eval_targets)
    for _ in range(recipe.steps):
        tokens, targets = recall_batch(recipe, recipe.batch, gen, device)
        loss, _ = loss_and_accuracy(model, recipe, tokens, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    with torch.no_grad():
        final, accuracy = loss_and_accuracy(model, recipe, eval_tokens, eval_targets)
    return float(initial), float(final), accuracy


def check_forced_blocks_do_not_reach(recipe: Recipe) -> None:
    """The target of every scored position t >= some point lies outside the window and outside
    the forced blocks {0, t // l' - 1, t // l'}: only a score-chosen block (or the coarse
    compressed branch) can supply it."""
    cfg, d = recipe.config, recipe.offset
    assert d >= cfg.window
    outside = 0
    for t in range(d, recipe.seq_len):
        j_target, j_now = (t - d) // cfg.sel_block, t // cfg.sel_block
        outside += j_target not in (0, j_now - 1, j_now)
    assert outside >= (recipe.seq_len - d) // 2


QUICK = Recipe(
    config=NSAConfig(
        num_q_heads=4,
        num_kv_heads=2,
        head_dim_qk=16,
        head_dim_v=16,
        cmp_block=8,
        cmp_stride=4,
        sel_block=8,
        num_selected=4,
        window=8,
    ),
    vocab=16,
    seq_len=48,
    offset=20,
    hidden=32,
    batch=16,
    steps=200,
    lr=3e-3,
)


def test_train_smoke_cpu() -> None:
    """200 AdamW steps on CPU: loss falls below a quarter of its start, accuracy above 0.9
    (chance is 1/16)."""
    check_forced_blocks_do_not_reach(QUICK)
    initial, final, accuracy = train(QUICK, torch.device("cpu"), seed=0)
    assert math.isfinite(final)
    assert abs(initial - math.log(QUICK.vocab)) < 0.5  # starts near chance
    assert final < 0.25 * initial, (initial, final, accuracy)
    assert accuracy > 0.9, (initial, final, accuracy)


LONG = Recipe(
    config=NSAConfig(
        num_q_heads=4,
        num_kv_heads=2,
        head_dim_qk=32,
        head_dim_v=32,
        cmp_block=16,
        cmp_stride=8,
        sel_block=16,
        num_selected=4,
        window=16,
    ),
    vocab=32,
    seq_len=128,
    offset=50,
    hidden=64,
    batch=32,
    steps=600,
    lr=2e-3,
)


@pytest.mark.slow(reason="600 training steps on longer sequences: minutes")
def test_train_smoke_long() -> None:
    """The GPU tiers' version (CUDA when available): longer sequences, a farther offset, a larger
    vocabulary, and a stricter bar."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check_forced_blocks_do_not_reach(LONG)
    initial, final, accuracy = train(LONG, device, seed=1)
    assert math.isfinite(final)
    assert final < 0.05 * initial, (initial, final, accuracy)
    assert accuracy > 0.98, (initial, final, accuracy)
