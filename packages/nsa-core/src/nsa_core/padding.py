"""Padding masks and RoPE positions of a layer's input (docs/spec.md, "Padding and positions").

A padded batch x [B, T, hidden] holds, in each row, one contiguous run of real tokens (left or
right padding). The layer packs those runs into one varlen sequence (B == 1 with cu_seqlens, one
packed sequence per row), runs it, and scatters the output back with zeros at the padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nsa_core.checks import shape
from nsa_core.limits import MAX_TOKENS


@dataclass(frozen=True)
class TokenLayout:
    """Where the N real tokens of a padded batch [B, T] sit.

    rows, cols [N]: the batch row and column of each real token, row by row (row 0's run first);
    cu_seqlens int32 [B+1]: the packed sequences, one per row, empty rows included;
    columns: T;
    starts, lengths: the first column and the length of each row's run (start 0 for an empty row).
    """

    rows: torch.Tensor
    cols: torch.Tensor
    cu_seqlens: torch.Tensor
    columns: int
    starts: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def batch(self) -> int:
        """B, the rows of the padded batch."""
        return len(self.lengths)

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """padded [B, T, ...] -> [1, N, ...]: the real tokens, as one varlen sequence."""
        return padded[self.rows, self.cols].unsqueeze(0)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """packed [1, N, F] -> [B, T, F]: each token back at its place, exactly 0 at padding.

        Differentiable in ``packed``; the padding rows take no gradient.
        """
        out = packed.new_zeros(self.batch, self.columns, packed.shape[-1])
        return out.index_put((self.rows, self.cols), packed[0])


def check_attention_mask(attention_mask: object, x: torch.Tensor) -> TokenLayout:
    """attention_mask [B, T] of x [B, T, hidden]: bool or integer 0/1 (1 = token) on x's device,
    each row's tokens one contiguous run (a row may hold none). -> where the tokens sit."""
    if not isinstance(attention_mask, torch.Tensor):
        kind = type(attention_mask).__name__
        raise TypeError(f"attention_mask must be a torch.Tensor [B, T], got {kind}")
    mask = attention_mask
    if mask.is_floating_point() or mask.is_complex():
        raise TypeError(f"attention_mask must be bool or integer 0/1, got {mask.dtype}")
    if tuple(mask.shape) != tuple(x.shape[:2]):
        raise ValueError(f"attention_mask {shape(mask)} must be [B, T] = {list(x.shape[:2])} of x")
    if mask.device != x.device:
        raise ValueError(f"attention_mask is on {mask.device} but x is on {x.device}")
    if mask.shape[0] == 0:
        raise ValueError("attention_mask [0, T] holds no rows: a padded batch needs B >= 1")
    if mask.dtype != torch.bool and bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")
    token = mask.to(torch.bool)
    # A run begins at each token whose left neighbour is padding (or the row's edge).
    left = torch.nn.functional.pad(token.to(torch.int8), (1, 0))[:, :-1].to(torch.bool)
    runs = (token & ~left).sum(dim=1)
    if bool((runs > 1).any()):
        row = int((runs > 1).nonzero()[0, 0])
        raise ValueError(
            f"attention_mask row {row} splits its tokens into {int(runs[row])} runs; each row's "
            "tokens must be one contiguous run (left or right padding)"
        )
    lengths = token.sum(dim=1)
    leading_padding = (token.cumsum(dim=1) == 0).sum(dim=1)
    starts = torch.where(lengths > 0, leading_padding, 0)
    rows, cols = token.nonzero(as_tuple=True)
    cu_seqlens = torch.zeros(mask.shape[0] + 1, dtype=torch.int32, device=mask.device)
    cu_seqlens[1:] = torch.cumsum(lengths, 0)
    return TokenLayout(
        rows=rows,
        cols=cols,
        cu_seqlens=cu_seqlens,
        columns=mask.shape[1],
        starts=tuple(starts.tolist()),
        lengths=tuple(lengths.tolist()),
    )


def check_position_ids(
    position_ids: object, x: torch.Tensor, layout: TokenLayout | None
) -> torch.Tensor:
    """position_ids [T], [1, T] or [B, T] of x [B, T, hidden]: integers on x's device, each real
    token's in [0, MAX_TOKENS) (with a mask, the padding's entries are not used and not checked).

    -> [1 | B, T] int64, the RoPE positions of x's tokens.
    """
    if not isinstance(position_ids, torch.Tensor):
        kind = type(position_ids).__name__
        raise TypeError(f"position_ids must be a torch.Tensor [B, T] or [T], got {kind}")
    pos = position_ids
    if pos.is_floating_point() or pos.is_complex() or pos.dtype == torch.bool:
        raise TypeError(f"position_ids must hold integers, got {pos.dtype}")
    batch, t = x.shape[:2]
    if pos.dim() == 1:
        pos = pos.unsqueeze(0)
    if pos.dim() != 2 or pos.shape[1] != t or pos.shape[0] not in (1, batch):
        raise ValueError(
            f"position_ids {shape(position_ids)} must be [B, T], [1, T] or [T] with B={batch}, "
            f"T={t} of x"
        )
    if pos.device != x.device:
        raise ValueError(f"position_ids is on {pos.device} but x is on {x.device}")
    pos = pos.to(torch.int64)
    used = pos if layout is None else layout.pack(pos.expand(batch, t))
    if used.numel() and not (int(used.min()) >= 0 and int(used.max()) < MAX_TOKENS):
        raise ValueError(
            f"position_ids must lie in [0, {MAX_TOKENS}) (int32 positions), got values in "
            f"[{int(used.min())}, {int(used.max())}]"
        )
    return pos
