"""Index mapping that turns the compressed-branch mask into one causal FA-2 call.

Query t sees compressed block i iff ``i*d + l - 1 <= t`` (l = k*d), i.e. it sees the first

    u(t) = N_cmp(t + 1) = max(0, floor((t + 1) / d) - k + 1)

blocks. u depends on t only through ``s = t + 1`` divided by d: the d queries whose ``s`` share one
multiple-of-d row ``m = floor(s / d)`` see exactly the same blocks (the residue class of ``t mod d``
picture, with the class ``t = d - 1 (mod d)`` shifted by one row so that every class has the same
offset). So:

* shift the queries by one slot and pad them to whole rows of d slots: row m holds the queries with
  ``floor((t + 1) / d) = base + m``;
* fold the d slots of a row into the head dimension: q [B, R*d, HQ, dk] -> [B, R, H*d*G, dk], heads
  ordered (kv head, slot, group member) so FA-2's GQA (q head i uses kv head i // (d*G)) still
  pairs each query head with its kv head;
* row m sees blocks ``j < base + m - k + 1``, which is FA-2's bottom-right causal mask
  ``j <= m + Nk - R`` with ``Nk = R + base - k`` keys: exactly N_cmp(q_start + Tq), all the
  blocks the last query sees. Rows with ``m + Nk - R < 0`` see nothing and FA-2 writes zeros there.

No key or value is copied, each query is computed once, and FA-2 does the minimal causal work
(about Tq * N / 2 dot products per head). Everything here is plain torch and runs on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nsa_core.blocks import num_cmp_blocks


def _check_blocks(cmp_block: int, cmp_stride: int) -> int:
    if cmp_stride < 1 or cmp_block < cmp_stride or cmp_block % cmp_stride != 0:
        raise ValueError(
            f"cmp_stride ({cmp_stride}) must be >= 1 and divide cmp_block ({cmp_block})"
        )
    return cmp_block // cmp_stride


@dataclass(frozen=True)
class DenseFold:
    """Fold of Tq queries at positions ``[q_start, q_start + Tq)`` (same for every batch row).

    ``front`` empty slots come before q[:, 0], ``back`` after q[:, -1]; R = ``rows`` rows of d
    slots; ``num_keys`` = Nk, the leading compressed blocks FA-2 reads (<= 0: none is seen).
    """

    front: int
    back: int
    rows: int
    num_keys: int


def dense_fold(tq: int, q_start: int, cmp_block: int, cmp_stride: int) -> DenseFold:
    """The :class:`DenseFold` of Tq queries starting at position q_start."""
    k = _check_blocks(cmp_block, cmp_stride)
    if tq < 1 or q_start < 0:
        raise ValueError(f"need tq >= 1 and q_start >= 0, got tq={tq}, q_start={q_start}")
    base, front = divmod(q_start + 1, cmp_stride)
    rows = -(-(front + tq) // cmp_stride)
    return DenseFold(
        front=front, back=rows * cmp_stride - front - tq, rows=rows, num_keys=rows + base - k
    )


@dataclass(frozen=True)
class VarlenFold:
    """Fold of packed sequences (cu_seqlens over tokens, positions restart at 0 per sequence).

    Sequence s takes ``floor(L_s / d) + 1`` rows (one leading empty slot, then its L_s queries);
    its keys are its own ``N_cmp(L_s)`` blocks (0 when L_s < l), packed as in
    ``nsa_core.blocks.cmp_cu_seqlens``. Token i lands in slot ``slot[i]`` of the flat
    [total_rows * d] query layout and packed block b in row ``key_slot[b]`` of the key layout.

    Tight packing (``dense=False``): rows and keys follow each other, ``cu_rows`` / ``cu_keys``
    (int32 [S+1]) are FA-2's varlen offsets. ``dense=True``: every sequence owns ``max_rows`` rows
    and ``max_keys`` key rows, a [S, max_rows] / [S, max_keys] batch for FA-2's dense entry point
    (padding sits after each sequence, where bottom-right causal alignment never lets a real
    query see it).
    """

    slot: torch.Tensor
    key_slot: torch.Tensor
    cu_rows: torch.Tensor
    cu_keys: torch.Tensor
    max_rows: int
    max_keys: int
    total_rows: int
    total_keys: int


def _seq_and_local(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed layout with ``counts`` items per sequence: each item's sequence and local index."""
    seq = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
    starts = torch.cumsum(counts, 0) - counts
    local = torch.arange(seq.numel(), device=counts.device) - starts[seq]
    return seq, local


