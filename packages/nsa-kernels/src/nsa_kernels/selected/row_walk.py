# Triton kernels take untyped pointer/scalar parameters (types come from the launch), and
# triton.jit is untyped without triton installed: mypy checks only the plain Python here.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""The walk of one query row over its selected blocks, shared by the forward and dq kernels.

Notation (docs/spec.md): a query row at position t of kv head h serves the G query heads of that
group; it attends to the tokens p of its selected blocks (block j covers ``[j*l', (j+1)*l')``)
with ``p <= t``. Softmax runs in base 2: ``qk_scale = scale * log2(e)`` and ``lse`` is stored in
natural log, so ``p = exp2(qk_scale * q.k - lse * log2(e))``.

- :func:`query_row`: which query row a program serves (batch, row, position, first token of its
  sequence), which query heads, and where its block indices start.
- :func:`selected_tile`: step ``it`` of the walk: the keys of one BL-tile of one selected block,
  and which of them the row sees.
- :func:`walk_steps`: how many steps of the walk can hold a key the row sees (forward and dq).
- :func:`walk_between_forced`: the forward's walk where the row's forced blocks come from the
  sliding branch's softmax.
- :func:`query_tokens` and :func:`compact_rows`: the TB consecutive rows a program of the
  forward's forced-block prologue serves (:mod:`nsa_kernels.selected.forced`), and the blocks
  it leaves to the row walk.
"""

# No `from __future__ import annotations`: the triton 3.0/3.1 interpreter reads a string
# annotation as a runtime argument, so `B: tl.constexpr` would stop being a constant.
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# The kernels see these as compile-time constants (plain module floats are not visible to @jit).
LOG2E_CONST = tl.constexpr(LOG2E)
LN2_CONST = tl.constexpr(LN2)


@triton.jit
def query_row(
    blk,
    rr,
    n_rows,
    tq,
    q_start,
    seq_ptr,
    cu_ptr,
    idx_ptr,
    stride_ib,
    stride_it,
    stride_ih,
    G: tl.constexpr,
    HPP: tl.constexpr,
    BG: tl.constexpr,
    RPP: tl.constexpr,
    VARLEN: tl.constexpr,
):
    """(b, r, t, tok0, h, heads [BG], g_mask [BG], idx_row) of row ``rr`` of row block ``blk``
    (int64).

    A row block is RPP consecutive rows of the B * Tq rows: ``blk * RPP + rr`` (clamped to the
    last row, so a block's spare rows redo it; ``blk`` is ``program_id(0)``, or each block a
    strided program walks); ``program_id(1)`` is
    ``h * NCH + chunk`` with NCH = ceil(G / HPP) head chunks of HPP heads each.
    b, r: the row's batch and index along q's T axis; t: its position; tok0: the first token of
    its sequence (varlen, else 0); heads: its query heads, valid where g_mask; idx_row: the
    pointer to ``block_indices[b, r, h, :]`` (strides in elements).
    """
    NCH: tl.constexpr = (G + HPP - 1) // HPP
    pid_h = tl.program_id(1)
    h = pid_h // NCH
    chunk = pid_h - h * NCH
    # int64 before the product; blk may come as a Python int (a strided loop under the
    # interpreter) or as a tensor.
    row = tl.minimum((tl.zeros([], tl.int64) + blk) * RPP + rr, n_rows - 1)
    b, r, t, tok0 = row_position(row, tq, q_start, seq_ptr, cu_ptr, VARLEN=VARLEN)
    offs_g = tl.arange(0, BG)
    g_in = chunk * HPP + offs_g
    g_mask = (offs_g < HPP) & (g_in < G)
    heads = h * G + g_in
    idx_row = idx_ptr + b * stride_ib + r * stride_it + h * stride_ih
    return b, r, t, tok0, h, heads, g_mask, idx_row


@triton.jit
def query_tokens(blk, n_rows, tq, q_start, seq_ptr, cu_ptr, TB: tl.constexpr, VARLEN: tl.constexpr):
    """(b, r, t, tok0, valid), each [TB] int64 (valid: bool), of the TB rows of row block
    ``blk``: rows ``blk * TB + i``, as :func:`query_row` reads one; rows past the last are not
    valid (their fields read those of the last row)."""
    row = (tl.zeros([TB], tl.int64) + blk) * TB + tl.arange(0, TB)
    valid = row < n_rows
    b, r, t, tok0 = row_position(
        tl.minimum(row, n_rows - 1), tq, q_start, seq_ptr, cu_ptr, VARLEN=VARLEN
    )  # fmt: skip
    return b, r, t, tok0, valid


@triton.jit
def row_position(row, tq, q_start, seq_ptr, cu_ptr, VARLEN: tl.constexpr):
    """(b, r, t, tok0) of flat query row(s) ``row`` (int64, a scalar or a block) of the B * Tq
    rows: batch row, index along q's T axis, position, first token of the sequence."""
    if VARLEN:
        # Packed sequences: row indexes T directly; tok0 is the sequence's first token.
        tok0 = tl.load(cu_ptr + tl.load(seq_ptr + row)).to(tl.int64)
        b = row * 0
        r = row
        t = row - tok0
    else:
        b = row // tq
        r = row - b * tq
        t = r + q_start
        tok0 = row * 0
    return b, r, t, tok0


