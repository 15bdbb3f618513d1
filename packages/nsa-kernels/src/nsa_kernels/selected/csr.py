"""The reverse index of a block selection, and the dk/dv work it splits into.

The forward walks each query's selected blocks. The dk/dv backward needs the opposite view: for
each key block, the queries that selected it. :func:`build_block_csr` inverts ``block_indices``
with torch ops only (a sort of each row, one sort of all pairs, one search of the slot
boundaries), so the backward does O(T * n) index work and O(T * n * l') attention work, never a
scan of every query per block. The sort makes the order of queries inside a block fixed
(ascending rows), so the float sums over them, and hence dk/dv, are bitwise reproducible.
:func:`build_dkv_work` cuts heavily selected blocks (block 0 is selected by every query) into
segments so no single program serializes the backward.

The sizes of both (pairs, segments, partial rows) depend on the indices. The device computes the
slot offsets, and one copy brings them to the host (:func:`start_block_csr`, then
:meth:`CSRInFlight.finish`), which plans the segments and sends the plan back in one copy: one
wait in all, which the backward places behind the dq launch so that the GPU never idles on it
(a host sync at each step would leave the GPU idle while the host issues the next small launch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
        host_offsets: int64 [S + 1] on the CPU, ``offsets`` copied (the work plan reads it).
    """

    rows: torch.Tensor
    offsets: torch.Tensor
    slot_b: torch.Tensor
    slot_h: torch.Tensor
    slot_krow0: torch.Tensor
    slot_kend: torch.Tensor
    slot_pos0: torch.Tensor
    slot_tshift: torch.Tensor
    host_offsets: torch.Tensor

    @property
    def num_slots(self) -> int:
        return int(self.slot_b.numel())

    def counts(self) -> torch.Tensor:
        """int64 [S]: queries per slot."""
        return self.offsets[1:] - self.offsets[:-1]


def _to_host(x: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """A CPU copy of ``x`` and, on CUDA, the event after which it holds x's values: the copy is
    asynchronous (pinned memory), so the caller decides when to wait for it."""
    if x.device.type != "cuda":
        return x.clone(), None
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x, non_blocking=True)
    ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
    ready.record()
    return host, ready


