# Triton kernels take untyped pointer/scalar parameters (types come from the launch), and
# triton.jit is untyped without triton installed: mypy checks only the plain Python here.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""The cache update of a decode step: append the new token, fold a completed block.

docs/spec.md, "Decode": block i is emitted when the token at ``i*d + l - 1`` arrives. Each
sequence appends at its own position ``cache_seqlens[b]`` (on the device), so nothing here
depends on a host-side length. Every buffer is contiguous ``[B, rows, H, D]`` (DecodeState
allocates them so) and every new-token input contiguous ``[B, H, D]``.
"""

# No `from __future__ import annotations`: the triton 3.0/3.1 interpreter reads a string
# annotation as a runtime argument, so `BG: tl.constexpr` would stop being a constant.

from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from nsa_kernels.common.launch_chain import wait_for_prior_launch
from nsa_kernels.decode.state import BlockPhi, DecodeState


@triton.jit
def _put_row(new_ptr, buf_ptr, b, h, row, rows, put, H: tl.constexpr, D: tl.constexpr,
             BD: tl.constexpr):  # fmt: skip
    """buf[b, row, h, :] = new[b, h, :] where ``put``; returns the new token's row [BD]."""
    return _put_flat_row(new_ptr, buf_ptr, b, h, b * rows + row, put, H, D, BD)


@triton.jit
def _put_flat_row(new_ptr, buf_ptr, b, h, flat_row, put, H: tl.constexpr, D: tl.constexpr,
                  BD: tl.constexpr):  # fmt: skip
    """buf[flat_row, h, :] = new[b, h, :] where ``put`` (buf [rows, H, D] flat); returns the new
    token's row [BD]."""
    col = tl.arange(0, BD)
    inside = col < D
    x = tl.load(new_ptr + (b * H + h) * D + col, mask=inside, other=0.0)
    # ``put`` as a block: triton 3.9's interpreter turns scalar & block into int32.
    put_block = (put.to(tl.int32) + tl.zeros_like(col)) > 0
    tl.store(buf_ptr + (flat_row * H + h) * D + col, x, mask=inside & put_block)
    return x


@triton.jit
def _fold_block(
    x,
    raw_ptr,
    cmp_ptr,
    b,
    h,
    raw_slot,
    cmp_row,
    cmp_rows,
    emit,
    H: tl.constexpr,
    D: tl.constexpr,
    BD: tl.constexpr,
    LCMP: tl.constexpr,
    BL: tl.constexpr,
):
    """cmp[b, cmp_row, h] = mean of the block that the new token x [BD] completes, if ``emit``.

    The block's other l - 1 tokens come from the raw ring in one load and x from registers, so
    the program never reads back its own store.
    """
    slot = tl.arange(0, BL)[:, None]
    col = tl.arange(0, BD)[None, :]
    emit_block = (emit.to(tl.int32) + slot * 0) > 0
    ring = tl.load(
        raw_ptr + ((b * LCMP + slot) * H + h) * D + col,
        mask=(col < D) & (slot < LCMP) & (slot != raw_slot) & emit_block,
        other=0.0,
    )
    mean = (x.to(tl.float32) + tl.sum(ring.to(tl.float32), axis=0)) / LCMP
    col1 = tl.arange(0, BD)
    tl.store(
        cmp_ptr + ((b * cmp_rows + cmp_row) * H + h) * D + col1,
        mean.to(cmp_ptr.dtype.element_ty),
        mask=(col1 < D) & ((emit.to(tl.int32) + col1 * 0) > 0),
    )


@triton.jit
def _append_kv(
    new_sel, new_win, new_raw, sel, win, raw, cmp, b, h, pos, room, raw_slot, cmp_row, cmp_rows,
    emit, sel_row, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, WINDOW: tl.constexpr,
    LCMP: tl.constexpr, BL: tl.constexpr, AVG: tl.constexpr,
):  # fmt: skip
    """One head's keys (or values) of the new token into the three caches (the selected one at
    its flat row ``sel_row``), the block folded."""
    _put_flat_row(new_sel, sel, b, h, sel_row, room, H, D, BD)
    _put_row(new_win, win, b, h, pos % WINDOW, WINDOW, room, H, D, BD)
    x = _put_row(new_raw, raw, b, h, raw_slot, LCMP, room, H, D, BD)
    if AVG:
        _fold_block(x, raw, cmp, b, h, raw_slot, cmp_row, cmp_rows, emit, H, D, BD, LCMP, BL)


