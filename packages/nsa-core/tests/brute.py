"""A float64 brute force of NSA, written line by line from docs/spec.md.

Every function loops over sequences, tokens and heads in Python and does only small vector math
per (token, head), so each line can be read against the spec. It never calls nsa_core: the tests
compare the vectorized reference with this file, and the two are written independently.

Conventions:
- positions are 0-based; a query row r sits at position ``t = q_start + r``;
- head h of the HQ query heads belongs to group (kv head) ``g = h // G`` with ``G = HQ / H``;
- varlen inputs have B == 1 and int32 ``cu_seqlens``; every sequence is run on its own, with
  positions and block indices starting at 0, and its compressed blocks packed after the previous
  sequence's blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:  # annotations only: the brute force never calls nsa_core
    from nsa_core import NSAAttention

F64 = torch.float64

# ---------------------------------------------------------------------------------------------
# Geometry


def n_cmp(length: int, l_cmp: int, d: int) -> int:
    """N_cmp(L): complete compression blocks [i*d, i*d + l) inside a prefix of L tokens."""
    return 0 if length < l_cmp else (length - l_cmp) // d + 1


def n_sel(length: int, l_sel: int) -> int:
    """Selection blocks [j*l', (j+1)*l') holding at least one of L tokens."""
    return -(-length // l_sel)


def overlap(i: int, j: int, l_cmp: int, d: int, l_sel: int) -> float:
    """c[i, j] = |[i*d, i*d + l) ∩ [j*l', (j+1)*l')| / d."""
    lo = max(i * d, j * l_sel)
    hi = min(i * d + l_cmp, (j + 1) * l_sel)
    return max(0, hi - lo) / d


def sequences(cu_seqlens: Tensor | None, total: int) -> list[tuple[int, int]]:
    """[(start, end)] of each packed sequence; one sequence [0, total) when not varlen."""
    if cu_seqlens is None:
        return [(0, total)]
    cu = [int(c) for c in cu_seqlens]
    return [(cu[s], cu[s + 1]) for s in range(len(cu) - 1)]


def _f64(x: Tensor) -> Tensor:
    return x.detach().to(F64)


# ---------------------------------------------------------------------------------------------
# phi: one block [l, D] -> one vector [D]


def gelu(z: Tensor) -> Tensor:
    """Exact GELU: z * Phi(z)."""
    return 0.5 * z * (1.0 + torch.erf(z / math.sqrt(2.0)))


def phi_avg(block: Tensor) -> Tensor:
    """Mean of the l token vectors of a block [l, D]."""
    total = torch.zeros(block.shape[1], dtype=F64)
    for p in range(block.shape[0]):
        total = total + block[p]
    return total / block.shape[0]


class PhiMLP:
    """phi mlp from a CompressMLP's parameters: pos [l, D], fc1 (l*D -> D), GELU, fc2 (D -> D)."""

    def __init__(self, module: torch.nn.Module) -> None:
        params = {name: _f64(p) for name, p in module.named_parameters()}
        self.pos = params["pos"]
        self.w1, self.b1 = params["fc1.weight"], params["fc1.bias"]
        self.w2, self.b2 = params["fc2.weight"], params["fc2.bias"]

    def __call__(self, block: Tensor) -> Tensor:
        l_cmp, dim = block.shape
        flat = torch.zeros(l_cmp * dim, dtype=F64)
        for p in range(l_cmp):
            # token-major flattening: element p*D + c is token p, channel c
            flat[p * dim : (p + 1) * dim] = block[p] + self.pos[p]
        hidden = gelu(self.w1 @ flat + self.b1)
        return self.w2 @ hidden + self.b2


Phi = Callable[[Tensor], Tensor]


