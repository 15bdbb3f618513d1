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

import torch
import triton
import triton.language as tl

from nsa_kernels.decode.state import BlockPhi, DecodeState


@triton.jit
def _put_rows(
    new_ptr, buf_ptr, b, row, rows, put, H: tl.constexpr, HP: tl.constexpr, D: tl.constexpr,
    BD: tl.constexpr,
):  # fmt: skip
    """buf[b, row, :, :] = new[b, :, :] where ``put``; returns the new token [HP, BD]."""
    head = tl.arange(0, HP)[:, None]
    col = tl.arange(0, BD)[None, :]
    inside = (head < H) & (col < D)
    x = tl.load(new_ptr + (b * H + head) * D + col, mask=inside, other=0.0)
    # ``put`` as a block: triton 3.9's interpreter turns scalar & block into int32.
    put_block = (put.to(tl.int32) + tl.zeros_like(head + col)) > 0
    tl.store(buf_ptr + ((b * rows + row) * H + head) * D + col, x, mask=inside & put_block)
    return x


@triton.jit
def _fold_block(
    x,
    raw_ptr,
    cmp_ptr,
    b,
    raw_slot,
    cmp_row,
    cmp_rows,
    emit,
    H: tl.constexpr,
    HP: tl.constexpr,
    D: tl.constexpr,
    BD: tl.constexpr,
    LCMP: tl.constexpr,
    SC: tl.constexpr,
):
    """k_cmp[b, cmp_row] = mean of the block that the new token x [HP, BD] completes, if ``emit``.

    The block's other l - 1 tokens come from the raw ring (SC rows per load, all loads
    independent) and x from registers, so the program never reads back its own store.
    """
    head = tl.arange(0, HP)[None, :, None]
    col = tl.arange(0, BD)[None, None, :]
    inside = (head < H) & (col < D)
    total = x.to(tl.float32)
    for s0 in tl.static_range(0, LCMP, SC):
        slot = s0 + tl.arange(0, SC)[:, None, None]
        ring = tl.load(
            raw_ptr + ((b * LCMP + slot) * H + head) * D + col,
            mask=inside & (slot < LCMP) & (slot != raw_slot) & ((emit.to(tl.int32) + slot * 0) > 0),
            other=0.0,
        )
        total += tl.sum(ring.to(tl.float32), axis=0)
    mean = total / LCMP
    head2 = tl.arange(0, HP)[:, None]
    col2 = tl.arange(0, BD)[None, :]
    tl.store(
        cmp_ptr + ((b * cmp_rows + cmp_row) * H + head2) * D + col2,
        mean.to(cmp_ptr.dtype.element_ty),
        mask=(head2 < H) & (col2 < D) & ((emit.to(tl.int32) + head2 * 0) > 0),
    )


