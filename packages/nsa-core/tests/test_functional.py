"""nsa_func and nsa_varlen_func: NSA in flash-attn's layouts, queries at the last key positions.

nsa_func over all Tk queries is nsa_attention with gates of 1/3; over the last Tq queries it is
those rows of the full run (a chunk of a prefill); the packed form equals the sequences run one
by one.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import pytest
import torch
from call_counts import counting_calls

from nsa_core import CompressMLP, NSAConfig, nsa_attention, nsa_func, nsa_varlen_func

# HQ = 4 over H = 2, dk = 16, dv = 8, l = 8, d = 4, l' = 8, n = 3, w = 16.
CFG = NSAConfig(
    num_q_heads=4, num_kv_heads=2, head_dim_qk=16, head_dim_v=8, cmp_block=8, cmp_stride=4,
    sel_block=8, num_selected=3, window=16,
)  # fmt: skip
B, T, HQ, H, DK, DV = 2, 37, 4, 2, 16, 8
# float64 runs of the same math whose sums are grouped differently (one query chunk against
# all of them, one sequence against the packed call): rounding of float64 only.
FLOAT64_TOL = 1e-10


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||."""
    return float((out - ref).detach().norm() / ref.detach().norm())


Draw = Callable[..., torch.Tensor]


@pytest.fixture
def draw(gen: torch.Generator) -> Draw:
    def sample(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    return sample


def qkv(draw: Draw, t: int = T) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, t, HQ, dk], k [B, t, H, dk], v [B, t, H, dv]."""
    return draw(B, t, HQ, DK), draw(B, t, H, DK), draw(B, t, H, DV)


# ------------------------------------------------------------------------------ nsa_func


def test_all_queries_equal_nsa_attention_with_gates_of_one_third(draw: Draw) -> None:
    q, k, v = qkv(draw)
    thirds = torch.full((B, T, HQ, 3), 1 / 3, dtype=torch.float64)
    assert torch.equal(nsa_func(q, k, v, config=CFG), nsa_attention(q, k, v, thirds, CFG))


def test_given_gates_are_the_gates_used(draw: Draw) -> None:
    q, k, v = qkv(draw)
    gates = torch.rand(B, T, HQ, 3, dtype=torch.float64)
    assert torch.equal(nsa_func(q, k, v, gates, config=CFG), nsa_attention(q, k, v, gates, CFG))


# Chunks of the last c queries: c = 11 starts at 26, inside compressed block 5 (tokens 20..27)
# and selection block 3, and ends past the emission of blocks 6 and 7.
@pytest.mark.parametrize("c", [1, 2, 11, T])
def test_the_last_queries_equal_the_last_rows_of_the_full_run(draw: Draw, c: int) -> None:
    q, k, v = qkv(draw)
    gates = torch.rand(B, T, HQ, 3, dtype=torch.float64)
    full = nsa_func(q, k, v, gates, config=CFG)
    chunk = nsa_func(q[:, -c:], k, v, gates[:, -c:], config=CFG)
    assert chunk.shape == (B, c, HQ, DV)
    assert rel_err(chunk, full[:, -c:]) <= FLOAT64_TOL


# A chunked prefill: queries [s, e) over the keys of [0, e), chunks straddling block edges.
@pytest.mark.parametrize(("start", "end"), [(0, 1), (9, 18), (13, 30), (30, 31)])
def test_a_chunk_of_a_prefill_equals_those_rows(draw: Draw, start: int, end: int) -> None:
    q, k, v = qkv(draw)
    full = nsa_func(q, k, v, config=CFG)
    chunk = nsa_func(q[:, start:end], k[:, :end], v[:, :end], config=CFG)
    assert rel_err(chunk, full[:, start:end]) <= FLOAT64_TOL


def test_per_branch_keys_and_learned_phi_in_chunks(draw: Draw) -> None:
    q = draw(B, T, HQ, DK)
    k = {b: draw(B, T, H, DK) for b in ("cmp", "sel", "win")}
    v = {b: draw(B, T, H, DV) for b in ("cmp", "sel", "win")}
    phi_k, phi_v = CompressMLP(DK, 8).double(), CompressMLP(DV, 8).double()
    full = nsa_func(q, k, v, config=CFG, phi_k=phi_k, phi_v=phi_v)
    thirds = torch.full((B, T, HQ, 3), 1 / 3, dtype=torch.float64)
    assert torch.equal(full, nsa_attention(q, k, v, thirds, CFG, phi_k=phi_k, phi_v=phi_v))
    chunk = nsa_func(q[:, -7:], k, v, config=CFG, phi_k=phi_k, phi_v=phi_v)
    assert rel_err(chunk, full[:, -7:]) <= FLOAT64_TOL


def test_per_call_scale_and_window_equal_a_config_holding_them(draw: Draw) -> None:
    q, k, v = qkv(draw)
    per_call = nsa_func(q[:, -9:], k, v, config=CFG, softmax_scale=0.1, window=5)
    in_config = nsa_func(q[:, -9:], k, v, config=dataclasses.replace(CFG, scale=0.1, window=5))
    assert torch.equal(per_call, in_config)
    # Each override changes the result on its own.
    plain = nsa_func(q[:, -9:], k, v, config=CFG)
    assert not torch.allclose(nsa_func(q[:, -9:], k, v, config=CFG, softmax_scale=0.1), plain)
    assert not torch.allclose(nsa_func(q[:, -9:], k, v, config=CFG, window=5), plain)


def test_heads_and_head_dims_come_from_the_tensors(draw: Draw) -> None:
    """No config: the paper's geometry (l = 32, d = 16, l' = 64, n = 16, w = 512) with the
    tensors' HQ, H, dk, dv."""
    q, k, v = qkv(draw, 70)
    thirds = torch.full((B, 70, HQ, 3), 1 / 3, dtype=torch.float64)
    paper = NSAConfig(num_q_heads=HQ, num_kv_heads=H, head_dim_qk=DK, head_dim_v=DV)
    assert torch.equal(nsa_func(q, k, v), nsa_attention(q, k, v, thirds, paper))
    # A config with other heads only lends its geometry.
    assert torch.equal(nsa_func(q, k, v, config=NSAConfig()), nsa_func(q, k, v))


