# Triton kernels take untyped pointer/scalar parameters (types come from the launch), and
# triton.jit is untyped without triton installed: mypy checks only the plain Python here.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Tile arithmetic of the compressed-branch Triton kernels (docs/spec.md, "Compressed branch").

A query at position t sees compressed block i iff ``i*d + l - 1 <= t``: the visible blocks of a
row are the prefix ``0 .. N_cmp(t+1) - 1``. The kernels walk that prefix in tiles of BN blocks.

Query tiles (forward and dq): TPP consecutive query tokens x HPP query heads of one kv head, laid
out as BM = TPP * HPP rows (padded to a power of two), row ``r = tok * HPP + g``. When G > BM a
group is split into NCH = ceil(G / HPP) head chunks, each its own program.

Key tiles (dk/dv): BN consecutive compressed blocks of one kv head; the query rows that see them
are walked TPQ tokens x HPP heads at a time.

Windowed (the sliding branch, docs/spec.md "Sliding branch"): with l = d = 1 the blocks are the
tokens themselves and a query at t sees keys ``max(0, t - w + 1) .. t``; WINDOWED adds that lower
bound to every rule above (:func:`window_start`), and the dk/dv tiles walk only the rows whose
window reaches them.

Packed sequences (varlen) index the tiles through tables built on the device
(:func:`nsa_kernels.common.tile_table.tile_table`): int32 rows
``(sequence, first token)`` or ``(sequence, first block)``, both counted from the sequence's
start, sequence -1 for padding entries.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def visible_blocks(pos, LBLK: tl.constexpr, DSTR: tl.constexpr):
    """N_cmp(pos + 1): how many blocks a query at position ``pos`` sees (0 for pos < l - 1).

    ``(pos + 1 - l + d) // d`` is exact for pos + 1 >= l; below that it is 0 or negative under
    both truncating and flooring division, so the clamp gives 0.
    """
    return tl.maximum((pos + 1 - LBLK + DSTR) // DSTR, 0)


@triton.jit
def window_start(pos, window):
    """The first key a query at ``pos`` sees when it sees only the last ``window`` keys
    (``l = d = 1``: keys are tokens; 0 near the start of the sequence)."""
    return tl.maximum(pos - window + 1, 0)


@triton.jit
def key_stretch(STRETCH: tl.constexpr, n_start, n_open, n_full, n_hi):
    """[lo, hi) of one stretch of a query tile's walk over its key tiles (the bounds of
    ``query_tile_rows``): 0, from n_start, the tiles where some row's window starts (windowed
    only; masked); 1, the tiles every row sees whole (unmasked); 2, the causal end up to n_hi,
    where some row's prefix stops (masked)."""
    lo = n_full
    hi = n_hi
    if STRETCH == 0:
        lo = n_start
        hi = n_open
    if STRETCH == 1:
        lo = n_open
        hi = n_full
    return lo, hi


@triton.jit
def stretch_bounds(lo_first, lo_last, hi_first, hi_last, BN: tl.constexpr):
    """(n_start, n_open, n_full, n_hi) of a walk over the keys ``[lo, hi)`` of each row of a
    query tile, where lo and hi grow with the row's token (first and last token given), for
    :func:`key_stretch`: the tiles from n_open to n_full lie inside every row's interval."""
    n_start = (lo_first // BN) * BN
    n_full = (hi_first // BN) * BN
    n_open = tl.minimum(tl.maximum(tl.cdiv(lo_last, BN) * BN, n_start), n_full)
    return n_start, n_open, n_full, hi_last


@triton.jit
def local_start(pos, SEL: tl.constexpr):
    """The first key of a query at ``pos``'s local blocks ``{jt - 1, jt}`` (jt = pos // l'):
    ``max(jt - 1, 0) * l'``, the keys the selected branch always attends to (docs/spec.md,
    "Forced blocks") and that a window of w >= 2 l' holds as well."""
    return tl.maximum(pos // SEL - 1, 0) * SEL


@triton.jit
def varlen_entry(tiles_ptr, cu_ptr, cmp_cu_ptr, i):
    """(seq, offset, first, end, kbase) of entry ``i`` of a varlen tile table (int32 pairs
    ``(sequence, offset)``, sequence -1 for padding; read from sequence 0 then).

    offset: the entry's first token or block within its sequence; [first, end): the sequence's
    query rows; kbase: row of the sequence's block 0 in k_cmp. offset and the rows are int64.
    """
    seq = tl.load(tiles_ptr + 2 * i)
    offset = tl.load(tiles_ptr + 2 * i + 1).to(tl.int64)
    seq_c = tl.maximum(seq, 0)
    first = tl.load(cu_ptr + seq_c).to(tl.int64)
    end = tl.load(cu_ptr + seq_c + 1).to(tl.int64)
    kbase = tl.load(cmp_cu_ptr + seq_c).to(tl.int64)
    return seq, offset, first, end, kbase


@triton.jit
def query_tile(
    tiles_ptr, cu_ptr, cmp_cu_ptr, i, batch, tq, q_start, TPP: tl.constexpr, VARLEN: tl.constexpr
):
    """(b, r0, r_end, t0, kbase) of query tile ``i`` (tiles ordered longest first).

    r0: first row of the tile in q's token axis; r_end: end of its sequence's rows (r_end <= r0
    for a padding entry of the varlen table: the tile has no rows); t0: position of row r0;
    kbase: row of the sequence's block 0 in k_cmp. All int64.
    """
    if VARLEN:
        seq, t0, first, end, kbase = varlen_entry(tiles_ptr, cu_ptr, cmp_cu_ptr, i)
        r0 = first + t0
        r_end = tl.where(seq >= 0, end, r0)
        b = r0 * 0
    else:
        # Later tiles see more blocks: program 0 takes the last tile of each batch row.
        per_b = tl.cdiv(tq, TPP)
        b = (i % batch).to(tl.int64)
        r0 = ((per_b - 1 - i // batch) * TPP).to(tl.int64)
        r_end = r0 * 0 + tq
        t0 = r0 + q_start
        kbase = r0 * 0
    return b, r0, r_end, t0, kbase


@triton.jit
def key_tile(
    tiles_ptr,
    cu_ptr,
    cmp_cu_ptr,
    i,
    batch,
    tq,
    q_start,
    num_blocks,
    BN: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """(b, n0, n_end, kbase, r_lo, r_end, shift) of key tile ``i`` (tiles ordered longest first).

    n0: first block of the tile within its sequence; n_end: blocks of the sequence; kbase: row of
    the sequence's block 0 in k_cmp; [r_lo, r_end): the sequence's query rows; a query at
    position p sits on row ``p + shift``. All int64.
    """
    if VARLEN:
        seq, n0, r_lo, end, kbase = varlen_entry(tiles_ptr, cu_ptr, cmp_cu_ptr, i)
        r_end = tl.where(seq >= 0, end, r_lo)
        kend = tl.load(cmp_cu_ptr + tl.maximum(seq, 0) + 1).to(tl.int64)
        n_end = tl.where(seq >= 0, kend - kbase, 0)
        b = n0 * 0
        shift = r_lo
    else:
        # Earlier tiles are seen by more queries: program 0 takes block tile 0.
        b = (i % batch).to(tl.int64)
        n0 = ((i // batch) * BN).to(tl.int64)
        n_end = n0 * 0 + num_blocks
        kbase = n0 * 0
        r_lo = n0 * 0
        r_end = r_lo + tq
        shift = r_lo - q_start
    return b, n0, n_end, kbase, r_lo, r_end, shift
