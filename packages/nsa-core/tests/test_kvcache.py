"""nsa_with_kvcache: NSA on a serving cache (ragged lengths, 1..Tn new tokens, pages).

Every sequence of a batch decodes as its own prefill would: the call's Tn outputs are the last
Tn rows of a causal NSA prefill (nsa_func over all its queries) of the tokens the sequence
holds after the append, whatever the other sequences hold. A dense and a paged cache give the
same bits; a call that raises leaves the cache as it was.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nsa_core import CompressMLP, NSAAttention, NSAConfig, apply_rope, nsa_func, nsa_with_kvcache
from nsa_core.kvcache import empty_layer_kvcache, layer_with_kvcache

# HQ = 4 over H = 2, dk = 16, dv = 8, l = 8, d = 4, l' = 8, n = 3, w = 16.
CFG = NSAConfig(
    num_q_heads=4, num_kv_heads=2, head_dim_qk=16, head_dim_v=8, cmp_block=8, cmp_stride=4,
    sel_block=8, num_selected=3, window=16,
)  # fmt: skip
HQ, H, DK, DV = 4, 2, 16, 8
ROOM = 64  # tokens a sequence's cache can hold
PAGE = 8
# float64 runs of the same math whose sums are grouped differently (Tn queries against all of
# them): rounding of float64 only.
FLOAT64_TOL = 1e-10


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).detach().norm() / ref.detach().norm())


class Sequences:
    """The whole token streams of B sequences: q, k, v and gates [1, ROOM, ...] each."""

    def __init__(self, batch: int, gen: torch.Generator) -> None:
        def draw(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen, dtype=torch.float64)

        self.q = [draw(1, ROOM, HQ, DK) for _ in range(batch)]
        self.k = [draw(1, ROOM, H, DK) for _ in range(batch)]
        self.v = [draw(1, ROOM, H, DV) for _ in range(batch)]
        self.gates = [torch.sigmoid(draw(1, ROOM, HQ, 3)) for _ in range(batch)]

    def new(self, name: str, lengths: list[int], tn: int) -> torch.Tensor:
        """Tokens [L_b, L_b + Tn) of every sequence, stacked [B, Tn, ...]."""
        rows = getattr(self, name)
        return torch.cat([rows[b][:, n : n + tn] for b, n in enumerate(lengths)])

    def append(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: list[int], tn: int, **kw: Any
    ) -> torch.Tensor:
        """nsa_with_kvcache on every sequence's tokens [L_b, L_b + Tn): their q, k, v and gates,
        ``cache_seqlens`` L_b; ``kw`` adds or replaces keyword arguments."""
        args: dict[str, Any] = {
            "gates": self.new("gates", lengths, tn),
            "cache_seqlens": torch.tensor(lengths),
            "config": CFG,
        }
        k, v = self.new("k", lengths, tn), self.new("v", lengths, tn)
        return nsa_with_kvcache(self.new("q", lengths, tn), k_cache, v_cache, k, v, **args | kw)

    def prefill(self, b: int, total: int, tn: int, **kw: object) -> torch.Tensor:
        """The last Tn rows of sequence b's causal prefill over its first ``total`` tokens."""
        q, k, v, g = (t[b][:, :total] for t in (self.q, self.k, self.v, self.gates))
        return nsa_func(q, k, v, g, config=CFG, **kw)[:, total - tn :]  # type: ignore[arg-type]


def dense_cache(seqs: Sequences, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, ROOM, H, D] caches holding each sequence's first L_b tokens, zeros after."""
    k = torch.zeros(len(lengths), ROOM, H, DK, dtype=torch.float64)
    v = torch.zeros(len(lengths), ROOM, H, DV, dtype=torch.float64)
    for b, n in enumerate(lengths):
        k[b, :n], v[b, :n] = seqs.k[b][0, :n], seqs.v[b][0, :n]
    return k, v