@triton.jit
def selected_tile(idx_row, it, t, SEL: tl.constexpr, BL: tl.constexpr, NSUB: tl.constexpr):
    """(pos [BL], live [BL], first) of step ``it``: tile ``it % NSUB`` of selected block
    ``it // NSUB``.

    pos: the tile's key positions in the sequence; live: the keys the row at position ``t``
    sees (a -1 slot sees none, nor keys past the block or past t); first: pos[0] as a scalar,
    where a whole-tile (TMA) load starts. A -1 slot reads block 0's positions, all dead.
    """
    i = it // NSUB
    j = it - i * NSUB
    blk = tl.load(idx_row + i).to(tl.int32)
    in_blk = j * BL + tl.arange(0, BL)
    first = tl.maximum(blk, 0) * SEL + j * BL
    pos = tl.maximum(blk, 0) * SEL + in_blk
    # blk tested as a block: `scalar_bool & block_bool` comes out int32 under the
    # triton 3.9 interpreter, which then refuses it as a load mask.
    live = (blk + tl.zeros_like(in_blk) >= 0) & (in_blk < SEL) & (pos <= t)
    return pos, live, first


@triton.jit
def walk_steps(
    idx_row, nsel, t, SEL: tl.constexpr, BL: tl.constexpr, NSUB: tl.constexpr, NP: tl.constexpr
):
    """The steps of the walk worth taking for the row at position ``t`` (NP: nsel padded to a
    power of two): every tile of its valid slots but the trailing tiles of its last block that
    start past t.

    An index row as a set (:mod:`nsa_kernels.selected.indices`) holds its blocks ascending, then
    -1; so the -1 slots and the tiles of the last block past t end the walk, and the steps
    before them are the same. Only keys the row cannot see are left out: the causal block's
    tiles past t (half of the rows skip its second half where BL = l'/2).
    """
    slots = tl.arange(0, NP)
    blocks = tl.load(idx_row + slots, mask=slots < nsel, other=-1)
    valid = tl.sum((blocks >= 0).to(tl.int32), axis=0)
    first = tl.max(blocks, axis=0).to(tl.int64) * SEL
    # Tile j of the last block starts at first + j * BL: it holds a key <= t iff j*BL <= t - first.
    seen = tl.where(t >= first, (t - first) // BL + 1, 0)
    return tl.where(valid > 0, (valid - 1) * NSUB + tl.minimum(seen, NSUB), 0)


@triton.jit
def walk_between_forced(idx_row, nsel, t, SEL: tl.constexpr, NSUB: tl.constexpr, NP: tl.constexpr):
    """(first, steps, held) of a walk that leaves the row's forced blocks 0 and
    ``max(jt - 1, 0) .. jt`` (jt = t // SEL) to a softmax computed elsewhere
    (:class:`LocalSoftmax`): steps ``first .. steps - 1`` cover every
    tile of the row's blocks between them, all whole (an ascending set's slots after block 0);
    held: the set holds every forced block, without which that softmax is not the row's."""
    slots = tl.arange(0, NP)
    blocks = tl.load(idx_row + slots, mask=slots < nsel, other=-1)
    jt = t // SEL
    first_local = tl.maximum(jt - 1, 0)
    below = tl.sum(((blocks >= 0) & (blocks < first_local)).to(tl.int32), axis=0)
    local = tl.sum(((blocks >= first_local) & (blocks <= jt)).to(tl.int32), axis=0)
    # Below the local blocks, block 0 is the set's first slot.
    apart = first_local > 0
    has_initial = tl.sum((blocks == 0).to(tl.int32), axis=0) > 0
    held = (local == jt - first_local + 1) & (has_initial | (first_local == 0))
    return tl.where(apart, NSUB, 0), below * NSUB, held


@triton.jit
def compact_rows(x, keep, NP: tl.constexpr):
    """[R, NP]: each row's kept entries of x [R, NP] (keep [R, NP]) in their order, then -1."""
    slots = tl.arange(0, NP)
    # dest[r, e]: kept entries before e in row r, by a sum over a triangle (no scan needed).
    before = (slots[None, :] < slots[:, None]).to(tl.int32)  # [e, e']: e' < e
    dest = tl.sum(keep.to(tl.int32)[:, None, :] * before[None, :, :], axis=2)
    hit = keep[:, :, None] & (dest[:, :, None] == slots[None, None, :])  # [R, e, k]
    picked = tl.sum(tl.where(hit, x[:, :, None] + 1, 0), axis=1)
    return picked - 1