def test_one_call_validates_once_and_resolves_the_core_once(draw: Draw) -> None:
    q, k, v = qkv(draw)
    with counting_calls() as counts:
        nsa_func(q[:, -5:], k, v, config=CFG)
    assert dict(counts.validated) == {"check_nsa_attention": 1}
    assert counts.resolved["attention_core"] == 1


def test_gradients_of_a_chunk_pass_gradcheck(gen: torch.Generator) -> None:
    # n = 3 keeps only the forced blocks: no selection by score, so the function is smooth.
    cfg = NSAConfig(
        num_q_heads=2, num_kv_heads=1, head_dim_qk=4, head_dim_v=4, cmp_block=4, cmp_stride=2,
        sel_block=4, num_selected=3, window=4,
    )  # fmt: skip

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_(True)

    q, k, v = leaf(1, 5, 2, 4), leaf(1, 11, 1, 4), leaf(1, 11, 1, 4)
    gates = torch.rand(1, 5, 2, 3, generator=gen, dtype=torch.float64).requires_grad_(True)
    # fast_mode checks the Jacobian along random directions: the full Jacobian of these 158
    # inputs costs hundreds of calls.
    assert torch.autograd.gradcheck(
        lambda *a: nsa_func(*a, config=cfg), (q, k, v, gates), eps=1e-6, atol=1e-8, fast_mode=True
    )


# ------------------------------------------------------------------------------ nsa_varlen_func


def packed(draw: Draw, lengths: list[int]) -> tuple[torch.Tensor, ...]:
    """q [total, HQ, dk], k [total, H, dk], v [total, H, dv] and int32 cu_seqlens of lengths."""
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return draw(total, HQ, DK), draw(total, H, DK), draw(total, H, DV), cu


LENGTHS = [9, 0, 21, 14]