@triton.jit
def append_kernel(
    k_new_slc,
    v_new_slc,
    k_new_win,
    v_new_win,
    k_new_cmp,
    v_new_cmp,
    k_slc,
    v_slc,
    k_win,
    v_win,
    k_raw,
    v_raw,
    k_cmp,
    v_cmp,
    seqlens_ptr,
    num_cmp_ptr,
    overflow_ptr,
    capacity,
    cmp_rows,
    H: tl.constexpr,
    HP: tl.constexpr,
    DK: tl.constexpr,
    BK: tl.constexpr,
    DV: tl.constexpr,
    BV: tl.constexpr,
    WINDOW: tl.constexpr,
    LCMP: tl.constexpr,
    SC: tl.constexpr,
    DSTRIDE: tl.constexpr,
    AVG: tl.constexpr,
):
    """Append the token of sequence ``program_id(0)`` at its position and advance its counters.

    The new token's K/V of each branch (all H heads at once) go to the selected rows (row L),
    the window ring (row L % w) and the raw ring (row L % l). With AVG a block completed by the
    token is folded (the mean) into row ``num_cmp[b]`` of k_cmp/v_cmp; without it (a learned
    phi) only the counter moves and the caller writes the block. A sequence at capacity is left
    as it was and flagged in ``overflow``.
    """
    b = tl.program_id(0).to(tl.int64)
    length = tl.load(seqlens_ptr + b)
    blocks = tl.load(num_cmp_ptr + b)
    room = length < capacity
    pos = tl.where(room, length, 0).to(tl.int64)
    new_len = length + 1
    emit = room & (new_len >= LCMP) & ((new_len - LCMP) % DSTRIDE == 0)
    raw_slot = pos % LCMP
    cmp_row = blocks.to(tl.int64)
    _put_rows(k_new_slc, k_slc, b, pos, capacity, room, H, HP, DK, BK)
    _put_rows(v_new_slc, v_slc, b, pos, capacity, room, H, HP, DV, BV)
    _put_rows(k_new_win, k_win, b, pos % WINDOW, WINDOW, room, H, HP, DK, BK)
    _put_rows(v_new_win, v_win, b, pos % WINDOW, WINDOW, room, H, HP, DV, BV)
    k_x = _put_rows(k_new_cmp, k_raw, b, raw_slot, LCMP, room, H, HP, DK, BK)
    v_x = _put_rows(v_new_cmp, v_raw, b, raw_slot, LCMP, room, H, HP, DV, BV)
    if AVG:
        _fold_block(
            k_x, k_raw, k_cmp, b, raw_slot, cmp_row, cmp_rows, emit, H, HP, DK, BK, LCMP, SC
        )
        _fold_block(
            v_x, v_raw, v_cmp, b, raw_slot, cmp_row, cmp_rows, emit, H, HP, DV, BV, LCMP, SC
        )
    full = tl.load(overflow_ptr + b) | (length >= capacity).to(tl.int32)
    # Every thread has read the counters before any thread overwrites them.
    tl.debug_barrier()
    tl.store(seqlens_ptr + b, tl.where(room, new_len, length))
    tl.store(num_cmp_ptr + b, blocks + emit.to(tl.int32))
    tl.store(overflow_ptr + b, full)


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def append_token(
    state: DecodeState,
    k_new: dict[str, torch.Tensor],
    v_new: dict[str, torch.Tensor],
    *,
    phi_k: BlockPhi | None = None,
    phi_v: BlockPhi | None = None,
) -> None:
    """Append one token per sequence to ``state`` at its own position, on the device.

    Args:
        k_new, v_new: per branch ("cmp", "slc", "win") the new token's keys [B, H, dk] and
            values [B, H, dv], contiguous, in the state's dtype ("cmp": raw, unfolded).
        phi_k, phi_v: a learned phi (``config.phi == "mlp"``): run on the device every step on
            the l newest raw tokens, the result written only where a block completed.
    """
    cfg = state.config
    h, dk, dv = cfg.num_kv_heads, cfg.head_dim_qk, cfg.head_dim_v
    avg = cfg.phi == "avg"
    append_kernel[(state.batch,)](
        k_new["slc"], v_new["slc"], k_new["win"], v_new["win"], k_new["cmp"], v_new["cmp"],
        state.k_slc, state.v_slc, state.k_win, state.v_win, state.k_raw, state.v_raw,
        state.k_cmp, state.v_cmp,
        state.cache_seqlens, state.num_cmp, state.overflow,
        state.capacity, state.k_cmp.shape[1],
        H=h, HP=_pow2(h), DK=dk, BK=_pow2(dk), DV=dv, BV=_pow2(dv),
        WINDOW=cfg.window, LCMP=cfg.cmp_block, SC=min(8, _pow2(cfg.cmp_block)),
        DSTRIDE=cfg.cmp_stride, AVG=avg,
        num_warps=4,
    )  # fmt: skip
    if not avg:
        if phi_k is None or phi_v is None:
            raise ValueError("config.phi == 'mlp' needs phi_k and phi_v")
        _fold_learned(state, state.k_raw, state.k_cmp, phi_k)
        _fold_learned(state, state.v_raw, state.v_cmp, phi_v)


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