def compress_sequence(x: Tensor, l_cmp: int, d: int, phi: Phi = phi_avg) -> Tensor:
    """x [T, H, D] -> [N_cmp(T), H, D]; block i covers tokens [i*d, i*d + l), per head."""
    length, heads, dim = x.shape
    out = torch.zeros(n_cmp(length, l_cmp, d), heads, dim, dtype=F64)
    for i in range(out.shape[0]):
        for g in range(heads):
            out[i, g] = phi(x[i * d : i * d + l_cmp, g])
    return out


def compress(
    x: Tensor, l_cmp: int, d: int, phi: Phi = phi_avg, cu_seqlens: Tensor | None = None
) -> Tensor:
    """x [B, T, H, D] -> [B, N, H, D]; varlen: each sequence's blocks packed in order."""
    x = _f64(x)
    rows = []
    for b in range(x.shape[0]):
        parts = [
            compress_sequence(x[b, s:e], l_cmp, d, phi)
            for s, e in sequences(cu_seqlens, x.shape[1])
        ]
        rows.append(torch.cat(parts, dim=0))
    return torch.stack(rows)


def cmp_offsets(cu_seqlens: Tensor | None, total: int, l_cmp: int, d: int) -> list[int]:
    """Where each sequence's compressed blocks start in the packed k_cmp, plus the end."""
    offsets = [0]
    for s, e in sequences(cu_seqlens, total):
        offsets.append(offsets[-1] + n_cmp(e - s, l_cmp, d))
    return offsets


# ---------------------------------------------------------------------------------------------
# Attention of one query over a list of keys