def _to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for the device (pinned, asynchronous)."""
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class CSRInFlight:
    """A :class:`BlockCSR` whose device work is queued and whose offsets are on their way to the
    host; :meth:`finish` waits for them (and for nothing queued after the copy)."""

    sorted_keys: torch.Tensor
    tq: int
    offsets: torch.Tensor
    host_offsets: torch.Tensor
    ready: torch.cuda.Event | None
    slots: dict[str, torch.Tensor]

    def finish(self) -> BlockCSR:
        if self.ready is not None:
            self.ready.synchronize()
        pairs = int(self.host_offsets[-1])
        rows = (self.sorted_keys[:pairs].to(torch.int64) % self.tq).to(torch.int32)
        return BlockCSR(
            rows=rows, offsets=self.offsets, host_offsets=self.host_offsets, **self.slots
        )


def build_block_csr(
    block_indices: torch.Tensor, sel_block: int, num_keys: int, **options: Any
) -> BlockCSR:
    """:func:`start_block_csr` with the same arguments, finished (one wait for the offsets)."""
    return start_block_csr(block_indices, sel_block, num_keys, **options).finish()


def start_block_csr(
    block_indices: torch.Tensor,
    sel_block: int,
    num_keys: int,
    *,
    q_start: int = 0,
    cu_seqlens: torch.Tensor | None = None,
    rows_are_sets: bool = False,
) -> CSRInFlight:
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
        rows_are_sets: every row already lists each block at most once (besides -1), as
            ``nsa_kernels.selected.indices.unique_block_rows`` gives them to the kernels: the
            per-row sort that finds repeats is skipped.
    """
    batch, tq, heads, _n = block_indices.shape
    device = block_indices.device
    idx = block_indices.to(torch.int64)
    if not rows_are_sets:
        idx = torch.sort(idx, dim=-1).values
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
    if not rows_are_sets:
        # A block listed twice in one row enters once: after a sort of the row, its repeats are
        # the entries equal to their left neighbour (and leave as invalid pairs).
        valid[..., 1:] &= idx[..., 1:] != idx[..., :-1]
    rows_b = torch.arange(tq, device=device).view(1, tq, 1, 1)
    # One key per pair: slot-major, then row; invalid pairs get a sentinel that sorts last, so
    # the pairs are the sorted keys' prefix and slot s's start is the number of keys < s * Tq.
    key = torch.where(valid, slot * tq + rows_b, num_slots * tq).flatten()
    bounds = torch.arange(num_slots + 1, device=device) * tq
    if (num_slots + 1) * tq < 2**31:
        key, bounds = key.to(torch.int32), bounds.to(torch.int32)
    key = torch.sort(key).values
    offsets = torch.searchsorted(key, bounds)
    host_offsets, ready = _to_host(offsets)
    slots = dict(
        slot_b=slot_b, slot_h=slot_h, slot_krow0=slot_krow0, slot_kend=slot_kend,
        slot_pos0=slot_pos0, slot_tshift=slot_tshift,
    )  # fmt: skip
    return CSRInFlight(key, tq, offsets, host_offsets, ready, slots)


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
    """Cut each slot's rows into segments of at most ``segment_tokens`` (empty slots: none).

    Planned on the host from ``csr.host_offsets`` (no wait for the device); the plan goes to the
    device in one asynchronous copy and picks its slot fields there.
    """
    if segment_tokens < 1:
        raise ValueError(f"segment_tokens must be >= 1, got {segment_tokens}")
    device = csr.offsets.device
    offsets = csr.host_offsets
    counts = offsets[1:] - offsets[:-1]
    nseg = -(-counts // segment_tokens)
    total = int(nseg.sum())
    seg_slot = torch.repeat_interleave(torch.arange(counts.numel()), nseg, output_size=total)
    seg_first = torch.cumsum(nseg, 0) - nseg
    k_in_slot = torch.arange(total) - seg_first[seg_slot]
    start = offsets[seg_slot] + k_in_slot * segment_tokens
    end = torch.minimum(start + segment_tokens, offsets[seg_slot + 1])
    multi = nseg[seg_slot] > 1
    part = torch.where(multi, torch.cumsum(multi.to(torch.int64), 0) - 1, -1)
    num_parts = int(multi.sum())
    order = torch.sort(end - start, descending=True, stable=True).indices
    multi_slots = torch.nonzero(nseg > 1).flatten()
    first_part = torch.cumsum(torch.where(nseg > 1, nseg, 0), 0) - nseg
    plan = torch.stack([seg_slot[order], start[order], end[order], part[order]])
    # A fourth row of zeros so that both plans travel as one [4, S + M] tensor.
    reduce_plan = torch.stack(
        [multi_slots, first_part[multi_slots], nseg[multi_slots], torch.zeros_like(multi_slots)]
    )
    both = _to_device(torch.cat([plan, reduce_plan], dim=1), device)
    seg_slot_d, start_d, end_d, part_d = both[:, :total]
    red_slot, red_first, red_count = both[:3, total:]
    segments = torch.stack(
        [
            csr.slot_b[seg_slot_d],
            csr.slot_h[seg_slot_d],
            csr.slot_krow0[seg_slot_d],
            csr.slot_kend[seg_slot_d],
            csr.slot_pos0[seg_slot_d],
            start_d,
            end_d,
            part_d,
            csr.slot_tshift[seg_slot_d],
        ],
        dim=1,
    ).contiguous()
    assert segments.shape[1] == SEG_FIELDS
    reductions = torch.stack(
        [
            csr.slot_b[red_slot],
            csr.slot_h[red_slot],
            csr.slot_krow0[red_slot],
            csr.slot_kend[red_slot],
            red_first,
            red_count,
        ],
        dim=1,
    ).contiguous()
    assert reductions.shape[1] == RED_FIELDS
    return DkvWork(segments=segments, reductions=reductions, num_parts=num_parts)
