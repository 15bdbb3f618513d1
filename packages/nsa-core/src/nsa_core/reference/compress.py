"""Compression phi: one key (or value) per block of l tokens taken every d tokens."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nsa_core.block_math import num_cmp_blocks
from nsa_core.checks import (
    check_compress,
    check_floating,
    check_int,
    check_rank,
    check_split_blocks,
    shape,
)
from nsa_core.limits import MAX_TOKENS
from nsa_core.reference.common import spans, validated_by


def split_blocks(x: torch.Tensor, cmp_block: int, cmp_stride: int) -> torch.Tensor:
    """x [B, T, H, D] -> blocks [B, N, l, H, D], block i = tokens [i*d, i*d + l), N = N_cmp(T)."""
    check_split_blocks(x, cmp_block, cmp_stride)
    batch, t, h, d = x.shape
    n = num_cmp_blocks(t, cmp_block, cmp_stride)
    if n == 0:
        # An empty slice, not new_zeros, so that the result stays in x's autograd graph.
        return x[:, :0].unsqueeze(2).expand(batch, 0, cmp_block, h, d)
    # unfold gives [B, N, H, D, l]; blocks overlap when l > d, so this is a strided view.
    return x.unfold(1, cmp_block, cmp_stride).permute(0, 1, 4, 2, 3)


def compress_avg(blocks: torch.Tensor) -> torch.Tensor:
    """phi = mean over the block: blocks [B, N, l, H, D] -> [B, N, H, D] (floating point)."""
    check_rank("blocks", blocks, 5, "[B, N, l, H, D]")
    check_floating("blocks", blocks)
    return blocks.mean(dim=2)


class WindowMean(torch.autograd.Function):
    """``compress_avg(split_blocks(x, l, d))`` for d dividing l, with the backward written out.

    Forward: the same expression. Backward: token p's gradient is ``sum of g[i] / l`` over the
    windows i that cover it, and with d | l those are the same for the d tokens of one stride
    chunk ``[c*d, (c+1)*d)``: windows ``c - L + 1 .. c`` (L = l / d, those in [0, N)). So the
    gradient is L shifted sums of g (in float32, or float64 for float64) broadcast over each
    chunk, rounded once. Autograd's unfold backward scatters every window back token by token,
    several times slower than these sums (docs/results/2026-11-26-h100-layer-7.md).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cmp_block: int, cmp_stride: int) -> torch.Tensor:
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.cmp_block, ctx.cmp_stride = cmp_block, cmp_stride
        return compress_avg(split_blocks(x, cmp_block, cmp_stride))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        batch, t, h, dim = ctx.x_shape
        length, stride = ctx.cmp_block // ctx.cmp_stride, ctx.cmp_stride
        n = grad.shape[1]
        if n == 0:
            return grad.new_zeros(batch, t, h, dim, dtype=ctx.x_dtype), None, None
        chunks = n + length - 1
        grad_x = grad.new_empty(batch, t, h, dim, dtype=ctx.x_dtype)
        # Tokens past the last window get no gradient.
        grad_x[:, chunks * stride :] = 0
        # padded[j] = g[j - (L - 1)]: chunk c sums padded[c + L - 1 - m] for m < L.
        wide = grad.to(torch.promote_types(grad.dtype, torch.float32))
        padded = nn.functional.pad(wide, (0, 0, 0, 0, length - 1, length - 1))
        per_chunk = padded[:, length - 1 : length - 1 + chunks]
        for m in range(1, length):
            per_chunk = per_chunk + padded[:, length - 1 - m : length - 1 - m + chunks]
        per_chunk = per_chunk / ctx.cmp_block
        tokens = per_chunk[:, :, None].expand(batch, chunks, stride, h, dim)
        grad_x[:, : chunks * stride] = tokens.reshape(batch, chunks * stride, h, dim)
        return grad_x, None, None


