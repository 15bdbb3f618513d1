# Triton kernels take untyped pointer/scalar parameters (types come from the launch), and
# triton.jit is untyped without triton installed: mypy checks only the plain Python here.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""The selected forward's prologue: the forced blocks of TB query rows at a time.

Every NSA index row holds its forced blocks F_t = {0, jt-1, jt} (docs/spec.md, "Choosing
blocks"; jt = t // l'), and the TB consecutive rows of one query block share them. The row kernel
(:mod:`nsa_kernels.selected.forward`) serves one row a program and loads each selected K/V tile
for that row alone: its time is the L2 traffic of those loads. ``sel_forced_kernel`` serves TB
rows x G heads of one kv head in one program and walks each candidate forced block once for all
of them (rows that did not select it, or whose own forced set lacks it, mask it out): the
partial softmax of every row over ``F_t ∩ I_t`` (I_t its index row as a set) goes out as
``o_part`` (normalised, q's dtype) and ``lse_part``, and the rest of the row, ``I_t \\ F_t``
ascending then -1, as ``rest``. The row kernel then walks ``rest`` from that partial state
(``m = lse_part``, ``l = 1``, ``acc = o_part``), which is the same softmax over the same keys.

Rows of a program in another sequence than its first row hand all their blocks to the row kernel
(``rest`` = the whole row). Values must be finite: a key that one row of the program sees and
another does not meets that row's weight 0, and 0 x NaN is NaN; so the prologue runs on the
row kernel's V_TMA launch's condition (the finite flag) and returns at once otherwise, where the
other launch walks the original rows.
"""

# No `from __future__ import annotations`: the triton 3.0/3.1 interpreter reads a string
# annotation as a runtime argument, so `B: tl.constexpr` would stop being a constant.
import triton
import triton.language as tl

from nsa_kernels.common.online_softmax import online_softmax_step
from nsa_kernels.selected.row_walk import LN2_CONST, compact_rows, query_tokens


@triton.jit
def _rows_of(x, BG: tl.constexpr):
    """[TB * BG]: each of the TB token values of x [TB] repeated for its BG rows."""
    return tl.reshape(tl.broadcast_to(x[:, None], (x.shape[0], BG)), (x.shape[0] * BG,))


@triton.jit
def sel_forced_kernel(
    q_ptr, k_ptr, v_ptr, idx_ptr, seq_ptr, cu_ptr, finite_ptr, o_ptr, lse_ptr, rest_ptr,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lt,
    stride_ib, stride_it, stride_ih,
    n_rows, tq, q_start, nsel, qk_scale,
    G: tl.constexpr, BG: tl.constexpr, TB: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    SEL: tl.constexpr, BL: tl.constexpr, NSUB: tl.constexpr, NP: tl.constexpr,
    VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """o_part [TB, G, dv], lse_part [TB, G] and rest [TB, n] of TB query rows of kv head
    ``program_id(1)``: rows ``program_id(0) * TB + i``.

    q [B, Tq, HQ, dk], k [B, Tk, H, dk], v [B, Tk, H, dv], idx and rest [B, Tq, H, n] (index
    rows as sets; rest at idx's strides), o_part [B, Tq, HQ, dv] (o's strides), lse_part
    [B, Tq, HQ] float32; finite [1] int32 (0: return at once). Rows of the dots: token i, head
    g at ``i * BG + g`` (BG: G padded to a power of two, TB * BG >= 16). dk = DK and dv = DV are
    powers of two.
    """
    if tl.load(finite_ptr) == 0:
        return
    h = tl.program_id(1)
    b, r, t, tok0, valid = query_tokens(
        tl.program_id(0), n_rows, tq, q_start, seq_ptr, cu_ptr, TB=TB, VARLEN=VARLEN
    )  # fmt: skip
    tok = tl.arange(0, TB)
    slots = tl.arange(0, NP)
    # Only rows in the first row's sequence share its tiles.
    b0 = tl.sum(tl.where(tok == 0, b, 0), axis=0)
    tok00 = tl.sum(tl.where(tok == 0, tok0, 0), axis=0)
    shares = valid & (b == b0) & (tok0 == tok00)

    idx_rows = (b * stride_ib + r * stride_it + h * stride_ih)[:, None] + slots[None, :]
    slot_ok = valid[:, None] & (slots < nsel)[None, :]
    blocks = tl.load(idx_ptr + idx_rows, mask=slot_ok, other=-1)
    jt = (t // SEL).to(tl.int32)
    forced = (blocks == 0) | (blocks == jt[:, None] - 1) | (blocks == jt[:, None])
    here = forced & (blocks >= 0) & shares[:, None]
    rest = compact_rows(blocks, (blocks >= 0) & (here == 0), NP=NP)
    tl.store(rest_ptr + idx_rows, rest, mask=slot_ok)

    # Rows: token i, head g.
    R: tl.constexpr = TB * BG
    g = tl.arange(0, R) % BG
    head = h * G + g
    row_ok = _rows_of(valid.to(tl.int32), BG) != 0
    row_ok = row_ok & (g < G)
    b_row, r_row = _rows_of(b, BG), _rows_of(r, BG)
    t_row = tl.where(row_ok, _rows_of(t, BG), -1)
    offs_k = tl.arange(0, DK)
    offs_v = tl.arange(0, DV)
    q = tl.load(
        q_ptr + (b_row * stride_qb + r_row * stride_qt + head * stride_qh)[:, None]
        + offs_k[None, :],
        mask=row_ok[:, None], other=0.0,
    )  # fmt: skip
    m_i = tl.full([R], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([R], dtype=tl.float32)
    acc = tl.zeros([R, DV], dtype=tl.float32)
    k_seq = k_ptr + b0 * stride_kb + tok00 * stride_kt + h * stride_kh
    v_seq = v_ptr + b0 * stride_vb + tok00 * stride_vt + h * stride_vh
    t_max = tl.max(tl.where(shares, t, -1), axis=0)
    jt0 = tl.sum(tl.where(tok == 0, jt, 0), axis=0)
    # The forced blocks of TB <= l' consecutive rows lie in {0, jt0 - 1, jt0, jt0 + 1}: each
    # candidate once (c == 0 stands for the first; a smaller jt0 repeats a candidate).
    for ci in tl.static_range(4):
        c = jt0 * 0 if ci == 0 else jt0 + (ci - 2)
        # [TB]: which rows walk block c here.
        takes = tl.max((here & (blocks == c)).to(tl.int32), axis=1) != 0
        go = tl.max(takes.to(tl.int32), axis=0) != 0
        if ci > 0:
            go = go & (c >= 1)
        if go:
            takes_row = (_rows_of(takes.to(tl.int32), BG) != 0) & row_ok
            for j in range(NSUB):
                pos = c * SEL + j * BL + tl.arange(0, BL)
                in_blk = j * BL + tl.arange(0, BL) < SEL
                load_ok = in_blk & (pos <= t_max)
                kt = tl.load(
                    k_seq + pos.to(tl.int64)[:, None] * stride_kt + offs_k[None, :],
                    mask=load_ok[:, None], other=0.0,
                )  # fmt: skip
                s = tl.dot(q, tl.trans(kt), input_precision=DOT_PREC)
                live = takes_row[:, None] & load_ok[None, :] & (pos[None, :] <= t_row[:, None])
                s = tl.where(live, s * qk_scale, float("-inf"))
                m_new, alpha, p, l_i = online_softmax_step(m_i, l_i, s)
                vt = tl.load(
                    v_seq + pos.to(tl.int64)[:, None] * stride_vt + offs_v[None, :],
                    mask=load_ok[:, None], other=0.0,
                )  # fmt: skip
                acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PREC)
                m_i = m_new

    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    o_rows = b_row * stride_ob + r_row * stride_ot + head * stride_oh
    tl.store(
        o_ptr + o_rows[:, None] + offs_v[None, :], o.to(o_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )  # fmt: skip
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2_CONST, float("-inf"))
    tl.store(lse_ptr + b_row * stride_lb + r_row * stride_lt + head, lse, mask=row_ok)