def paged(
    k: torch.Tensor, v: torch.Tensor, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The dense caches' tokens in shuffled pages of PAGE tokens: pages [B * ROOM / PAGE, PAGE,
    H, D] and block_table [B, ROOM / PAGE]."""
    batch, per_row = k.shape[0], ROOM // PAGE
    order = torch.randperm(batch * per_row, generator=gen)
    table = order.view(batch, per_row).to(torch.int32)
    k_pages = torch.empty(batch * per_row, PAGE, H, DK, dtype=k.dtype)
    v_pages = torch.empty(batch * per_row, PAGE, H, DV, dtype=v.dtype)
    k_pages[order] = k.reshape(batch * per_row, PAGE, H, DK)
    v_pages[order] = v.reshape(batch * per_row, PAGE, H, DV)
    return k_pages, v_pages, table


def unpaged(pages: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """[B, ROOM, H, D] of the pages in each row's table order."""
    return pages[table.long()].flatten(1, 2)


@pytest.mark.parametrize("tn", [1, 3])
def test_a_ragged_batch_decodes_as_each_sequence_prefills(gen: torch.Generator, tn: int) -> None:
    """Lengths 0, 5, 37 and 8 (a compressed block and a selection block just complete) in one
    call: each sequence's outputs are its own prefill's, and the cache holds the new tokens."""
    lengths = [0, 5, 37, 8]
    seqs = Sequences(len(lengths), gen)
    k_cache, v_cache = dense_cache(seqs, lengths)
    o = seqs.append(k_cache, v_cache, lengths, tn, cache_seqlens=torch.tensor(lengths).int())
    assert o.shape == (len(lengths), tn, HQ, DV)
    for b, n in enumerate(lengths):
        assert rel_err(o[b : b + 1], seqs.prefill(b, n + tn, tn)) < FLOAT64_TOL
    after, _ = dense_cache(seqs, [n + tn for n in lengths])
    assert torch.equal(k_cache, after)


def test_a_paged_cache_gives_the_dense_caches_bits(gen: torch.Generator) -> None:
    lengths, tn = [13, 0, 40], 2
    seqs = Sequences(len(lengths), gen)
    k_dense, v_dense = dense_cache(seqs, lengths)
    k_pages, v_pages, table = paged(k_dense, v_dense, gen)
    args = (seqs.new("q", lengths, tn),)
    new = (seqs.new("k", lengths, tn), seqs.new("v", lengths, tn), seqs.new("gates", lengths, tn))
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    o_dense = nsa_with_kvcache(*args, k_dense, v_dense, *new, cache_seqlens=seqlens, config=CFG)
    o_paged = nsa_with_kvcache(
        *args, k_pages, v_pages, *new, cache_seqlens=seqlens, block_table=table, config=CFG
    )
    assert torch.equal(o_paged, o_dense)
    assert torch.equal(unpaged(k_pages, table), k_dense)
    assert torch.equal(unpaged(v_pages, table), v_dense)


def test_decoding_step_by_step_onto_a_prefilled_chunk_equals_prefill(
    gen: torch.Generator,
) -> None:
    """A chunk of 9 tokens onto empty paged caches (a chunked prefill), then steps of 1 or 2
    tokens to 40: every call's outputs equal each sequence's prefill."""
    seqs = Sequences(2, gen)
    k_pages, v_pages, table = paged(*dense_cache(seqs, [0, 0]), gen)
    lengths = [0, 0]
    tn = 9
    while lengths[0] + tn <= 40:
        o = seqs.append(k_pages, v_pages, lengths, tn, block_table=table)
        lengths = [n + tn for n in lengths]
        for b, total in enumerate(lengths):
            assert rel_err(o[b : b + 1], seqs.prefill(b, total, tn)) < FLOAT64_TOL, total
        tn = 1 if tn != 1 else 2


def test_without_new_keys_the_queries_are_the_cached_last_tokens(gen: torch.Generator) -> None:
    lengths, tn = [12, 30], 3
    seqs = Sequences(len(lengths), gen)
    k_cache, v_cache = dense_cache(seqs, lengths)
    before = k_cache.clone()
    starts = [n - tn for n in lengths]
    o = nsa_with_kvcache(
        seqs.new("q", starts, tn),
        k_cache,
        v_cache,
        gates=seqs.new("gates", starts, tn),
        cache_seqlens=torch.tensor(lengths),
        config=CFG,
    )
    for b, n in enumerate(lengths):
        assert rel_err(o[b : b + 1], seqs.prefill(b, n, tn)) < FLOAT64_TOL
    assert torch.equal(k_cache, before)