class CompressMLP(nn.Module):
    """Learned phi: blocks [B, N, l, H, D] -> [B, N, H, D], weights shared by all heads.

    Adds a learned intra-block position embedding ``pos [l, D]``, flattens a block to ``l*D``
    (token-major: element ``p*D + c`` is token p, channel c) and applies
    ``fc2(GELU(fc1(.)))`` with hidden width D (docs/spec.md's choice). head_dim D and
    cmp_block l are ints in [1, 2^31 - 1]. Blocks come in the parameters' dtype, or in any
    floating dtype under ``torch.autocast`` (which casts them for the linear layers).
    """

    def __init__(self, head_dim: int, cmp_block: int) -> None:
        check_int("head_dim", head_dim, 1, MAX_TOKENS)
        check_int("cmp_block", cmp_block, 1, MAX_TOKENS)
        super().__init__()
        self.head_dim = head_dim
        self.cmp_block = cmp_block
        self.pos = nn.Parameter(torch.zeros(cmp_block, head_dim))
        self.fc1 = nn.Linear(cmp_block * head_dim, head_dim)
        self.fc2 = nn.Linear(head_dim, head_dim)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, blocks: torch.Tensor) -> torch.Tensor:
        check_rank("blocks", blocks, 5, "[B, N, l, H, D]")
        if blocks.shape[2] != self.cmp_block or blocks.shape[4] != self.head_dim:
            raise ValueError(
                f"blocks {shape(blocks)} must be [B, N, l={self.cmp_block}, H, D={self.head_dim}]"
            )
        check_floating("blocks", blocks)
        weight = self.fc1.weight
        if blocks.dtype != weight.dtype and not torch.is_autocast_enabled(blocks.device.type):
            raise TypeError(
                f"blocks dtype {blocks.dtype} differs from phi's parameters' {weight.dtype}: cast "
                "phi or the blocks, or run under torch.autocast"
            )
        if blocks.device != weight.device:
            raise ValueError(f"blocks is on {blocks.device} but phi is on {weight.device}")
        # The position embedding joins the blocks in their dtype: under torch.autocast the add,
        # which autocast leaves to type promotion, would lift half-precision blocks to float32.
        x = blocks + self.pos.to(blocks.dtype)[:, None, :]
        x = x.permute(0, 1, 3, 2, 4).flatten(3)  # [B, N, H, l*D]
        out: torch.Tensor = self.fc2(nn.functional.gelu(self.fc1(x)))
        return out


Phi = nn.Module


@validated_by(check_compress)
def compress(
    x: torch.Tensor,
    cmp_block: int,
    cmp_stride: int,
    phi: nn.Module | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Compressed keys or values of a whole prefix.

    Args:
        x: [B, T, H, D] raw (rotated) keys or values of the compressed branch.
        cmp_block, cmp_stride: l and d.
        phi: a module mapping blocks [B, N, l, H, D] -> [B, N, H, D]; None means the mean.
        cu_seqlens: int32 [S+1] for packed sequences (B == 1); the blocks of each sequence are
            packed in order, ``nsa_core.blocks.cmp_cu_seqlens`` gives their offsets.

    Returns:
        [B, N, H, D] with N = N_cmp(T) (or the sum of N_cmp(L_s) when varlen).
    """

    def one(part: torch.Tensor) -> torch.Tensor:
        if phi is None and cmp_block % cmp_stride == 0:
            out: torch.Tensor = WindowMean.apply(part, cmp_block, cmp_stride)  # type: ignore[no-untyped-call]
            return out
        blocks = split_blocks(part, cmp_block, cmp_stride)
        return compress_avg(blocks) if phi is None else phi(blocks)

    if cu_seqlens is None:
        return one(x)
    return torch.cat([one(x[:, s:e]) for s, e in spans(cu_seqlens)], dim=1)


# The body without the checks, for callers that validated the call already (the attention core).
compress_impl = compress.body
