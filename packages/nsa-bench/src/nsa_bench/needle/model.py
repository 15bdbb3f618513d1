"""The needle language model: pre-norm blocks around an NSAAttention whose branches the variant
picks (``nsa`` as it is, ``window`` the sliding branch alone, ``random`` random selection)."""

from __future__ import annotations

import torch
from torch import nn

from nsa_bench.sel_bench import nsa_block_indices
from nsa_core import NSAAttention, NSAConfig, ops

VARIANTS = ("nsa", "window", "random")


def random_selection(
    config: NSAConfig,
    batch: int,
    seq_len: int,
    generator: torch.Generator | None,
    device: torch.device,
) -> torch.Tensor:
    """int32 [B, T, H, n]: the forced blocks plus random distinct valid ones, ascending, -1
    padded (the index contract of ``select_blocks``), as the ``random`` variant selects."""
    blocks = (config.num_kv_heads, config.num_selected, config.sel_block)
    return nsa_block_indices(batch, seq_len, *blocks, generator=generator, device=device)


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
        """The random variant's blocks for x [B, T, hidden], drawn from ``self.generator``."""
        return random_selection(self.config, batch, t, self.generator, device)

    def forward(
        self,
        x: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden], causal (no packed sequences, padding or
        positions here: every needle sequence fills its row from position 0)."""
        if cu_seqlens is not None:
            raise ValueError("the needle model takes no packed sequences")
        if attention_mask is not None or position_ids is not None:
            raise ValueError("the needle model takes no attention_mask or position_ids")
        if self.variant == "nsa" and self.recorded is None:
            return super().forward(x)
        cfg = self.config
        scale = cfg.softmax_scale
        self.check_input(x)
        inp = self.branch_inputs(x, torch.arange(x.shape[1], device=x.device))
        if self.variant == "window":
            o_win = ops.sliding_attention(inp.q, inp.k["win"], inp.v["win"], cfg.window, scale)
            o = o_win * inp.gates[..., 2:3]
        else:
            k_cmp, v_cmp = self.compress_kv(inp.k["cmp"], inp.v["cmp"])
            if self.variant == "nsa":
                o_cmp, o_sel, o_win, indices = self.branch_outputs(
                    inp.q, k_cmp, v_cmp, inp.k["sel"], inp.v["sel"], inp.k["win"], inp.v["win"]
                )
                if self.recorded is not None:
                    self.recorded.append(indices.detach())
            else:
                o_cmp = ops.compressed_attention(
                    inp.q, k_cmp, v_cmp, cfg.cmp_block, cfg.cmp_stride, scale
                )
                indices = self.random_block_indices(x.shape[0], x.shape[1], x.device)
                o_sel = ops.selected_attention(
                    inp.q, inp.k["sel"], inp.v["sel"], indices, cfg.sel_block, scale
                )
                o_win = ops.sliding_attention(inp.q, inp.k["win"], inp.v["win"], cfg.window, scale)
            o = ops.gated_combine(o_cmp, o_sel, o_win, inp.gates)
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