def test_equal_cu_seqlens_equal_each_sequence_run_alone(draw: Draw) -> None:
    q, k, v, cu = packed(draw, LENGTHS)
    gates = torch.rand(q.shape[0], HQ, 3, dtype=torch.float64)
    with counting_calls() as counts:
        out = nsa_varlen_func(q, k, v, cu, cu, gates, max_seqlen_q=21, max_seqlen_k=21, config=CFG)
    # The packed path: one validation, one core call.
    assert dict(counts.validated) == {"check_nsa_attention": 1}
    assert counts.resolved["attention_core"] == 1
    bounds = cu.tolist()
    for s, e in itertools.pairwise(bounds):
        if e > s:
            one = nsa_func(q[None, s:e], k[None, s:e], v[None, s:e], gates[None, s:e], config=CFG)
            assert rel_err(out[s:e], one[0]) <= FLOAT64_TOL


def test_chunked_queries_equal_the_last_rows_of_each_sequence(draw: Draw) -> None:
    """Queries: the last 3, 0, 21 and 1 positions of sequences of 9, 5, 21 and 14 keys."""
    lengths_k, lengths_q = [9, 5, 21, 14], [3, 0, 21, 1]
    q_all, k, v, cu_k = packed(draw, lengths_k)
    full = nsa_varlen_func(q_all, k, v, cu_k, cu_k, config=CFG)
    rows = torch.cat(
        [torch.arange(e - n, e) for n, e in zip(lengths_q, cu_k[1:].tolist(), strict=True)]
    )
    cu_q = torch.tensor([0, 3, 3, 24, 25], dtype=torch.int32)
    with counting_calls() as counts:
        chunked = nsa_varlen_func(q_all[rows], k, v, cu_q, cu_k, config=CFG, max_seqlen_k=30)
    assert dict(counts.validated) == {"check_nsa_attention": 1}
    assert chunked.shape == (25, HQ, DV)
    assert rel_err(chunked, full[rows]) <= FLOAT64_TOL
    # And each sequence alone through nsa_func.
    starts_k = cu_k.tolist()
    for i in (0, 2, 3):
        s, e = starts_k[i], starts_k[i + 1]
        one = nsa_func(q_all[None, e - lengths_q[i] : e], k[None, s:e], v[None, s:e], config=CFG)
        sq = int(cu_q[i])
        assert rel_err(chunked[sq : sq + lengths_q[i]], one[0]) <= FLOAT64_TOL


def test_varlen_gradients_equal_the_dense_gradients(draw: Draw) -> None:
    lengths_k = [9, 14]
    q_all, k, v, cu_k = packed(draw, lengths_k)
    rows = torch.tensor([6, 7, 8, 19, 20, 21, 22])  # the last 3 and 4 positions
    cu_q = torch.tensor([0, 3, 7], dtype=torch.int32)
    leaves = [t.clone().requires_grad_(True) for t in (q_all[rows], k, v)]
    nsa_varlen_func(*leaves, cu_q, cu_k, config=CFG).square().sum().backward()
    dense = [t.clone().requires_grad_(True) for t in (q_all[rows], k, v)]
    for (sq, eq), (sk, ek) in (((0, 3), (0, 9)), ((3, 7), (9, 23))):
        dq, dk, dv = dense
        o = nsa_func(dq[None, sq:eq], dk[None, sk:ek], dv[None, sk:ek], config=CFG)
        o.square().sum().backward()
    for got, want in zip(leaves, dense, strict=True):
        assert got.grad is not None
        assert want.grad is not None
        assert rel_err(got.grad, want.grad) <= FLOAT64_TOL


# ------------------------------------------------------------------------------ refusals

TE, VE = TypeError, ValueError


