"""NSA on a serving cache, in the style of flash-attn's ``flash_attn_with_kvcache``.

One call appends 1..Tn new tokens to each sequence of a batch, in place, where that sequence's
cache ends (``cache_seqlens``, one length per sequence: a ragged batch), and returns the
attention of the Tn new queries over everything their sequence holds. The cache is dense
(``[B, capacity, H, D]``) or paged (``[num_pages, page_size, H, D]`` with a ``block_table`` that
lists each sequence's pages in order), as flash-attn lays them out.

Semantics (docs/spec.md): sequence b holds ``T_b = cache_seqlens[b] + Tn`` tokens after the
append (``cache_seqlens[b]`` without new keys); query row r is position ``T_b - Tn + r``; the
output equals the last Tn rows of a causal NSA prefill of those T_b tokens
(:func:`nsa_core.functional.nsa_func`), block geometry counted from the sequence's first token.

This is the reference: it gathers each sequence's keys and runs the prefill path over them,
recomputing the compressed keys from the raw ones (so the cache holds raw K/V only). A call that
raises leaves the cache as it was: everything is computed first, the new keys written last.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

import torch
from torch import nn

from nsa_core.attention import BRANCHES, NSAAttention, branch_parts
from nsa_core.checks import (
    check_cache_seqlens,
    check_device,
    check_float_dtype,
    check_int,
    check_rank,
    check_same_place,
    shape,
)
from nsa_core.config import NSAConfig
from nsa_core.functional import KV, nsa_func
from nsa_core.limits import MAX_TOKENS
from nsa_core.ops import apply_rope


def nsa_with_kvcache(
    q: torch.Tensor,
    k_cache: KV,
    v_cache: KV,
    k: KV | None = None,
    v: KV | None = None,
    gates: torch.Tensor | None = None,
    *,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None = None,
    config: NSAConfig | None = None,
    softmax_scale: float | None = None,
    window: int | None = None,
    phi_k: nn.Module | None = None,
    phi_v: nn.Module | None = None,
    rope_theta: float | None = None,
) -> torch.Tensor:
    """Append k, v to the cache in place and attend with q over each sequence's tokens.

    Args:
        q: [B, Tn, HQ, dk], Tn >= 1 new queries per sequence (rotated by the caller unless
            ``rope_theta`` is given).
        k_cache, v_cache: [B, capacity, H, dk] and [B, capacity, H, dv]; with ``block_table``,
            pages [num_pages, page_size, H, dk] and [num_pages, page_size, H, dv]. One tensor
            shared by the three branches, or a mapping ``{"cmp": ..., "sel": ..., "win": ...}``
            (NSAAttention projects keys per branch), every tensor of the same layout. Written
            in place at positions ``cache_seqlens[b] .. cache_seqlens[b] + Tn - 1``.
        k, v: [B, Tn, H, dk] and [B, Tn, H, dv], the new tokens' keys and values, shared or per
            branch as the caches are; both None when the cache holds them already (then the
            queries are its last Tn tokens).
        gates: [B, Tn, HQ, 3] in (0, 1), ordered (cmp, sel, win); None weighs each branch 1/3.
        cache_seqlens: integer [B], the tokens each sequence holds before this call.
        block_table: integer [B, max_pages]: sequence b's token p lives in page
            ``block_table[b, p // page_size]``, slot ``p % page_size``. The pages a call reads
            or writes must be distinct across the batch.
        config, softmax_scale, window, phi_k, phi_v: as :func:`nsa_core.functional.nsa_func`.
        rope_theta: rotate q and the new k by their positions ``T_b - Tn + r`` (the cache's
            keys are stored rotated); None when the caller rotated them.

    Returns:
        o [B, Tn, HQ, dv]. ``cache_seqlens`` is not changed: the caller advances it by Tn.
    """
    k_caches, v_caches = branch_parts(k_cache, v_cache, ("k_cache", "v_cache"))
    caches = {"k_cache": k_caches, "v_cache": v_caches}
    new = None
    if k is not None or v is not None:
        if k is None or v is None:
            raise ValueError("k and v go together: give both new keys and values, or neither")
        k_new, v_new = branch_parts(k, v)
        new = {"k": k_new, "v": v_new}
    tn, lengths = _check_call(q, caches, new, cache_seqlens, block_table)
    totals = [n + (tn if new is not None else 0) for n in lengths]
    if rope_theta is not None:
        q, new = _rotate(q, new, totals, rope_theta)
    outputs = []
    for b in range(len(lengths)):
        keys = _sequence(caches["k_cache"], block_table, b, lengths[b])
        values = _sequence(caches["v_cache"], block_table, b, lengths[b])
        if new is not None:
            keys = {br: torch.cat([keys[br], new["k"][br][b : b + 1]], 1) for br in BRANCHES}
            values = {br: torch.cat([values[br], new["v"][br][b : b + 1]], 1) for br in BRANCHES}
        outputs.append(
            nsa_func(
                q[b : b + 1],
                keys,
                values,
                None if gates is None else gates[b : b + 1],
                config=config,
                softmax_scale=softmax_scale,
                window=window,
                phi_k=phi_k,
                phi_v=phi_v,
            )
        )
    dv = caches["v_cache"]["sel"].shape[-1]
    o = torch.cat(outputs, 0) if outputs else q.new_zeros(*q.shape[:3], dv)
    if new is not None:
        for cache, fresh in (("k_cache", "k"), ("v_cache", "v")):
            _write(caches[cache], new[fresh], block_table, lengths)
    return o


def layer_with_kvcache(
    layer: NSAAttention,
    x: torch.Tensor,
    k_cache: Mapping[str, torch.Tensor],
    v_cache: Mapping[str, torch.Tensor],
    cache_seqlens: torch.Tensor,
    *,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """An NSAAttention layer on a serving cache: x [B, Tn, hidden] -> [B, Tn, hidden].

    Sequence b's Tn new tokens sit at RoPE positions ``cache_seqlens[b] + r``; their
    per-branch keys and values are appended to ``k_cache`` and ``v_cache`` in place (mappings
    ``{"cmp", "sel", "win"}`` from :func:`empty_layer_kvcache`, dense or paged with
    ``block_table``), and each output row equals ``layer(x_b)`` over the sequence's tokens so
    far (:func:`nsa_with_kvcache`). A ragged batch decodes in one call; a prompt is a call with
    Tn = its length onto an empty sequence (a chunked prefill: several such calls).
    ``cache_seqlens`` is the caller's to advance by Tn. A call that raises leaves the cache
    unchanged.
    """
    if not isinstance(layer, NSAAttention):
        raise TypeError(f"layer must be an NSAAttention, got {type(layer).__name__}")
    layer.check_input(x)
    lengths = check_cache_seqlens(cache_seqlens, x.shape[0])
    starts = torch.tensor(lengths, dtype=torch.long, device=x.device).view(-1, 1)
    inp = layer.branch_inputs(x, starts + torch.arange(x.shape[1], device=x.device))
    o = nsa_with_kvcache(
        inp.q, k_cache, v_cache, inp.k, inp.v, inp.gates, cache_seqlens=cache_seqlens,
        block_table=block_table, config=layer.config, phi_k=layer.phi_k, phi_v=layer.phi_v,
    )  # fmt: skip
    y: torch.Tensor = layer.o_proj(o.flatten(2))
    return y


def empty_layer_kvcache(
    layer: NSAAttention,
    rows: int,
    row_tokens: int,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Zeroed per-branch caches for :func:`layer_with_kvcache`: ``k_cache[branch] [rows,
    row_tokens, H, dk]`` and ``v_cache[branch] [rows, row_tokens, H, dv]``.

    Dense: rows = B sequences of row_tokens room each. Paged: rows = pages of row_tokens tokens
    each, handed to sequences by a block table. ``dtype`` defaults to the layer's compute dtype
    (``layer.compute_dtype()``), ``device`` to its weights'.
    """
    if not isinstance(layer, NSAAttention):
        raise TypeError(f"layer must be an NSAAttention, got {type(layer).__name__}")
    check_int("rows", rows, 0, MAX_TOKENS)
    check_int("row_tokens", row_tokens, 1, MAX_TOKENS)
    dtype = layer.compute_dtype() if dtype is None else check_float_dtype("dtype", dtype)
    place = check_device("device", device)
    device = layer.q_proj.weight.device if place is None else place
    cfg = layer.config
    h, dk, dv = cfg.num_kv_heads, cfg.head_dim_qk, cfg.head_dim_v

    def zeros(d: int) -> torch.Tensor:
        return torch.zeros(rows, row_tokens, h, d, dtype=dtype, device=device)

    return {b: zeros(dk) for b in BRANCHES}, {b: zeros(dv) for b in BRANCHES}


def _label(name: str, parts: dict[str, torch.Tensor], branch: str) -> str:
    """The tensor's name in errors: ``k_cache``, or ``k_cache['sel']`` where branches differ."""
    shared = all(parts[b] is parts[branch] for b in BRANCHES)
    return name if shared else f"{name}[{branch!r}]"


def _check_call(
    q: torch.Tensor,
    caches: dict[str, dict[str, torch.Tensor]],
    new: dict[str, dict[str, torch.Tensor]] | None,
    cache_seqlens: object,
    block_table: object,
) -> tuple[int, list[int]]:
    """Tn and each sequence's length, after the checks that this module adds to nsa_func's
    (the caches' layout, the lengths against their room, the new keys' shapes, the pages)."""
    check_rank("q", q, 4, "[B, Tn, HQ, dk]")
    batch, tn, hq, dk = q.shape
    if tn < 1:
        raise ValueError(f"q {shape(q)} must hold at least one new query per sequence (Tn >= 1)")
    for name, parts in caches.items():
        d = "dk" if name == "k_cache" else "dv"
        for branch in BRANCHES:
            layout_text = f"[B, capacity, H, {d}] or [num_pages, page_size, H, {d}]"
            check_rank(_label(name, parts, branch), parts[branch], 4, layout_text)
    layout = caches["k_cache"]["sel"]
    for name, parts in caches.items():
        for branch in BRANCHES:
            t, label = parts[branch], _label(name, parts, branch)
            if t.dtype != q.dtype:
                raise TypeError(f"{label} dtype {t.dtype} must be q's, {q.dtype}")
            check_same_place(label, t, "q", q)
            if t.shape[:3] != layout.shape[:3]:
                raise ValueError(
                    f"{label} {shape(t)} must match k_cache {shape(layout)} but for its last dim"
                )
            if name == "k_cache" and t.shape[-1] != dk:
                raise ValueError(f"{label} {shape(t)} must end in q's head dim dk={dk}")
    h = layout.shape[2]
    if h == 0 or hq % h:
        raise ValueError(f"the cache's H={h} kv heads must divide q's HQ={hq} heads")
    lengths = check_cache_seqlens(cache_seqlens, batch)
    if new is not None:
        for name, parts in new.items():
            cache = caches[f"{name}_cache"]
            for branch in BRANCHES:
                t, label = parts[branch], _label(name, parts, branch)
                check_rank(label, t, 4, "[B, Tn, H, D]")
                want = (batch, tn, h, cache[branch].shape[-1])
                if tuple(t.shape) != want:
                    raise ValueError(
                        f"{label} {shape(t)} must be [B={batch}, Tn={tn}, H={h}, D={want[3]}]"
                    )
                if t.dtype != q.dtype:
                    raise TypeError(f"{label} dtype {t.dtype} must be q's, {q.dtype}")
                check_same_place(label, t, "q", q)
            # One cache tensor is written once, so its branches must bring the same new rows.
            for b1, b2 in itertools.combinations(BRANCHES, 2):
                if cache[b1] is cache[b2] and parts[b1] is not parts[b2]:
                    raise ValueError(
                        f"{name}_cache is one tensor for branches {b1} and {b2}, so {name} "
                        "must give them one tensor too"
                    )
    added = tn if new is not None else 0
    if block_table is None:
        if layout.shape[0] != batch:
            raise ValueError(f"k_cache {shape(layout)} must hold B={batch} sequences (dim 0)")
        room = layout.shape[1]
    else:
        tensors = [t for parts in caches.values() for t in parts.values()]
        room = _check_block_table(block_table, layout, tensors, lengths, added)
    for b, n in enumerate(lengths):
        total = n + added
        if total > min(room, MAX_TOKENS):
            raise ValueError(
                f"sequence {b} would hold {total} tokens (cache_seqlens {n} + {added} new), "
                f"more than the cache's {room}"
            )
        if total < tn:
            raise ValueError(
                f"sequence {b} holds {total} tokens, fewer than its Tn={tn} queries: without "
                "new keys the queries are the cache's last Tn tokens"
            )
    return tn, lengths


def _check_block_table(
    block_table: object,
    layout: torch.Tensor,
    tensors: list[torch.Tensor],
    lengths: list[int],
    added: int,
) -> int:
    """The paged cache's room per sequence, after checking that every page a sequence uses is
    listed, exists and belongs to that sequence alone."""
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(
            f"block_table must be an integer torch.Tensor [B, max_pages] or None, got "
            f"{type(block_table).__name__}"
        )
    if block_table.dtype.is_floating_point or block_table.dtype in (torch.bool, torch.complex64):
        raise TypeError(f"block_table must hold integers, got {block_table.dtype}")
    check_rank("block_table", block_table, 2, "[B, max_pages]")
    if block_table.shape[0] != len(lengths):
        raise ValueError(f"block_table {shape(block_table)} must have B={len(lengths)} rows")
    num_pages, page_size = layout.shape[0], layout.shape[1]
    if not all(t.is_contiguous() for t in tensors):
        # Pages are addressed as flat token slots, written through a view of the storage.
        raise ValueError("a paged k_cache and v_cache must be contiguous")
    if page_size < 1:
        raise ValueError(f"k_cache {shape(layout)} has pages of no tokens (page_size = dim 1)")
    table = block_table.tolist()
    owner: dict[int, int] = {}
    for b, n in enumerate(lengths):
        used = min(-(-(n + added) // page_size), block_table.shape[1])
        for slot, page in enumerate(table[b][:used]):
            if not 0 <= page < num_pages:
                raise ValueError(
                    f"block_table[{b}, {slot}] = {page} names no page of the cache's {num_pages}"
                )
            if owner.setdefault(page, b) != b:
                raise ValueError(
                    f"page {page} is listed by sequences {owner[page]} and {b}: a page holds "
                    "one sequence's tokens"
                )
    return int(block_table.shape[1]) * page_size


def _rotate(
    q: torch.Tensor,
    new: dict[str, dict[str, torch.Tensor]] | None,
    totals: list[int],
    theta: float,
) -> tuple[torch.Tensor, dict[str, dict[str, torch.Tensor]] | None]:
    """q and the new keys rotated by each row's position ``T_b - Tn + r`` (a key tensor shared
    by branches rotates once)."""
    tn = q.shape[1]
    positions = torch.stack(
        [torch.arange(t - tn, t, device=q.device) for t in totals]
    ) if totals else torch.zeros(0, tn, dtype=torch.long, device=q.device)  # fmt: skip
    q = apply_rope(q, positions, theta)
    if new is None:
        return q, None
    rotated: dict[int, torch.Tensor] = {}
    for t in new["k"].values():
        if id(t) not in rotated:
            rotated[id(t)] = apply_rope(t, positions, theta)
    keys = {branch: rotated[id(t)] for branch, t in new["k"].items()}
    return q, {"k": keys, "v": new["v"]}


def _slots(block_table: torch.Tensor, b: int, start: int, end: int, page_size: int) -> torch.Tensor:
    """Flat slot ``page * page_size + offset`` of sequence b's tokens [start, end)."""
    pos = torch.arange(start, end, device=block_table.device)
    pages = block_table[b].to(torch.long)[pos // page_size]
    return pages * page_size + pos % page_size


def _sequence(
    cache: dict[str, torch.Tensor], block_table: torch.Tensor | None, b: int, length: int
) -> dict[str, torch.Tensor]:
    """Sequence b's first ``length`` cached tokens per branch, [1, length, H, D] each (a tensor
    shared by branches is gathered once)."""
    gathered: dict[int, torch.Tensor] = {}
    for t in cache.values():
        if id(t) in gathered:
            continue
        if block_table is None:
            gathered[id(t)] = t[b : b + 1, :length]
        else:
            slots = _slots(block_table, b, 0, length, t.shape[1]).to(t.device)
            gathered[id(t)] = t.flatten(0, 1)[slots].unsqueeze(0)
    return {branch: gathered[id(t)] for branch, t in cache.items()}


def _write(
    cache: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    block_table: torch.Tensor | None,
    lengths: list[int],
) -> None:
    """Store each sequence's new tokens after its cached ones, in every distinct cache tensor."""
    written: set[int] = set()
    for branch, t in cache.items():
        if id(t) in written:
            continue
        written.add(id(t))
        fresh = new[branch]
        tn = fresh.shape[1]
        for b, n in enumerate(lengths):
            if block_table is None:
                t[b, n : n + tn] = fresh[b]
            else:
                slots = _slots(block_table, b, n, n + tn, t.shape[1]).to(t.device)
                t.view(-1, *t.shape[2:])[slots] = fresh[b]
