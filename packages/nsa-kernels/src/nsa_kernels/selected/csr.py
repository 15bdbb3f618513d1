"""The reverse index of a block selection, and the dk/dv work it splits into.

The forward walks each query's selected blocks. The dk/dv backward needs the opposite view: for
each key block, the queries that selected it. :func:`build_block_csr` inverts ``block_indices``
with torch ops only (one sort, one bincount, one cumsum), so the backward does O(T * n) index work
and O(T * n * l') attention work, never a scan of every query per block. The sort makes the
order of queries inside a block fixed (ascending rows), so the float sums over them, and hence
dk/dv, are bitwise reproducible. :func:`build_dkv_work` cuts heavily selected blocks (block 0 is
selected by every query) into segments so no single program serializes the backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Integer fields of one dk/dv work segment (the rows of the int64 table build_dkv_work makes,
# read by the dk/dv kernel of backward.py).
SEG_B, SEG_H, SEG_KROW0, SEG_KEND, SEG_POS0, SEG_START, SEG_END, SEG_PART, SEG_TSHIFT = range(9)
SEG_FIELDS = 9
# Fields of one multi-segment block for the reduction: b, h, key row 0, key end, first part, parts.
RED_FIELDS = 6


@dataclass(frozen=True)
class BlockCSR:
    """Queries grouped by the (batch, kv head, key block) "slot" that they selected.

    Slot ``s`` owns ``rows[offsets[s]:offsets[s+1]]`` (ascending). A row is the query's index
    along q's T axis (dense: inside its batch; varlen: in the packed sequence), its position is
    ``row + slot_tshift[s]``. Slots are ordered ``(b * H + h) * NB + j`` (dense, NB key blocks) or
    ``h * NBT + block_offset[seq] + j`` (varlen, NBT blocks over all sequences).

    Attributes:
        rows: int32 [P], P = number of distinct (query, kv head, block) pairs whose block holds at
            least one key the query sees (``j * l' <= t``).
        offsets: int64 [S + 1].
        slot_b, slot_h: int64 [S], batch and kv head of each slot.
        slot_krow0: int64 [S], index along k's T axis of the block's first key.
        slot_kend: int64 [S], end (exclusive) along k's T axis of the block's sequence.
        slot_pos0: int64 [S], position of the block's first key inside its sequence (j * l').
        slot_tshift: int64 [S], query position minus row.
    """

    rows: torch.Tensor
    offsets: torch.Tensor
    slot_b: torch.Tensor
    slot_h: torch.Tensor
    slot_krow0: torch.Tensor
    slot_kend: torch.Tensor
    slot_pos0: torch.Tensor
    slot_tshift: torch.Tensor

    @property
    def num_slots(self) -> int:
        return int(self.slot_b.numel())

    def counts(self) -> torch.Tensor:
        """int64 [S]: queries per slot."""
        return self.offsets[1:] - self.offsets[:-1]


def build_block_csr(
    block_indices: torch.Tensor,
    sel_block: int,
    num_keys: int,
    *,
    q_start: int = 0,
    cu_seqlens: torch.Tensor | None = None,
) -> BlockCSR:
    """Invert ``block_indices [B, Tq, H, n]`` into the queries of each key block.

    A pair (row r, kv head h, block j) enters when ``j >= 0`` and ``j * l' <= t`` (t = q_start + r,
    or the in-sequence position for varlen): the block then holds a key the query sees. -1
    padding and blocks wholly in the query's future drop out; a block listed twice in one row
    enters once.

    Args:
        block_indices: [B, Tq, H, n] int32/int64.
        sel_block: l'.
        num_keys: Tk, tokens along k's T axis (dense; for varlen, the packed total).
        q_start: position of row 0 (dense).
        cu_seqlens: int32 [S+1] for packed sequences (B == 1).
    """
    batch, tq, heads, _n = block_indices.shape
    device = block_indices.device
    idx = block_indices.to(torch.int64)
    if cu_seqlens is None:
        nb = -(-num_keys // sel_block)
        num_slots = batch * heads * nb
        pos = (q_start + torch.arange(tq, device=device)).view(1, tq, 1, 1)
        b = torch.arange(batch, device=device).view(batch, 1, 1, 1)
        h = torch.arange(heads, device=device).view(1, 1, heads, 1)
        slot = (b * heads + h) * nb + idx
        ar = torch.arange(num_slots, device=device)
        slot_b = ar // (heads * nb)
        slot_h = (ar // nb) % heads
        j = ar % nb
        slot_pos0 = j * sel_block
        slot_krow0 = slot_pos0
        slot_kend = torch.full_like(ar, num_keys)
        slot_tshift = torch.full_like(ar, q_start)
    else:
        cu = cu_seqlens.to(torch.int64)
        lengths = cu[1:] - cu[:-1]
        blocks = -(-lengths // sel_block)
        block_off = torch.cumsum(blocks, 0) - blocks
        nbt = int(blocks.sum())
        num_slots = heads * nbt
        rows = torch.arange(tq, device=device)
        seq = torch.searchsorted(cu[1:], rows, right=True)
        pos = (rows - cu[seq]).view(1, tq, 1, 1)
        h = torch.arange(heads, device=device).view(1, 1, heads, 1)
        slot = h * nbt + block_off[seq].view(1, tq, 1, 1) + idx
        ar = torch.arange(num_slots, device=device)
        gblock = ar % nbt
        slot_seq = torch.searchsorted(block_off + blocks, gblock, right=True)
        slot_b = torch.zeros_like(ar)
        slot_h = ar // nbt
        slot_pos0 = (gblock - block_off[slot_seq]) * sel_block
        slot_krow0 = cu[slot_seq] + slot_pos0
        slot_kend = cu[slot_seq + 1]
        slot_tshift = -cu[slot_seq]

    valid = (idx >= 0) & (idx * sel_block <= pos)
    rows_b = torch.arange(tq, device=device).view(1, tq, 1, 1)
    # One key per pair: slot-major, then row; invalid pairs get a sentinel that sorts last.
    key = torch.where(valid, slot * tq + rows_b, num_slots * tq).flatten()
    if (num_slots + 1) * tq < 2**31:
        key = key.to(torch.int32)
    key = torch.sort(key).values
    keep = key != num_slots * tq
    keep[1:] &= key[1:] != key[:-1]
    key = key[keep].to(torch.int64)
    rows_out = (key % tq).to(torch.int32)
    counts = torch.bincount(key // tq, minlength=num_slots)
    offsets = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)
    offsets[1:] = torch.cumsum(counts, 0)
    return BlockCSR(
        rows=rows_out,
        offsets=offsets,
        slot_b=slot_b,
        slot_h=slot_h,
        slot_krow0=slot_krow0,
        slot_kend=slot_kend,
        slot_pos0=slot_pos0,
        slot_tshift=slot_tshift,
    )


@dataclass(frozen=True)
class DkvWork:
    """The dk/dv launch plan.

    Attributes:
        segments: int64 [S, SEG_FIELDS]: b, h, key row 0, key end, pos0, csr start, csr end, part,
            tshift; ``part == -1`` writes dk/dv directly, else the fp32 partial row ``part``.
            Ordered longest first so the long ones do not finish last.
        reductions: int64 [M, RED_FIELDS]: b, h, key row 0, key end, first part, number of
            parts, for each block split over several segments (parts summed in order).
        num_parts: rows of the partial buffers.
    """

    segments: torch.Tensor
    reductions: torch.Tensor
    num_parts: int


def default_segment_tokens(num_pairs: int, num_sms: int) -> int:
    """Longest segment: about 1/8 of one multiprocessor's share of the pairs, at least 256.

    With the segments launched longest first, the last program then starts well before the end.
    """
    return max(256, -(-num_pairs // (8 * max(1, num_sms))))


def build_dkv_work(csr: BlockCSR, segment_tokens: int) -> DkvWork:
    """Cut each slot's rows into segments of at most ``segment_tokens`` (empty slots: none)."""
    if segment_tokens < 1:
        raise ValueError(f"segment_tokens must be >= 1, got {segment_tokens}")
    device = csr.offsets.device
    counts = csr.counts()
    nseg = -(-counts // segment_tokens)
    total = int(nseg.sum())
    slot_ids = torch.arange(csr.num_slots, device=device)
    seg_slot = torch.repeat_interleave(slot_ids, nseg, output_size=total)
    seg_first = torch.cumsum(nseg, 0) - nseg
    k_in_slot = torch.arange(total, device=device) - seg_first[seg_slot]
    start = csr.offsets[seg_slot] + k_in_slot * segment_tokens
    end = torch.minimum(start + segment_tokens, csr.offsets[seg_slot + 1])
    multi = nseg[seg_slot] > 1
    part = torch.where(multi, torch.cumsum(multi.to(torch.int64), 0) - 1, -1)
    num_parts = int(multi.sum())
    segments = torch.stack(
        [
            csr.slot_b[seg_slot],
            csr.slot_h[seg_slot],
            csr.slot_krow0[seg_slot],
            csr.slot_kend[seg_slot],
            csr.slot_pos0[seg_slot],
            start,
            end,
            part,
            csr.slot_tshift[seg_slot],
        ],
        dim=1,
    )
    assert segments.shape[1] == SEG_FIELDS
    order = torch.sort(end - start, descending=True, stable=True).indices
    segments = segments[order].contiguous()

    multi_slots = torch.nonzero(nseg > 1).flatten()
    first_part = torch.cumsum(torch.where(nseg > 1, nseg, 0), 0) - nseg
    reductions = torch.stack(
        [
            csr.slot_b[multi_slots],
            csr.slot_h[multi_slots],
            csr.slot_krow0[multi_slots],
            csr.slot_kend[multi_slots],
            first_part[multi_slots],
            nseg[multi_slots],
        ],
        dim=1,
    ).contiguous()
    assert reductions.shape[1] == RED_FIELDS
    return DkvWork(segments=segments, reductions=reductions, num_parts=num_parts)
