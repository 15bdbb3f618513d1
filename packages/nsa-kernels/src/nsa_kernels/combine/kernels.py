# Triton kernels take untyped pointer/scalar parameters (types come from the launch), and
# triton.jit is untyped without triton installed: mypy checks only the plain Python here.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""The gated-combine kernels: one pass forward, one pass backward, float32 inside.

A *row* is one (b, t, head) of o [B, T, HQ, dv]; row r = (b * T + t) * HQ + head. A program
takes BR rows and walks their dv channels in chunks of BD (one chunk when dv <= BD). Every
tensor is addressed through its own (b, t, head) strides with unit stride along dv, so the
branch outputs need not be contiguous.

Forward: ``o = g0 * o_cmp + g1 * o_sel + g2 * o_win`` with the gates and branch values read in
float32 and o rounded once to its dtype. Backward, for the upstream ``do``: ``d o_c = g_c * do``
per channel and ``d g_c = sum over dv of do * o_c`` per row, all four in the same pass. Every
product is taken, as in the reference (docs/spec.md, "Non-finite values"): a gate of 0 times a
NaN branch value is NaN. Masked loads (channels past dv, rows past the end) read 0 and are
never stored.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _row_offsets(rows, T, HQ, stride_b, stride_t, stride_h):
    """int64 [BR] offsets of rows r = (b * T + t) * HQ + head in a tensor of these strides."""
    head = rows % HQ
    t = (rows // HQ) % T
    b = rows // (HQ * T)
    return b * stride_b + t * stride_t + head * stride_h


@triton.jit
def _run_row_ptrs(
    first_ptr, second_ptr, rows, T, HQ, s1_b, s1_t, s1_h, s2_b, s2_t, s2_h, start, first_rows
):
    """Pointers [BR] to rows r = (b * T + t) * HQ + head of a tensor held as two runs of rows
    (the first holds ``first_rows`` rows from row ``start``, the second the rest), and whether
    each row lies in a run (rows before ``start`` do not; their pointers must not be read)."""
    head = rows % HQ
    t = (rows // HQ) % T
    b = rows // (HQ * T)
    r1 = t - start
    in_first = r1 < first_rows
    at = tl.where(
        in_first,
        first_ptr + b * s1_b + r1 * s1_t + head * s1_h,
        second_ptr + b * s2_b + (r1 - first_rows) * s2_t + head * s2_h,
    )
    return at, r1 >= 0


@triton.jit
def _load_gates(g_ptr, rows, row_ok, T, HQ, s_g_b, s_g_t, s_g_h, s_g_c):
    """g0, g1, g2 [BR, 1] float32: the three gates of each row (0 on rows past the end)."""
    g_rows = g_ptr + _row_offsets(rows, T, HQ, s_g_b, s_g_t, s_g_h)
    g0 = tl.load(g_rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    g1 = tl.load(g_rows + s_g_c, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    g2 = tl.load(g_rows + 2 * s_g_c, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    return g0, g1, g2


@triton.jit
def _load_chunk(row_ptrs, cols, ok):
    """[BR, BD] float32: channels ``cols`` of the rows at ``row_ptrs`` [BR], 0 where not ok."""
    return tl.load(row_ptrs[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)


@triton.jit
def combine_fwd_kernel(
    cmp_ptr, sel_ptr, win_ptr, g_ptr, o_ptr,
    s_cmp_b, s_cmp_t, s_cmp_h,
    s_sel_b, s_sel_t, s_sel_h,
    s_win_b, s_win_t, s_win_h,
    s_g_b, s_g_t, s_g_h, s_g_c,
    s_o_b, s_o_t, s_o_h,
    n_rows, T, HQ,
    DV: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """o [B, T, HQ, DV] for BR rows: the gated sum of the three branch outputs."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    row_ok = rows < n_rows
    g0, g1, g2 = _load_gates(g_ptr, rows, row_ok, T, HQ, s_g_b, s_g_t, s_g_h, s_g_c)
    cmp_rows = cmp_ptr + _row_offsets(rows, T, HQ, s_cmp_b, s_cmp_t, s_cmp_h)
    sel_rows = sel_ptr + _row_offsets(rows, T, HQ, s_sel_b, s_sel_t, s_sel_h)
    win_rows = win_ptr + _row_offsets(rows, T, HQ, s_win_b, s_win_t, s_win_h)
    o_rows = o_ptr + _row_offsets(rows, T, HQ, s_o_b, s_o_t, s_o_h)
    for d0 in range(0, DV, BD):
        cols = d0 + tl.arange(0, BD)
        ok = row_ok[:, None] & (cols < DV)[None, :]
        a = _load_chunk(cmp_rows, cols, ok)
        b = _load_chunk(sel_rows, cols, ok)
        c = _load_chunk(win_rows, cols, ok)
        o = g0 * a + g1 * b + g2 * c
        tl.store(o_rows[:, None] + cols[None, :], o.to(o_ptr.dtype.element_ty), mask=ok)


@triton.jit
def combine_bwd_kernel(
    do_ptr, cmp_ptr, sel_ptr, win_ptr, g_ptr, dcmp_ptr, dsel_ptr, dwin_ptr, dg_ptr, cmp2_ptr,
    s_do_b, s_do_t, s_do_h,
    s_cmp_b, s_cmp_t, s_cmp_h,
    s_cmp2_b, s_cmp2_t, s_cmp2_h,
    s_sel_b, s_sel_t, s_sel_h,
    s_win_b, s_win_t, s_win_h,
    s_g_b, s_g_t, s_g_h, s_g_c,
    n_rows, T, HQ, cmp_start, cmp_rows,
    DV: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
    WRITE_DO: tl.constexpr, WRITE_DG: tl.constexpr, CMP_RUNS: tl.constexpr,
):  # fmt: skip
    """d o_cmp, d o_sel, d o_win [B, T, HQ, DV] (contiguous) and d gates [B, T, HQ, 3]
    (contiguous) for BR rows. WRITE_DO / WRITE_DG: whether the branch / gate gradients are
    wanted (the others are neither computed nor stored). CMP_RUNS: o_cmp comes as two runs of
    rows (:class:`RowRuns`): rows before ``cmp_start`` read 0, the first run
    (``cmp_ptr``) holds ``cmp_rows`` rows from there, the second (``cmp2_ptr``) the rest."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    row_ok = rows < n_rows
    do_rows = do_ptr + _row_offsets(rows, T, HQ, s_do_b, s_do_t, s_do_h)
    g0, g1, g2 = _load_gates(g_ptr, rows, row_ok, T, HQ, s_g_b, s_g_t, s_g_h, s_g_c)
    cmp_ok = row_ok
    if CMP_RUNS:
        cmp_at, in_runs = _run_row_ptrs(
            cmp_ptr, cmp2_ptr, rows, T, HQ, s_cmp_b, s_cmp_t, s_cmp_h, s_cmp2_b, s_cmp2_t,
            s_cmp2_h, cmp_start, cmp_rows,
        )  # fmt: skip
        cmp_ok = row_ok & in_runs
    else:
        cmp_at = cmp_ptr + _row_offsets(rows, T, HQ, s_cmp_b, s_cmp_t, s_cmp_h)
    sel_rows = sel_ptr + _row_offsets(rows, T, HQ, s_sel_b, s_sel_t, s_sel_h)
    win_rows = win_ptr + _row_offsets(rows, T, HQ, s_win_b, s_win_t, s_win_h)
    out_rows = rows * DV
    dg0 = tl.zeros([BR], dtype=tl.float32)
    dg1 = tl.zeros([BR], dtype=tl.float32)
    dg2 = tl.zeros([BR], dtype=tl.float32)
    for d0 in range(0, DV, BD):
        cols = d0 + tl.arange(0, BD)
        ok = row_ok[:, None] & (cols < DV)[None, :]
        do = _load_chunk(do_rows, cols, ok)
        if WRITE_DO:
            dst = out_rows[:, None] + cols[None, :]
            tl.store(dcmp_ptr + dst, (g0 * do).to(dcmp_ptr.dtype.element_ty), mask=ok)
            tl.store(dsel_ptr + dst, (g1 * do).to(dsel_ptr.dtype.element_ty), mask=ok)
            tl.store(dwin_ptr + dst, (g2 * do).to(dwin_ptr.dtype.element_ty), mask=ok)
        if WRITE_DG:
            a = _load_chunk(cmp_at, cols, ok & cmp_ok[:, None])
            b = _load_chunk(sel_rows, cols, ok)
            c = _load_chunk(win_rows, cols, ok)
            dg0 += tl.sum(do * a, axis=1)
            dg1 += tl.sum(do * b, axis=1)
            dg2 += tl.sum(do * c, axis=1)
    if WRITE_DG:
        dg_rows = dg_ptr + rows * 3
        kind = dg_ptr.dtype.element_ty
        tl.store(dg_rows, dg0.to(kind), mask=row_ok)
        tl.store(dg_rows + 1, dg1.to(kind), mask=row_ok)
        tl.store(dg_rows + 2, dg2.to(kind), mask=row_ok)


@triton.jit
def sum3_kernel(a_ptr, b_ptr, c_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    """out = a + b + c over BLOCK elements of four flat tensors of one dtype (float32 sum, one
    rounding): the three branches' gradients of a shared input, in one pass."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    total = tl.load(a_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    total += tl.load(b_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    total += tl.load(c_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=ok)