@triton.jit
def append_kernel(
    k_new_sel,
    v_new_sel,
    k_new_win,
    v_new_win,
    k_new_cmp,
    v_new_cmp,
    k_sel,
    v_sel,
    k_win,
    v_win,
    k_raw,
    v_raw,
    k_cmp,
    v_cmp,
    seqlens_ptr,
    num_cmp_ptr,
    overflow_ptr,
    tickets_ptr,
    block_table_ptr,
    pages_per_seq,
    capacity,
    cmp_rows,
    PAGE: tl.constexpr,
    H: tl.constexpr,
    DK: tl.constexpr,
    BK: tl.constexpr,
    DV: tl.constexpr,
    BV: tl.constexpr,
    WINDOW: tl.constexpr,
    LCMP: tl.constexpr,
    BL: tl.constexpr,
    DSTRIDE: tl.constexpr,
    AVG: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Append the token of sequence b = ``program_id(0) // H``, kv head h, keys (axis 1 = 0) or
    values (1), at the sequence's position; the sequence's last program advances its counters.

    The new token goes to the selected rows (row L), the window ring (row L % w) and the raw
    ring (row L % l). With AVG a block completed by the token is folded (the mean) into row
    ``num_cmp[b]`` of k_cmp/v_cmp; without it (a learned phi) only the counter moves and the
    caller writes the block. A sequence at capacity is left as it was and flagged in
    ``overflow``. With PAGE > 0 the selected rows are pages (``block_table [B, pages_per_seq]``,
    PAGE tokens a page), and a position without a page is a sequence at capacity.

    The 2H programs of a sequence each read its counters first, then take a ticket
    (``tickets[b]``, an acq_rel atomic): the program that takes the last one knows every other
    has read them, writes the new counters and resets the ticket. One program per sequence, as
    before, left most of the GPU idle at small batches (the whole step is latency-bound there).
    """
    wait_for_prior_launch(PDL)
    pid = tl.program_id(0).to(tl.int64)
    b = pid // H
    h = pid % H
    kind = tl.program_id(1)
    length = tl.load(seqlens_ptr + b)
    blocks = tl.load(num_cmp_ptr + b)
    room = length < capacity
    pos = tl.where(room, length, 0).to(tl.int64)
    if PAGE > 0:
        page = tl.load(
            block_table_ptr + b * pages_per_seq + pos // PAGE,
            mask=room & (pos // PAGE < pages_per_seq),
            other=-1,
        )
        room = room & (page >= 0)
        pos = tl.where(room, pos, 0)
        sel_row = tl.maximum(page, 0).to(tl.int64) * PAGE + pos % PAGE
    else:
        sel_row = b * capacity + pos
    new_len = length + 1
    emit = room & (new_len >= LCMP) & ((new_len - LCMP) % DSTRIDE == 0)
    raw_slot = pos % LCMP
    cmp_row = blocks.to(tl.int64)
    if kind == 0:
        _append_kv(
            k_new_sel, k_new_win, k_new_cmp, k_sel, k_win, k_raw, k_cmp, b, h, pos, room,
            raw_slot, cmp_row, cmp_rows, emit, sel_row, H, DK, BK, WINDOW, LCMP, BL, AVG,
        )  # fmt: skip
    else:
        _append_kv(
            v_new_sel, v_new_win, v_new_cmp, v_sel, v_win, v_raw, v_cmp, b, h, pos, room,
            raw_slot, cmp_row, cmp_rows, emit, sel_row, H, DV, BV, WINDOW, LCMP, BL, AVG,
        )  # fmt: skip
    full = tl.load(overflow_ptr + b) | tl.where(room, 0, 1)
    # Every thread of this program has read the counters before its ticket is taken.
    tl.debug_barrier()
    ticket = tl.atomic_add(tickets_ptr + b, 1, sem="acq_rel")
    last = ticket == 2 * H - 1
    tl.store(seqlens_ptr + b, tl.where(room, new_len, length), mask=last)
    tl.store(num_cmp_ptr + b, blocks + emit.to(tl.int32), mask=last)
    tl.store(overflow_ptr + b, full, mask=last)
    tl.store(tickets_ptr + b, 0, mask=last)


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def append_token(
    state: DecodeState,
    k_new: dict[str, torch.Tensor],
    v_new: dict[str, torch.Tensor],
    tickets: torch.Tensor,
    *,
    phi_k: BlockPhi | None = None,
    phi_v: BlockPhi | None = None,
    chain: Mapping[str, bool] | None = None,
) -> None:
    """Append one token per sequence to ``state`` at its own position, on the device.

    Args:
        k_new, v_new: per branch ("cmp", "sel", "win") the new token's keys [B, H, dk] and
            values [B, H, dv], contiguous, in the state's dtype ("cmp": raw, unfolded).
        tickets: int32 [B], zeros between steps (the kernel leaves them so): the count of a
            sequence's programs that have read its counters (see ``append_kernel``).
        phi_k, phi_v: a learned phi (``config.phi == "mlp"``): run on the device every step on
            the l newest raw tokens, the result written only where a block completed.
        chain: the launch's PDL keywords, the first of a step's chain (DecodePlan.chain).
    """
    cfg = state.config
    h, dk, dv = cfg.num_kv_heads, cfg.head_dim_qk, cfg.head_dim_v
    avg = cfg.phi == "avg"
    if tickets.shape != (state.batch,) or tickets.dtype != torch.int32:
        raise ValueError(f"tickets must be int32 [B={state.batch}], got {tuple(tickets.shape)}")
    append_kernel[(state.batch * h, 2)](
        k_new["sel"], v_new["sel"], k_new["win"], v_new["win"], k_new["cmp"], v_new["cmp"],
        state.k_sel, state.v_sel, state.k_win, state.v_win, state.k_raw, state.v_raw,
        state.k_cmp, state.v_cmp,
        state.cache_seqlens, state.num_cmp, state.overflow, tickets,
        *page_args(state), state.capacity, state.k_cmp.shape[1],
        PAGE=page_size(state), H=h, DK=dk, BK=_pow2(dk), DV=dv, BV=_pow2(dv),
        WINDOW=cfg.window, LCMP=cfg.cmp_block, BL=_pow2(cfg.cmp_block),
        DSTRIDE=cfg.cmp_stride, AVG=avg,
        num_warps=4, **(chain or {}),
    )  # fmt: skip
    if not avg:
        if phi_k is None or phi_v is None:
            raise ValueError("config.phi == 'mlp' needs phi_k and phi_v")
        _fold_learned(state, state.k_raw, state.k_cmp, phi_k)
        _fold_learned(state, state.v_raw, state.v_cmp, phi_v)


def page_args(state: DecodeState) -> tuple[torch.Tensor, int]:
    """(block_table, pages per sequence) of a paged state's kernels; a dense state's kernels
    read neither (PAGE = 0) and get the lengths as a stand-in pointer."""
    if state.pages is None:
        return state.cache_seqlens, 0
    return state.pages.block_table, state.pages.block_table.shape[1]


def page_size(state: DecodeState) -> int:
    """The kernels' PAGE: tokens a page, or 0 for a dense state."""
    return 0 if state.pages is None else state.pages.page_size


def _fold_learned(
    state: DecodeState, raw: torch.Tensor, blocks: torch.Tensor, phi: BlockPhi
) -> None:
    """blocks[b, num_cmp[b] - 1] = phi(the l newest raw tokens of b) where b's block completed.

    Runs every step with fixed shapes and a device-side condition (no host sync), so it can be
    captured in a CUDA graph. The append kernel has already moved the counters.
    """
    cfg = state.config
    batch, lcmp = state.batch, cfg.cmp_block
    length = state.cache_seqlens.to(torch.int64)
    emit = (length >= lcmp) & ((length - lcmp) % cfg.cmp_stride == 0)
    # Token L - l + r of the completed block sits in ring row (L - l + r) % l = (L + r) % l.
    rows = (length[:, None] + torch.arange(lcmp, device=raw.device)) % lcmp  # [B, l]
    index = rows[:, :, None, None].expand(batch, lcmp, raw.shape[2], raw.shape[3])
    block = raw.gather(1, index).permute(0, 2, 1, 3)  # [B, H, l, D]
    with torch.no_grad():
        folded = phi(block).to(blocks.dtype)  # [B, H, D]
    seq = torch.arange(batch, device=raw.device)
    row = (state.num_cmp.to(torch.int64) - 1).clamp(0, blocks.shape[1] - 1)
    blocks[seq, row] = torch.where(emit[:, None, None], folded, blocks[seq, row])
