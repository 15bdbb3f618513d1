# Triton kernels take untyped pointer/scalar parameters (types come from the launch), and
# triton.jit is untyped without triton installed: mypy checks only the plain Python here.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""The gated sum the selected forward can finish with (docs/spec.md, "Output").

``g_cmp * o_cmp + g_slc * o_slc + g_win * o_win`` over float32 values, the combine kernel's
expression, written where o_slc is still in registers: the combine's pass over the three
outputs is saved, and o_slc never goes to memory.
"""

# No `from __future__ import annotations`: the triton 3.0/3.1 interpreter reads a string
# annotation as a runtime argument, so `B: tl.constexpr` would stop being a constant.
import triton
import triton.language as tl


@triton.jit
def gated_rows(o_slc, cmp_rows, win_rows, gate_rows, stride_gc, offs_v, row_ok, v_ok):
    """[R, BV] float32 gated sum for o_slc [R, BV] float32.

    cmp_rows, win_rows [R]: pointers to the rows' first channel in o_cmp and o_win
    [B, Tq, HQ, dv]; gate_rows [R]: to their (cmp) gate in gates [B, Tq, HQ, 3], the next two
    ``stride_gc`` apart; offs_v [BV]: the channels; row_ok [R], v_ok [BV]: the rows and channels
    to read (others read 0). o_cmp and o_win are read once and not again: ``evict_first`` keeps
    K/V in L2 over them.
    """
    ok = row_ok[:, None] & v_ok[None, :]
    o_cmp = tl.load(
        cmp_rows[:, None] + offs_v[None, :], mask=ok, other=0.0, eviction_policy="evict_first"
    ).to(tl.float32)
    o_win = tl.load(
        win_rows[:, None] + offs_v[None, :], mask=ok, other=0.0, eviction_policy="evict_first"
    ).to(tl.float32)
    g_cmp = tl.load(gate_rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    g_slc = tl.load(gate_rows + stride_gc, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    g_win = tl.load(gate_rows + 2 * stride_gc, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    return g_cmp * o_cmp + g_slc * o_slc + g_win * o_win