def bad_calls(draw: Draw) -> list[tuple[str, type[Exception], str, Callable[[], object]]]:
    q, k, v = qkv(draw)
    qp, kp, vp, cu = packed(draw, [9, 21])
    kmap = {"cmp": k, "sel": k, "win": k[:, :-1]}
    vmap = {"cmp": v, "sel": v, "win": v[:, :-1]}
    cu_short = torch.tensor([0, 30], dtype=torch.int32)
    return [
        ("Tq > Tk", VE, r"q \[2, 37, 4, 16\] holds more tokens than k \[2, 36, 2, 16\]",
         lambda: nsa_func(q, k[:, 1:], v[:, 1:], config=CFG)),
        ("branches with other Tk", VE, r"k\['win'\] \[2, 36, 2, 16\] must hold as many tokens",
         lambda: nsa_func(q[:, -3:], kmap, vmap, config=CFG)),
        ("gates of every key", VE, r"gates \[2, 37, 4, 3\] must be \[B, T, HQ, 3\] matching q",
         lambda: nsa_func(q[:, -3:], k, v, torch.rand(B, T, HQ, 3, dtype=torch.float64),
                          config=CFG)),
        ("gates of another dtype", TE, r"gates dtype torch.float32 differs from q dtype",
         lambda: nsa_func(q, k, v, torch.rand(B, T, HQ, 3), config=CFG)),
        ("config", TE, r"config must be an NSAConfig or None, got dict",
         lambda: nsa_func(q, k, v, config={})),  # type: ignore[arg-type]
        ("softmax_scale 0", VE, r"softmax_scale must be finite and > 0, got 0",
         lambda: nsa_func(q, k, v, config=CFG, softmax_scale=0.0)),
        ("window 2.0", TE, r"window must be an int, got float",
         lambda: nsa_func(q, k, v, config=CFG, window=2.0)),  # type: ignore[arg-type]
        ("HQ not a multiple of H", VE, r"query heads HQ=3 .* must be a multiple of kv heads H=2",
         lambda: nsa_func(q[:, :, :3], k, v, config=CFG)),
        ("phi_k", TE, r"phi_k must be a torch.nn.Module or None, got str",
         lambda: nsa_func(q, k, v, config=CFG, phi_k="mlp")),  # type: ignore[arg-type]
        ("varlen q rank", VE, r"q must have rank 3 \[total_q, HQ, dk\]",
         lambda: nsa_varlen_func(q, kp, vp, cu, cu, config=CFG)),
        ("varlen gates rank", VE, r"gates must have rank 3 \[total_q, HQ, 3\]",
         lambda: nsa_varlen_func(qp, kp, vp, cu, cu, torch.rand(1, 30, HQ, 3), config=CFG)),
        ("cu_seqlens_q int64", TE, r"cu_seqlens_q must be int32, got torch.int64",
         lambda: nsa_varlen_func(qp, kp, vp, cu.long(), cu, config=CFG)),
        ("cu_seqlens_k short of total_k", VE, r"cu_seqlens_k must end at T=30, got 29",
         lambda: nsa_varlen_func(qp, kp, vp, cu, torch.tensor([0, 9, 29], dtype=torch.int32),
                                 config=CFG)),
        ("mismatched sequence counts", VE, r"must hold the same number of sequences",
         lambda: nsa_varlen_func(qp, kp, vp, cu, cu_short, config=CFG)),
        ("a sequence with Tq_i > Tk_i", VE, r"sequence 0 has 9 queries but 3 keys",
         lambda: nsa_varlen_func(qp, kp, vp, cu, torch.tensor([0, 3, 30], dtype=torch.int32),
                                 config=CFG)),
        ("max_seqlen_q below the longest", VE, r"max_seqlen_q must be >= the longest sequence, "
         r"21, got 20",
         lambda: nsa_varlen_func(qp, kp, vp, cu, cu, max_seqlen_q=20, config=CFG)),
        ("max_seqlen_k a float", TE, r"max_seqlen_k must be an int",
         lambda: nsa_varlen_func(qp, kp, vp, cu, cu, max_seqlen_k=21.0,  # type: ignore[arg-type]
                                 config=CFG)),
    ]  # fmt: skip


BAD_IDS = [c[0] for c in bad_calls(lambda *s: torch.zeros(*s, dtype=torch.float64))]


@pytest.mark.parametrize("index", range(len(BAD_IDS)), ids=BAD_IDS)
def test_bad_input_is_refused_by_name(draw: Draw, index: int) -> None:
    _, error, message, call = bad_calls(draw)[index]
    with pytest.raises(error, match=message):
        call()