def test_rope_positions_come_from_the_cache_lengths(gen: torch.Generator) -> None:
    """With rope_theta, q and the new keys rotate at positions L_b .. L_b + Tn - 1 and the cache
    stores the rotated keys: the prefill of the rotated streams, sequence by sequence."""
    theta = 500.0
    lengths, tn = [0, 21], 2
    seqs = Sequences(len(lengths), gen)
    rotated = Sequences(len(lengths), gen)
    for b in range(len(lengths)):
        positions = torch.arange(ROOM)
        rotated.q[b] = apply_rope(seqs.q[b], positions, theta)
        rotated.k[b] = apply_rope(seqs.k[b], positions, theta)
        rotated.v[b], rotated.gates[b] = seqs.v[b], seqs.gates[b]
    k_cache, v_cache = dense_cache(rotated, lengths)  # the cached keys were stored rotated
    o = seqs.append(k_cache, v_cache, lengths, tn, rope_theta=theta)
    for b, n in enumerate(lengths):
        assert rel_err(o[b : b + 1], rotated.prefill(b, n + tn, tn)) < FLOAT64_TOL
    after, _ = dense_cache(rotated, [n + tn for n in lengths])
    assert rel_err(k_cache, after) < FLOAT64_TOL


def test_learned_compression_takes_the_cached_keys(gen: torch.Generator) -> None:
    torch.manual_seed(3)
    phi_k = CompressMLP(DK, CFG.cmp_block).double()
    phi_v = CompressMLP(DV, CFG.cmp_block).double()
    lengths, tn = [17, 33], 1
    seqs = Sequences(len(lengths), gen)
    k_cache, v_cache = dense_cache(seqs, lengths)
    o = seqs.append(k_cache, v_cache, lengths, tn, phi_k=phi_k, phi_v=phi_v)
    for b, n in enumerate(lengths):
        ref = seqs.prefill(b, n + tn, tn, phi_k=phi_k, phi_v=phi_v)
        assert rel_err(o[b : b + 1], ref) < FLOAT64_TOL