def attend(q: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
    """One softmax of q [dk] over keys [m, dk] with values [m, dv]; 0 (never NaN) when m == 0."""
    if keys.shape[0] == 0:
        return torch.zeros(values.shape[1], dtype=F64)
    logits = scale * (keys @ q)
    weights = torch.exp(logits - logits.max())
    return (weights / weights.sum()) @ values


def _scale(scale: float | None, dk: int) -> float:
    return dk**-0.5 if scale is None else scale


# ---------------------------------------------------------------------------------------------
# Compressed branch and selection scores, one sequence


def dot(a: Sequence[float], b: Sequence[float]) -> float:
    """a . b, correctly rounded: equal vectors give bit-equal results wherever they sit."""
    return math.fsum(x * y for x, y in zip(a, b, strict=True))


def p_cmp(
    q: Sequence[float], k_cmp: Sequence[Sequence[float]], t: int, l_cmp: int, d: int, scale: float
) -> list[float]:
    """softmax_i(scale * q . K~[i]) over the blocks visible at t (i*d + l - 1 <= t).

    q [dk] and k_cmp [N, dk] as Python lists. Scalar math on purpose: blocks with equal keys get
    bit-equal probabilities, so exact ties in the scores stay exact and the tie rule decides them.
    """
    logits = [scale * dot(q, k_cmp[i]) for i in range(len(k_cmp)) if i * d + l_cmp - 1 <= t]
    if not logits:
        return []
    top = max(logits)
    weights = [math.exp(z - top) for z in logits]
    total = math.fsum(weights)
    return [w / total for w in weights]


def compressed_sequence(
    q: Tensor, k_cmp: Tensor, v_cmp: Tensor, l_cmp: int, d: int, scale: float, q_start: int
) -> Tensor:
    """q [Tq, HQ, dk], k_cmp [N, H, dk], v_cmp [N, H, dv] -> o [Tq, HQ, dv]."""
    tq, hq, _ = q.shape
    group = hq // k_cmp.shape[1]
    dv = v_cmp.shape[2]
    queries, keys = q.tolist(), k_cmp.transpose(0, 1).tolist()  # keys[g][i]
    out = torch.zeros(tq, hq, dv, dtype=F64)
    for r in range(tq):
        t = q_start + r
        for h in range(hq):
            g = h // group
            probs = p_cmp(queries[r][h], keys[g], t, l_cmp, d, scale)
            for i, p in enumerate(probs):  # visible blocks are exactly 0 .. len(probs) - 1
                out[r, h] += p * v_cmp[i, g]
    return out


def scores_sequence(
    q: Tensor, k_cmp: Tensor, l_cmp: int, d: int, l_sel: int, scale: float, q_start: int
) -> Tensor:
    """S [Tq, H, Nsel]: s[t,h,j] = sum_i c[i,j] p_cmp[t,h,i], summed over the G heads of a group."""
    tq, hq, _ = q.shape
    heads = k_cmp.shape[1]
    group = hq // heads
    num_sel = n_sel(q_start + tq, l_sel)
    c = [[overlap(i, j, l_cmp, d, l_sel) for j in range(num_sel)] for i in range(k_cmp.shape[0])]
    queries, keys = q.tolist(), k_cmp.transpose(0, 1).tolist()
    out = []
    for r in range(tq):
        t = q_start + r
        row = []
        for g in range(heads):
            big_s = [0.0] * num_sel
            for h in range(g * group, (g + 1) * group):
                probs = p_cmp(queries[r][h], keys[g], t, l_cmp, d, scale)
                for j in range(num_sel):
                    big_s[j] += sum(c[i][j] * p for i, p in enumerate(probs))
            row.append(big_s)
        out.append(row)
    return torch.tensor(out, dtype=F64).reshape(tq, heads, num_sel)


# ---------------------------------------------------------------------------------------------
# Choosing blocks


def forced_blocks(t: int, l_sel: int) -> set[int]:
    """The valid members of {0, t // l', t // l' - 1}."""
    jt = t // l_sel
    return {j for j in (0, jt, jt - 1) if 0 <= j <= jt}


def ranked_candidates(scores: Sequence[float], t: int, l_sel: int) -> list[int]:
    """Valid (j*l' <= t), non-forced blocks, best score first, ties to the lower j."""
    forced = forced_blocks(t, l_sel)
    valid = [j for j in range(len(scores)) if j * l_sel <= t]
    return sorted((j for j in valid if j not in forced), key=lambda j: (-scores[j], j))


def choose_blocks(scores: Sequence[float], t: int, l_sel: int, n: int) -> list[int]:
    """Ascending block indices for the query at t: forced blocks, then the best others."""
    forced = forced_blocks(t, l_sel)
    others = ranked_candidates(scores, t, l_sel)[: n - len(forced)]
    return sorted(forced | set(others))


def choice_margin(scores: Sequence[float], t: int, l_sel: int, n: int) -> float:
    """Score gap between the last chosen and the first rejected candidate (inf if none rejected).

    A rounding error smaller than this gap cannot change the choice.
    """
    ranked = ranked_candidates(scores, t, l_sel)
    slots = n - len(forced_blocks(t, l_sel))
    if slots >= len(ranked):
        return math.inf
    if slots == 0:
        return math.inf
    return scores[ranked[slots - 1]] - scores[ranked[slots]]


def topn_blocks(scores: Tensor, n: int, l_sel: int, q_start: int = 0) -> tuple[Tensor, Tensor]:
    """scores [B, Tq, H, Nsel] -> indices [B, Tq, H, n] (ascending, -1 padded), counts."""
    bsz, tq, heads, _ = scores.shape
    indices = torch.full((bsz, tq, heads, n), -1, dtype=torch.int64)
    counts = torch.zeros(bsz, tq, heads, dtype=torch.int64)
    for b in range(bsz):
        for r in range(tq):
            for g in range(heads):
                chosen = choose_blocks(scores[b, r, g].tolist(), q_start + r, l_sel, n)
                indices[b, r, g, : len(chosen)] = torch.tensor(chosen, dtype=torch.int64)
                counts[b, r, g] = len(chosen)
    return indices, counts


# ---------------------------------------------------------------------------------------------
# Selected and sliding branches, one sequence


def selected_sequence(
    q: Tensor, k: Tensor, v: Tensor, chosen: Tensor, l_sel: int, scale: float, q_start: int
) -> Tensor:
    """One softmax over the tokens p <= t of the blocks in chosen[r, g] (-1 is padding)."""
    tq, hq, _ = q.shape
    group = hq // k.shape[1]
    chosen_lists = chosen.tolist()
    out = torch.zeros(tq, hq, v.shape[2], dtype=F64)
    for r in range(tq):
        t = q_start + r
        for h in range(hq):
            g = h // group
            blocks = {j for j in chosen_lists[r][g] if j >= 0}
            tokens = torch.tensor(
                [p for p in range(t + 1) if p // l_sel in blocks], dtype=torch.long
            )
            out[r, h] = attend(q[r, h], k[tokens, g], v[tokens, g], scale)
    return out


def sliding_sequence(q: Tensor, k: Tensor, v: Tensor, w: int, scale: float, q_start: int) -> Tensor:
    """Query t attends to tokens [max(0, t - w + 1), t]."""
    tq, hq, _ = q.shape
    group = hq // k.shape[1]
    out = torch.zeros(tq, hq, v.shape[2], dtype=F64)
    for r in range(tq):
        t = q_start + r
        for h in range(hq):
            g = h // group
            tokens = slice(max(0, t - w + 1), t + 1)
            out[r, h] = attend(q[r, h], k[tokens, g], v[tokens, g], scale)
    return out


# ---------------------------------------------------------------------------------------------
# Batched / varlen wrappers with the public ops' signatures


def compressed_attention(
    q: Tensor,
    k_cmp: Tensor,
    v_cmp: Tensor,
    l_cmp: int,
    d: int,
    scale: float | None = None,
    *,
    q_start: int = 0,
    cu_seqlens: Tensor | None = None,
) -> Tensor:
    """q [B, Tq, HQ, dk], k_cmp [B, N, H, dk], v_cmp [B, N, H, dv] -> o [B, Tq, HQ, dv]."""
    q, k_cmp, v_cmp = _f64(q), _f64(k_cmp), _f64(v_cmp)
    sc = _scale(scale, q.shape[-1])
    out = torch.zeros(*q.shape[:3], v_cmp.shape[-1], dtype=F64)
    offsets = cmp_offsets(cu_seqlens, q.shape[1], l_cmp, d)
    for b in range(q.shape[0]):
        for s, (start, end) in enumerate(sequences(cu_seqlens, q.shape[1])):
            blocks = slice(offsets[s], offsets[s + 1]) if cu_seqlens is not None else slice(None)
            out[b, start:end] = compressed_sequence(
                q[b, start:end], k_cmp[b, blocks], v_cmp[b, blocks], l_cmp, d, sc, q_start
            )
    return out


def block_scores(
    q: Tensor,
    k_cmp: Tensor,
    l_cmp: int,
    d: int,
    l_sel: int,
    scale: float | None = None,
    *,
    q_start: int = 0,
) -> Tensor:
    """S [B, Tq, H, ceil((q_start + Tq) / l'))]."""
    q, k_cmp = _f64(q), _f64(k_cmp)
    sc = _scale(scale, q.shape[-1])
    return torch.stack(
        [scores_sequence(q[b], k_cmp[b], l_cmp, d, l_sel, sc, q_start) for b in range(q.shape[0])]
    )


def select_blocks(
    q: Tensor,
    k_cmp: Tensor,
    l_cmp: int,
    d: int,
    l_sel: int,
    n: int,
    scale: float | None = None,
    *,
    q_start: int = 0,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """indices [B, Tq, H, n], counts [B, Tq, H] and each choice's margin [B, Tq, H] (float64)."""
    q, k_cmp = _f64(q), _f64(k_cmp)
    sc = _scale(scale, q.shape[-1])
    bsz, tq, _, _ = q.shape
    heads = k_cmp.shape[2]
    indices = torch.full((bsz, tq, heads, n), -1, dtype=torch.int64)
    counts = torch.zeros(bsz, tq, heads, dtype=torch.int64)
    margins = torch.zeros(bsz, tq, heads, dtype=F64)
    offsets = cmp_offsets(cu_seqlens, tq, l_cmp, d)
    for b in range(bsz):
        for s, (start, end) in enumerate(sequences(cu_seqlens, tq)):
            blocks = slice(offsets[s], offsets[s + 1]) if cu_seqlens is not None else slice(None)
            scores = scores_sequence(
                q[b, start:end], k_cmp[b, blocks], l_cmp, d, l_sel, sc, q_start
            )
            for r in range(end - start):
                t = q_start + r
                for g in range(heads):
                    row = scores[r, g].tolist()
                    chosen = choose_blocks(row, t, l_sel, n)
                    indices[b, start + r, g, : len(chosen)] = torch.tensor(chosen)
                    counts[b, start + r, g] = len(chosen)
                    margins[b, start + r, g] = choice_margin(row, t, l_sel, n)
    return indices, counts, margins


SequenceAttention = Callable[[Tensor, Tensor, Tensor, int, slice, float], Tensor]


def per_sequence(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float | None,
    cu_seqlens: Tensor | None,
    attend: SequenceAttention,
) -> Tensor:
    """q [B, Tq, HQ, dk], k [B, Tk, H, dk], v [B, Tk, H, dv] -> o [B, Tq, HQ, dv] float64.

    ``attend(q_seq, k_seq, v_seq, b, rows, scale)`` gives the rows of batch entry b and one
    sequence (``rows`` of q; packed sequences see only their own keys, a dense one all of them).
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    sc = _scale(scale, q.shape[-1])
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=F64)
    for b in range(q.shape[0]):
        for start, end in sequences(cu_seqlens, q.shape[1]):
            rows = slice(start, end)
            keys = rows if cu_seqlens is not None else slice(None)
            out[b, rows] = attend(q[b, rows], k[b, keys], v[b, keys], b, rows, sc)
    return out


def selected_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    block_indices: Tensor,
    l_sel: int,
    scale: float | None = None,
    *,
    q_start: int = 0,
    cu_seqlens: Tensor | None = None,
) -> Tensor:
    """q [B, Tq, HQ, dk], k [B, Tk, H, dk], v [B, Tk, H, dv], indices [B, Tq, H, n] -> o."""

    def attend(qs: Tensor, ks: Tensor, vs: Tensor, b: int, rows: slice, sc: float) -> Tensor:
        return selected_sequence(qs, ks, vs, block_indices[b, rows], l_sel, sc, q_start)

    return per_sequence(q, k, v, scale, cu_seqlens, attend)


def sliding_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    w: int,
    scale: float | None = None,
    *,
    q_start: int = 0,
    cu_seqlens: Tensor | None = None,
) -> Tensor:
    """q [B, Tq, HQ, dk], k [B, Tk, H, dk], v [B, Tk, H, dv] -> o [B, Tq, HQ, dv]."""

    def attend(qs: Tensor, ks: Tensor, vs: Tensor, b: int, rows: slice, sc: float) -> Tensor:
        return sliding_sequence(qs, ks, vs, w, sc, q_start)

    return per_sequence(q, k, v, scale, cu_seqlens, attend)


def gated_combine(o_cmp: Tensor, o_sel: Tensor, o_win: Tensor, gates: Tensor) -> Tensor:
    """o[t,h] = g[t,h,0] o_cmp + g[t,h,1] o_sel + g[t,h,2] o_win."""
    o_cmp, o_sel, o_win, gates = _f64(o_cmp), _f64(o_sel), _f64(o_win), _f64(gates)
    out = torch.zeros_like(o_cmp)
    bsz, length, hq, _ = o_cmp.shape
    for b in range(bsz):
        for t in range(length):
            for h in range(hq):
                g = gates[b, t, h]
                out[b, t, h] = g[0] * o_cmp[b, t, h] + g[1] * o_sel[b, t, h] + g[2] * o_win[b, t, h]
    return out


def rope_vector(x: Tensor, position: int, theta: float) -> Tensor:
    """Rotate channel pairs (c, c + D/2) of x [D] by position * theta^(-2c/D)."""
    dim = x.shape[0]
    half = dim // 2
    xs = x.tolist()
    out = [0.0] * dim
    for c in range(half):
        angle = position * theta ** (-2.0 * c / dim)
        cos, sin = math.cos(angle), math.sin(angle)
        out[c] = xs[c] * cos - xs[c + half] * sin
        out[c + half] = xs[c] * sin + xs[c + half] * cos
    return torch.tensor(out, dtype=F64)


def apply_rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """x [B, T, H, D], positions [T] or [B, T] -> rotated x."""
    x = _f64(x)
    bsz, length, heads, _ = x.shape
    pos = positions.expand(bsz, length) if positions.dim() == 1 else positions
    out = torch.zeros_like(x)
    for b in range(bsz):
        for t in range(length):
            for h in range(heads):
                out[b, t, h] = rope_vector(x[b, t, h], int(pos[b, t]), theta)
    return out


# ---------------------------------------------------------------------------------------------
# The whole NSAAttention layer from its parameters

BRANCHES = ("cmp", "sel", "win")


def _linear(params: dict[str, Tensor], name: str, x: Tensor) -> Tensor:
    """y = W x (+ b) for one token vector."""
    y = params[f"{name}.weight"] @ x
    bias = params.get(f"{name}.bias")
    return y if bias is None else y + bias


def sigmoid(z: Tensor) -> Tensor:
    return 1.0 / (1.0 + torch.exp(-z))


def layer_inputs(module: NSAAttention, x: Tensor) -> dict[str, Tensor]:
    """One sequence x [T, hidden] -> q [T, HQ, dk], k_c/v_c [T, H, d*], gates [T, HQ, 3].

    q and every branch's keys are rotated by their position in the sequence; values are not.
    """
    cfg = module.config
    hq, heads, dk, dv = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim_qk, cfg.head_dim_v
    params = {name: _f64(p) for name, p in module.named_parameters()}
    length = x.shape[0]
    out = {
        "q": torch.zeros(length, hq, dk, dtype=F64),
        "gates": torch.zeros(length, hq, 3, dtype=F64),
    }
    for c in BRANCHES:
        out[f"k_{c}"] = torch.zeros(length, heads, dk, dtype=F64)
        out[f"v_{c}"] = torch.zeros(length, heads, dv, dtype=F64)
    for t in range(length):
        q = _linear(params, "q_proj", x[t]).reshape(hq, dk)
        for h in range(hq):
            out["q"][t, h] = rope_vector(q[h], t, cfg.rope_theta)
        for c in BRANCHES:
            k = _linear(params, f"k_proj.{c}", x[t]).reshape(heads, dk)
            v = _linear(params, f"v_proj.{c}", x[t]).reshape(heads, dv)
            for g in range(heads):
                out[f"k_{c}"][t, g] = rope_vector(k[g], t, cfg.rope_theta)
                out[f"v_{c}"][t, g] = v[g]
        hidden = gelu(_linear(params, "gate.0", x[t]))
        out["gates"][t] = sigmoid(_linear(params, "gate.2", hidden)).reshape(hq, 3)
    return out


def layer_phis(module: NSAAttention) -> tuple[Phi, Phi]:
    """phi for keys and for values: the mean, or the layer's own phi_k / phi_v MLPs."""
    if module.config.phi == "avg":
        return phi_avg, phi_avg
    assert module.phi_k is not None
    assert module.phi_v is not None
    return PhiMLP(module.phi_k), PhiMLP(module.phi_v)


def layer_sequence(module: NSAAttention, x: Tensor) -> Tensor:
    """NSAAttention over one sequence x [T, hidden] (positions 0 .. T-1) -> [T, hidden]."""
    cfg = module.config
    l_cmp, d, l_sel = cfg.cmp_block, cfg.cmp_stride, cfg.sel_block
    n, w = cfg.num_selected, cfg.window
    hq, dv = cfg.num_q_heads, cfg.head_dim_v
    scale = _scale(cfg.scale, cfg.head_dim_qk)
    params = {name: _f64(p) for name, p in module.named_parameters()}
    inp = layer_inputs(module, x)
    phi_k, phi_v = layer_phis(module)
    k_cmp = compress_sequence(inp["k_cmp"], l_cmp, d, phi_k)
    v_cmp = compress_sequence(inp["v_cmp"], l_cmp, d, phi_v)

    q = inp["q"]
    o_cmp = compressed_sequence(q, k_cmp, v_cmp, l_cmp, d, scale, 0)
    scores = scores_sequence(q, k_cmp, l_cmp, d, l_sel, scale, 0)
    length, heads = x.shape[0], cfg.num_kv_heads
    chosen = torch.full((length, heads, n), -1, dtype=torch.int64)
    for t in range(length):
        for g in range(heads):
            picked = choose_blocks(scores[t, g].tolist(), t, l_sel, n)
            chosen[t, g, : len(picked)] = torch.tensor(picked, dtype=torch.int64)
    o_sel = selected_sequence(q, inp["k_sel"], inp["v_sel"], chosen, l_sel, scale, 0)
    o_win = sliding_sequence(q, inp["k_win"], inp["v_win"], w, scale, 0)

    y = torch.zeros(length, x.shape[1], dtype=F64)
    for t in range(length):
        o = torch.zeros(hq, dv, dtype=F64)
        for h in range(hq):
            gate = inp["gates"][t, h]
            o[h] = gate[0] * o_cmp[t, h] + gate[1] * o_sel[t, h] + gate[2] * o_win[t, h]
        y[t] = _linear(params, "o_proj", o.reshape(hq * dv))
    return y


def layer_selection_margin(module: NSAAttention, x: Tensor) -> float:
    """Smallest choice margin over all (t, group) of one sequence x [T, hidden]."""
    cfg = module.config
    inp = layer_inputs(module, x)
    phi_k, _ = layer_phis(module)
    k_cmp = compress_sequence(inp["k_cmp"], cfg.cmp_block, cfg.cmp_stride, phi_k)
    scale = _scale(cfg.scale, cfg.head_dim_qk)
    scores = scores_sequence(
        inp["q"], k_cmp, cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, scale, 0
    )
    return min(
        (
            choice_margin(scores[t, g].tolist(), t, cfg.sel_block, cfg.num_selected)
            for t in range(x.shape[0])
            for g in range(cfg.num_kv_heads)
        ),
        default=math.inf,
    )


def nsa_forward(module: NSAAttention, x: Tensor, cu_seqlens: Tensor | None = None) -> Tensor:
    """x [B, T, hidden] (varlen: B == 1 and cu_seqlens) -> [B, T, hidden], in float64."""
    x = _f64(x)
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        for start, end in sequences(cu_seqlens, x.shape[1]):
            if end > start:
                out[b, start:end] = layer_sequence(module, x[b, start:end])
    return out


def rel_err(out: Tensor, ref: Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (0 when both are zero)."""
    out, ref = _f64(out), _f64(ref)
    num = float(torch.linalg.vector_norm(out - ref))
    den = float(torch.linalg.vector_norm(ref))
    if den == 0.0:
        return num
    return num / den


# Relative-error bounds of docs/spec.md: a float32 path and a float64 path against this file.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def assert_matches(out: Tensor, ref: Tensor, dtype: torch.dtype, what: str = "output") -> None:
    """out (computed in ``dtype``) equals the float64 brute force ``ref`` within the bound."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert out.dtype == dtype, f"{what}: dtype {out.dtype}, expected {dtype}"
    err = rel_err(out, ref)
    assert err <= TOLERANCE[dtype], f"{what}: relative error {err:.3e} > {TOLERANCE[dtype]:.0e}"