def _offsets(counts: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=counts.device)
    out[1:] = torch.cumsum(counts, 0).to(torch.int32)
    return out


def varlen_fold(
    cu_seqlens: torch.Tensor, cmp_block: int, cmp_stride: int, *, dense: bool = False
) -> VarlenFold:
    """The :class:`VarlenFold` of int32 cu_seqlens [S+1]."""
    k = _check_blocks(cmp_block, cmp_stride)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    num_seq = lengths.numel()
    rows = torch.div(lengths, cmp_stride, rounding_mode="floor") + 1
    keys = torch.where(lengths < cmp_block, torch.zeros_like(rows), rows - k)
    max_rows = int(rows.max()) if num_seq else 0
    max_keys = int(keys.max()) if num_seq else 0
    if dense:
        ids = torch.arange(num_seq, device=cu_seqlens.device)
        row_start, key_start = ids * max_rows, ids * max_keys
        total_rows, total_keys = num_seq * max_rows, num_seq * max_keys
    else:
        row_start, key_start = torch.cumsum(rows, 0) - rows, torch.cumsum(keys, 0) - keys
        total_rows, total_keys = int(rows.sum()), int(keys.sum())
    seq, local = _seq_and_local(lengths)
    key_seq, key_local = _seq_and_local(keys)
    return VarlenFold(
        slot=row_start[seq] * cmp_stride + 1 + local,
        key_slot=key_start[key_seq] + key_local,
        cu_rows=_offsets(rows),
        cu_keys=_offsets(keys),
        max_rows=max_rows,
        max_keys=max_keys,
        total_rows=total_rows,
        total_keys=total_keys,
    )


def fold_heads(x: torch.Tensor, num_kv_heads: int, cmp_stride: int) -> torch.Tensor:
    """x [..., R*d, HQ, D] -> [..., R, H*d*G, D], heads ordered (kv head, slot, group member)."""
    *lead, slots, hq, dim = x.shape
    d, h = cmp_stride, num_kv_heads
    g = hq // h
    rows = slots // d
    n = len(lead)
    y = x.reshape(*lead, rows, d, h, g, dim)
    y = y.permute(*range(n), n, n + 2, n + 1, n + 3, n + 4)
    return y.reshape(*lead, rows, h * d * g, dim)


def unfold_heads(y: torch.Tensor, num_kv_heads: int, cmp_stride: int) -> torch.Tensor:
    """Inverse of :func:`fold_heads`: [..., R, H*d*G, D] -> [..., R*d, HQ, D]."""
    *lead, rows, heads, dim = y.shape
    d, h = cmp_stride, num_kv_heads
    g = heads // (h * d)
    n = len(lead)
    x = y.reshape(*lead, rows, h, d, g, dim)
    x = x.permute(*range(n), n, n + 2, n + 1, n + 3, n + 4)
    return x.reshape(*lead, rows * d, h * g, dim)


@dataclass(frozen=True)
class RowSplit:
    """Tq queries at positions ``[q_start, q_start + Tq)`` cut, in order, into runs of queries
    that see the same compressed blocks, for attention kernels with a top-left causal mask only.

    - ``blind`` queries see no block (t < l - 1);
    - ``head`` queries (< d), the rest of a row cut by q_start, see ``head_keys`` blocks;
    - ``rows`` full rows of d queries (each row starts at a position t with d | t + 1): row m
      sees ``row_keys + m`` blocks, so the rows see a causal prefix of the first
      ``row_keys + rows - 1`` blocks, offset by ``row_keys - 1`` from the top-left diagonal;
    - ``tail`` queries (< d), a row cut by the end, see ``tail_keys`` blocks.
    """

    blind: int
    head: int
    head_keys: int
    rows: int
    row_keys: int
    tail: int
    tail_keys: int


def row_split(tq: int, q_start: int, cmp_block: int, cmp_stride: int) -> RowSplit:
    """The :class:`RowSplit` of Tq >= 0 queries starting at position q_start >= 0."""
    d = cmp_stride
    _check_blocks(cmp_block, d)
    end = q_start + tq
    blind = min(tq, max(0, cmp_block - 1 - q_start))
    first = q_start + blind
    row0 = min(end, first + (-(first + 1)) % d)
    rows = (end - row0) // d
    tail_start = row0 + rows * d
    return RowSplit(
        blind=blind,
        head=row0 - first,
        head_keys=num_cmp_blocks(first + 1, cmp_block, d),
        rows=rows,
        row_keys=num_cmp_blocks(row0 + 1, cmp_block, d),
        tail=end - tail_start,
        tail_keys=num_cmp_blocks(tail_start + 1, cmp_block, d),
    )
