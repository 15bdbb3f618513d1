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

import torch
from torch import nn

from nsa_core.checks import check_int, check_rank, check_same_place, shape
from nsa_core.config import NSAConfig
from nsa_core.functional import nsa_func
from nsa_core.limits import MAX_TOKENS
from nsa_core.ops import apply_rope


def nsa_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
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
            pages [num_pages, page_size, H, dk] and [num_pages, page_size, H, dv]. Written in
            place at positions ``cache_seqlens[b] .. cache_seqlens[b] + Tn - 1``.
        k, v: [B, Tn, H, dk] and [B, Tn, H, dv], the new tokens' keys and values; both None when
            the cache holds them already (then the queries are its last Tn tokens).
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
    tn, lengths = _check_call(q, k_cache, v_cache, k, v, cache_seqlens, block_table)
    totals = [n + (tn if k is not None else 0) for n in lengths]
    if rope_theta is not None:
        q, k = _rotate(q, k, totals, rope_theta)
    outputs = []
    for b, total in enumerate(totals):
        keys, values = _sequence(k_cache, v_cache, block_table, b, lengths[b])
        if k is not None and v is not None:
            keys, values = torch.cat([keys, k[b : b + 1]], 1), torch.cat([values, v[b : b + 1]], 1)
        assert keys.shape[1] == total
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
    o = torch.cat(outputs, 0) if outputs else q.new_zeros(*q.shape[:3], v_cache.shape[-1])
    if k is not None and v is not None:
        _write(k_cache, v_cache, block_table, lengths, k, v)
    return o


def _check_call(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    cache_seqlens: object,
    block_table: object,
) -> tuple[int, list[int]]:
    """Tn and each sequence's length, after the checks that this module adds to nsa_func's
    (the cache's layout, the lengths against its room, the new keys' shapes, the pages)."""
    for name, t, layout in (
        ("q", q, "[B, Tn, HQ, dk]"),
        ("k_cache", k_cache, "[B, capacity, H, dk] or [num_pages, page_size, H, dk]"),
        ("v_cache", v_cache, "[B, capacity, H, dv] or [num_pages, page_size, H, dv]"),
    ):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
        check_rank(name, t, 4, layout)
    batch, tn, hq, dk = q.shape
    if tn < 1:
        raise ValueError(f"q {shape(q)} must hold at least one new query per sequence (Tn >= 1)")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} dtype {t.dtype} must be q's, {q.dtype}")
        check_same_place(name, t, "q", q)
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(
            f"v_cache {shape(v_cache)} must match k_cache {shape(k_cache)} but for its last dim"
        )
    if k_cache.shape[-1] != dk:
        raise ValueError(f"k_cache {shape(k_cache)} must end in q's head dim dk={dk}")
    h = k_cache.shape[2]
    if h == 0 or hq % h:
        raise ValueError(f"the cache's H={h} kv heads must divide q's HQ={hq} heads")
    lengths = _lengths(cache_seqlens, batch)
    if (k is None) != (v is None):
        raise ValueError("k and v go together: give both new keys and values, or neither")
    if k is not None and v is not None:
        for name, t, d in (("k", k, dk), ("v", v, v_cache.shape[-1])):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor [B, Tn, H, D] or None")
            if tuple(t.shape) != (batch, tn, h, d):
                raise ValueError(f"{name} {shape(t)} must be [B={batch}, Tn={tn}, H={h}, D={d}]")
            if t.dtype != q.dtype:
                raise TypeError(f"{name} dtype {t.dtype} must be q's, {q.dtype}")
            check_same_place(name, t, "q", q)
    added = tn if k is not None else 0
    if block_table is None:
        if k_cache.shape[0] != batch:
            raise ValueError(f"k_cache {shape(k_cache)} must hold B={batch} sequences (dim 0)")
        room = k_cache.shape[1]
    else:
        room = _check_block_table(block_table, k_cache, v_cache, lengths, added)
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


def _lengths(cache_seqlens: object, batch: int) -> list[int]:
    """cache_seqlens as host ints, each >= 0."""
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(
            f"cache_seqlens must be an integer torch.Tensor [B], got {type(cache_seqlens).__name__}"
        )
    if cache_seqlens.dtype.is_floating_point or cache_seqlens.dtype.is_complex:
        raise TypeError(f"cache_seqlens must hold integers, got {cache_seqlens.dtype}")
    if cache_seqlens.dtype == torch.bool:
        raise TypeError("cache_seqlens must hold integers, got torch.bool")
    if tuple(cache_seqlens.shape) != (batch,):
        raise ValueError(f"cache_seqlens {shape(cache_seqlens)} must be [B={batch}]")
    lengths = [int(n) for n in cache_seqlens.tolist()]
    for b, n in enumerate(lengths):
        check_int(f"cache_seqlens[{b}]", n, 0, MAX_TOKENS)
    return lengths


def _check_block_table(
    block_table: object,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
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
    num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        # Pages are addressed as flat token slots, written through a view of the storage.
        raise ValueError("a paged k_cache and v_cache must be contiguous")
    if page_size < 1:
        raise ValueError(f"k_cache {shape(k_cache)} has pages of no tokens (page_size = dim 1)")
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
    q: torch.Tensor, k: torch.Tensor | None, totals: list[int], theta: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q and k rotated by each row's position ``T_b - Tn + r``."""
    tn = q.shape[1]
    positions = torch.stack(
        [torch.arange(t - tn, t, device=q.device) for t in totals]
    ) if totals else torch.zeros(0, tn, dtype=torch.long, device=q.device)  # fmt: skip
    q = apply_rope(q, positions, theta)
    return q, None if k is None else apply_rope(k, positions, theta)


def _slots(block_table: torch.Tensor, b: int, start: int, end: int, page_size: int) -> torch.Tensor:
    """Flat slot ``page * page_size + offset`` of sequence b's tokens [start, end)."""
    pos = torch.arange(start, end, device=block_table.device)
    pages = block_table[b].to(torch.long)[pos // page_size]
    return pages * page_size + pos % page_size


def _sequence(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    b: int,
    length: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence b's first ``length`` cached keys and values, [1, length, H, D] each."""
    if block_table is None:
        return k_cache[b : b + 1, :length], v_cache[b : b + 1, :length]
    page_size = k_cache.shape[1]
    slots = _slots(block_table, b, 0, length, page_size).to(k_cache.device)
    keys = k_cache.flatten(0, 1)[slots].unsqueeze(0)
    values = v_cache.flatten(0, 1)[slots].unsqueeze(0)
    return keys, values


def _write(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    lengths: list[int],
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Store each sequence's new keys and values after its cached tokens."""
    tn = k.shape[1]
    for b, n in enumerate(lengths):
        if block_table is None:
            k_cache[b, n : n + tn] = k[b]
            v_cache[b, n : n + tn] = v[b]
            continue
        page_size = k_cache.shape[1]
        slots = _slots(block_table, b, n, n + tn, page_size).to(k_cache.device)
        k_cache.view(-1, *k_cache.shape[2:])[slots] = k[b]
        v_cache.view(-1, *v_cache.shape[2:])[slots] = v[b]