class Failing(torch.nn.Module):
    """A compression that fails once the checks have passed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("compression failed")


@pytest.mark.parametrize(
    "failure", ["a page of two sequences", "a full cache", "gates of 2 branches", "phi raises"]
)
def test_a_failed_call_leaves_the_cache_unchanged(gen: torch.Generator, failure: str) -> None:
    lengths, tn = [6, 20], 2
    seqs = Sequences(len(lengths), gen)
    k_pages, v_pages, table = paged(*dense_cache(seqs, lengths), gen)
    before = (k_pages.clone(), v_pages.clone())
    gates = seqs.new("gates", lengths, tn)
    seqlens = torch.tensor(lengths)
    kwargs: dict[str, Any] = {}
    error: type[Exception] = ValueError
    if failure == "a page of two sequences":
        table[1, 0] = table[0, 0]
    elif failure == "a full cache":
        seqlens = torch.tensor([6, ROOM - 1])
    elif failure == "gates of 2 branches":
        gates = gates[..., :2]
    else:
        kwargs = {"phi_k": Failing(), "phi_v": Failing()}
        error = RuntimeError
    with pytest.raises(error):
        seqs.append(
            k_pages, v_pages, lengths, tn, gates=gates, cache_seqlens=seqlens, block_table=table,
            **kwargs,
        )  # fmt: skip
    assert torch.equal(k_pages, before[0])
    assert torch.equal(v_pages, before[1])


# ------------------------------------------------------------ an NSAAttention layer on the cache

HIDDEN = 32


def test_per_branch_caches_take_per_branch_keys(gen: torch.Generator) -> None:
    """Mappings of caches and new keys per branch equal nsa_func on those mappings."""
    lengths, tn = [9, 26], 2
    streams = {branch: Sequences(len(lengths), gen) for branch in ("cmp", "sel", "win")}
    seqs = streams["sel"]
    k_cache, v_cache, k_new, v_new = {}, {}, {}, {}
    for branch, s in streams.items():
        k_cache[branch], v_cache[branch] = dense_cache(s, lengths)
        k_new[branch], v_new[branch] = s.new("k", lengths, tn), s.new("v", lengths, tn)
    o = nsa_with_kvcache(
        seqs.new("q", lengths, tn),
        k_cache,
        v_cache,
        k_new,
        v_new,
        seqs.new("gates", lengths, tn),
        cache_seqlens=torch.tensor(lengths),
        config=CFG,
    )
    for b, n in enumerate(lengths):
        total = n + tn
        keys = {br: s.k[b][:, :total] for br, s in streams.items()}
        values = {br: s.v[b][:, :total] for br, s in streams.items()}
        ref = nsa_func(seqs.q[b][:, :total], keys, values, seqs.gates[b][:, :total], config=CFG)[
            :, -tn:
        ]
        assert rel_err(o[b : b + 1], ref) < FLOAT64_TOL
    for branch, s in streams.items():
        assert torch.equal(k_cache[branch], dense_cache(s, [n + tn for n in lengths])[0])


def test_the_layer_prefills_in_chunks_and_decodes_a_ragged_paged_batch(
    gen: torch.Generator,
) -> None:
    """Sequences of 23 and 7 tokens prefilled onto shared pages (the first in two chunks), then
    steps of 1 and 2 tokens for both at once: every output row equals NSAAttention.forward over
    that sequence's tokens so far."""
    torch.manual_seed(5)
    layer = NSAAttention(CFG, HIDDEN).double()
    x = [torch.randn(1, ROOM, HIDDEN, generator=gen, dtype=torch.float64) for _ in range(2)]
    pages = 2 * ROOM // PAGE
    k_cache, v_cache = empty_layer_kvcache(layer, pages, PAGE)
    assert k_cache["sel"].dtype == torch.float64
    table = torch.randperm(pages, generator=gen).view(2, ROOM // PAGE).to(torch.int32)

    def check(b: int, out: torch.Tensor, total: int) -> None:
        ref = layer(x[b][:, :total])[:, total - out.shape[1] :]
        assert rel_err(out, ref) < FLOAT64_TOL, (b, total)

    lengths = [0, 0]
    for b, chunks in ((0, [15, 8]), (1, [7])):
        for tn in chunks:
            n = lengths[b]
            seqlens = torch.tensor([n])
            out = layer_with_kvcache(
                layer, x[b][:, n : n + tn], k_cache, v_cache, seqlens, block_table=table[b : b + 1]
            )
            lengths[b] += tn
            check(b, out, lengths[b])
    for tn in (1, 2, 1):
        step = torch.cat([x[b][:, n : n + tn] for b, n in enumerate(lengths)])
        out = layer_with_kvcache(
            layer, step, k_cache, v_cache, torch.tensor(lengths), block_table=table
        )
        lengths = [n + tn for n in lengths]
        for b in range(2):
            check(b, out[b : b + 1], lengths[b])


def test_the_layer_refuses_a_bad_call_before_touching_the_cache() -> None:
    layer = NSAAttention(CFG, HIDDEN).double()
    k_cache, v_cache = empty_layer_kvcache(layer, 2, 16)
    x = torch.randn(2, 1, HIDDEN, dtype=torch.float64)
    with pytest.raises(TypeError, match="cache_seqlens must hold integers"):
        layer_with_kvcache(layer, x, k_cache, v_cache, torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="would hold 17 tokens"):
        layer_with_kvcache(layer, x, k_cache, v_cache, torch.tensor([3, 16]))
    f32 = empty_layer_kvcache(layer, 2, 16, dtype=torch.float32)
    with pytest.raises(TypeError, match=r"dtype torch\.float32 must be q's, torch\.float64"):
        layer_with_kvcache(layer, x, *f32, torch.tensor([3, 4]))
    with pytest.raises(ValueError, match="must end in hidden_size=32"):
        layer_with_kvcache(layer, x[..., :8], k_cache, v_cache, torch.tensor([3, 4]))
    for cache in (k_cache, v_cache, *f32):
        assert all(not t.any() for t in cache.values())
