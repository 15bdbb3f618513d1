"""Each op of the reference against the float64 brute force of docs/spec.md (tests/brute.py).

Shapes cover T not a multiple of any block, T < l, T = 1, G in {1, 2, 3, 4, 16}, dk != dv,
decode-shaped queries (q_start > 0) and packed sequences with a length-1 and an empty sequence.
A float64 run must agree to 1e-10 and a float32 run to 1e-5 (relative), as the spec fixes.
"""

from __future__ import annotations

import brute
import pytest
import torch

import nsa_core as nc

# (l, d, l'): the paper's geometry and small ones, including l = l' = d.
GEOMETRIES = [(32, 16, 64), (8, 4, 8), (4, 2, 8), (4, 4, 4)]
# (B, T, HQ, H, dk, dv)
SHAPES = [
    (2, 37, 4, 2, 8, 6),  # G = 2, dk != dv, T a multiple of nothing
    (1, 1, 3, 3, 4, 4),  # T = 1, G = 1
    (1, 6, 3, 1, 6, 4),  # G = 3, T below most block lengths
    (2, 23, 4, 1, 8, 8),  # G = 4
    (1, 19, 16, 1, 4, 6),  # G = 16
]
PAPER_SHAPE = (1, 150, 4, 2, 16, 8)  # l=32, d=16, l'=64 at T = 150
DTYPES = [torch.float64, torch.float32]
# Packed sequences: a length-1 and an empty one among ordinary lengths.
VARLEN_CUTS = [[0, 1, 1, 20, 29, 46], [0, 0, 13, 14, 30]]


def cases() -> list[tuple[tuple[int, int, int], tuple[int, ...]]]:
    out: list[tuple[tuple[int, int, int], tuple[int, ...]]]
    out = [(geo, shape) for geo in GEOMETRIES[1:] for shape in SHAPES]
    out += [(GEOMETRIES[0], shape) for shape in SHAPES[:2]]
    out.append((GEOMETRIES[0], PAPER_SHAPE))
    return out


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Normal values drawn in float64, then rounded to dtype (the brute force reads them)."""
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def qkv(
    gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, tq: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [B, tq or T, HQ, dk], k [B, T, H, dk], v [B, T, H, dv] from (B, T, HQ, H, dk, dv)."""
    bsz, length, hq, heads, dk, dv = shape
    q = randn(gen, bsz, length if tq is None else tq, hq, dk, dtype=dtype)
    k = randn(gen, bsz, length, heads, dk, dtype=dtype)
    v = randn(gen, bsz, length, heads, dv, dtype=dtype)
    return q, k, v


def random_block_indices(
    gen: torch.Generator, bsz: int, tq: int, heads: int, n: int, num_sel: int
) -> torch.Tensor:
    """Any indices in [-1, num_sel): unsorted, repeated, padded, future blocks included."""
    return torch.randint(-1, num_sel, (bsz, tq, heads, n), generator=gen).to(torch.int32)


# ---------------------------------------------------------------------------------------------
# Geometry helpers


@pytest.mark.parametrize(("l_cmp", "d", "l_sel"), GEOMETRIES)
def test_num_cmp_blocks_counts_complete_blocks_and_num_sel_blocks_counts_touched_blocks(
    l_cmp: int, d: int, l_sel: int
) -> None:
    for length in range(0, 3 * l_sel + 5):
        assert nc.num_cmp_blocks(length, l_cmp, d) == brute.n_cmp(length, l_cmp, d), length
        assert nc.num_sel_blocks(length, l_sel) == brute.n_sel(length, l_sel), length


@pytest.mark.parametrize(("l_cmp", "d", "l_sel"), GEOMETRIES)
def test_split_blocks_gives_block_i_as_tokens_i_d_to_i_d_plus_l(
    gen: torch.Generator, l_cmp: int, d: int, l_sel: int
) -> None:
    for length in (1, l_cmp - 1, l_cmp, l_cmp + d - 1, 3 * l_cmp + 1):
        x = randn(gen, 2, length, 3, 5)
        blocks = nc.split_blocks(x, l_cmp, d)
        assert blocks.shape == (2, brute.n_cmp(length, l_cmp, d), l_cmp, 3, 5)
        for i in range(blocks.shape[1]):
            assert torch.equal(blocks[:, i], x[:, i * d : i * d + l_cmp]), (length, i)


@pytest.mark.parametrize(("l_cmp", "d", "l_sel"), GEOMETRIES)
@pytest.mark.parametrize("cuts", VARLEN_CUTS)
def test_cmp_cu_seqlens_packs_each_sequences_complete_blocks_in_order(
    l_cmp: int, d: int, l_sel: int, cuts: list[int]
) -> None:
    cu = torch.tensor(cuts, dtype=torch.int32)
    got = nc.cmp_cu_seqlens(cu, l_cmp, d)
    assert got.tolist() == brute.cmp_offsets(cu, cuts[-1], l_cmp, d)


# ---------------------------------------------------------------------------------------------
# Compression


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("geo", "shape"), cases())
@pytest.mark.parametrize("phi", ["avg", "mlp"])
def test_compress_maps_each_complete_block_through_phi(
    gen: torch.Generator,
    dtype: torch.dtype,
    geo: tuple[int, int, int],
    shape: tuple[int, ...],
    phi: str,
) -> None:
    l_cmp, d, _ = geo
    bsz, length, _, heads, dk, _ = shape
    x = randn(gen, bsz, length, heads, dk, dtype=dtype)
    if phi == "avg":
        got = nc.compress(x, l_cmp, d)
        ref = brute.compress(x, l_cmp, d)
    else:
        mlp = nc.CompressMLP(dk, l_cmp).to(dtype)
        with torch.no_grad():
            for p in mlp.parameters():
                p.copy_(randn(gen, *p.shape, dtype=dtype) * 0.5)
        got = nc.compress(x, l_cmp, d, mlp)
        ref = brute.compress(x, l_cmp, d, brute.PhiMLP(mlp))
    assert ref.shape[1] == brute.n_cmp(length, l_cmp, d)
    brute.assert_matches(got, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_compress_avg_of_blocks_is_their_mean(gen: torch.Generator, dtype: torch.dtype) -> None:
    blocks = randn(gen, 2, 5, 8, 3, 6, dtype=dtype)
    ref = torch.stack(
        [
            torch.stack([brute.phi_avg(brute._f64(blocks[b, i, :, g])) for g in range(3)])
            for b in range(2)
            for i in range(5)
        ]
    ).reshape(2, 5, 3, 6)
    brute.assert_matches(nc.compress_avg(blocks), ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_compress_mlp_shares_weights_across_heads_and_flattens_token_major(
    gen: torch.Generator, dtype: torch.dtype
) -> None:
    l_cmp, dim, heads = 4, 6, 3
    mlp = nc.CompressMLP(dim, l_cmp).to(dtype)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(randn(gen, *p.shape, dtype=dtype))
    blocks = randn(gen, 2, 3, l_cmp, heads, dim, dtype=dtype)
    phi = brute.PhiMLP(mlp)
    ref = torch.zeros(2, 3, heads, dim, dtype=torch.float64)
    for b in range(2):
        for i in range(3):
            for g in range(heads):
                ref[b, i, g] = phi(brute._f64(blocks[b, i, :, g]))
    brute.assert_matches(mlp(blocks), ref, dtype)


@pytest.mark.parametrize(("l_cmp", "d", "l_sel"), GEOMETRIES[1:])
@pytest.mark.parametrize("cuts", VARLEN_CUTS)
@pytest.mark.parametrize("phi", ["avg", "mlp"])
def test_compress_varlen_packs_blocks_of_each_sequence_separately(
    gen: torch.Generator, l_cmp: int, d: int, l_sel: int, cuts: list[int], phi: str
) -> None:
    cu = torch.tensor(cuts, dtype=torch.int32)
    x = randn(gen, 1, cuts[-1], 2, 6)
    mlp = nc.CompressMLP(6, l_cmp).double() if phi == "mlp" else None
    got = nc.compress(x, l_cmp, d, mlp, cu_seqlens=cu)
    ref = brute.compress(x, l_cmp, d, brute.PhiMLP(mlp) if mlp else brute.phi_avg, cu_seqlens=cu)
    brute.assert_matches(got, ref, torch.float64)


# ---------------------------------------------------------------------------------------------
# Compressed attention


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("geo", "shape"), cases())
def test_compressed_attention_sees_block_only_after_its_last_token(
    gen: torch.Generator, dtype: torch.dtype, geo: tuple[int, int, int], shape: tuple[int, ...]
) -> None:
    l_cmp, d, _ = geo
    q, k, v = qkv(gen, shape, dtype)
    k_cmp, v_cmp = nc.compress(k, l_cmp, d), nc.compress(v, l_cmp, d)
    got = nc.compressed_attention(q, k_cmp, v_cmp, l_cmp, d)
    brute.assert_matches(got, brute.compressed_attention(q, k_cmp, v_cmp, l_cmp, d), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_compressed_attention_uses_the_given_scale(
    gen: torch.Generator, dtype: torch.dtype
) -> None:
    q, k, v = qkv(gen, (2, 40, 4, 2, 8, 6), dtype)
    k_cmp, v_cmp = nc.compress(k, 8, 4), nc.compress(v, 8, 4)
    got = nc.compressed_attention(q, k_cmp, v_cmp, 8, 4, 0.7)
    brute.assert_matches(got, brute.compressed_attention(q, k_cmp, v_cmp, 8, 4, 0.7), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("geo", "length", "tq"),
    [((32, 16, 64), 301, 1), ((8, 4, 8), 45, 1), ((4, 2, 8), 33, 3), ((4, 4, 4), 17, 2)],
)
def test_compressed_attention_decode_rows_sit_at_q_start(
    gen: torch.Generator, dtype: torch.dtype, geo: tuple[int, int, int], length: int, tq: int
) -> None:
    l_cmp, d, _ = geo
    q, k, v = qkv(gen, (2, length, 6, 2, 8, 4), dtype, tq=tq)
    k_cmp, v_cmp = nc.compress(k, l_cmp, d), nc.compress(v, l_cmp, d)
    q_start = length - tq
    got = nc.compressed_attention(q, k_cmp, v_cmp, l_cmp, d, q_start=q_start)
    ref = brute.compressed_attention(q, k_cmp, v_cmp, l_cmp, d, q_start=q_start)
    brute.assert_matches(got, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("l_cmp", "d", "l_sel"), GEOMETRIES[1:])
@pytest.mark.parametrize("cuts", VARLEN_CUTS)
def test_compressed_attention_varlen_restarts_blocks_per_sequence(
    gen: torch.Generator, dtype: torch.dtype, l_cmp: int, d: int, l_sel: int, cuts: list[int]
) -> None:
    cu = torch.tensor(cuts, dtype=torch.int32)
    q, k, v = qkv(gen, (1, cuts[-1], 4, 2, 8, 6), dtype)
    k_cmp = nc.compress(k, l_cmp, d, cu_seqlens=cu)
    v_cmp = nc.compress(v, l_cmp, d, cu_seqlens=cu)
    got = nc.compressed_attention(q, k_cmp, v_cmp, l_cmp, d, cu_seqlens=cu)
    ref = brute.compressed_attention(q, k_cmp, v_cmp, l_cmp, d, cu_seqlens=cu)
    brute.assert_matches(got, ref, dtype)


# ---------------------------------------------------------------------------------------------
# Selected attention


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("geo", "shape"), cases())
def test_selected_attention_is_one_softmax_over_the_union_of_blocks_up_to_t(
    gen: torch.Generator, dtype: torch.dtype, geo: tuple[int, int, int], shape: tuple[int, ...]
) -> None:
    _, _, l_sel = geo
    q, k, v = qkv(gen, shape, dtype)
    bsz, length, _, heads, _, _ = shape
    idx = random_block_indices(gen, bsz, length, heads, 4, brute.n_sel(length, l_sel))
    got = nc.selected_attention(q, k, v, idx, l_sel)
    brute.assert_matches(got, brute.selected_attention(q, k, v, idx, l_sel), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("l_cmp", "d", "l_sel"), GEOMETRIES)
def test_selected_attention_on_the_blocks_that_selection_picks(
    gen: torch.Generator, dtype: torch.dtype, l_cmp: int, d: int, l_sel: int
) -> None:
    length = 5 * l_sel + 3
    q, k, v = qkv(gen, (2, length, 4, 2, 8, 6), dtype)
    k_cmp = nc.compress(k, l_cmp, d)
    idx, _ = nc.select_blocks(q, k_cmp, l_cmp, d, l_sel, 3)
    got = nc.selected_attention(q, k, v, idx, l_sel, 0.5)
    brute.assert_matches(got, brute.selected_attention(q, k, v, idx, l_sel, 0.5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("l_sel", "length", "tq"), [(64, 301, 1), (8, 45, 1), (8, 33, 3), (4, 17, 2)]
)
def test_selected_attention_decode_rows_sit_at_q_start(
    gen: torch.Generator, dtype: torch.dtype, l_sel: int, length: int, tq: int
) -> None:
    q, k, v = qkv(gen, (2, length, 4, 1, 8, 6), dtype, tq=tq)
    idx = random_block_indices(gen, 2, tq, 1, 5, brute.n_sel(length, l_sel))
    q_start = length - tq
    got = nc.selected_attention(q, k, v, idx, l_sel, q_start=q_start)
    ref = brute.selected_attention(q, k, v, idx, l_sel, q_start=q_start)
    brute.assert_matches(got, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("l_sel", [8, 4])
@pytest.mark.parametrize("cuts", VARLEN_CUTS)
def test_selected_attention_varlen_block_indices_are_local_to_each_sequence(
    gen: torch.Generator, dtype: torch.dtype, l_sel: int, cuts: list[int]
) -> None:
    cu = torch.tensor(cuts, dtype=torch.int32)
    q, k, v = qkv(gen, (1, cuts[-1], 6, 2, 8, 6), dtype)
    # Local indices must stay inside each query's own sequence.
    idx = torch.full((1, cuts[-1], 2, 4), -1, dtype=torch.int32)
    for s in range(len(cuts) - 1):
        length = cuts[s + 1] - cuts[s]
        if length:
            idx[:, cuts[s] : cuts[s + 1]] = random_block_indices(
                gen, 1, length, 2, 4, brute.n_sel(length, l_sel)
            )
    got = nc.selected_attention(q, k, v, idx, l_sel, cu_seqlens=cu)
    brute.assert_matches(got, brute.selected_attention(q, k, v, idx, l_sel, cu_seqlens=cu), dtype)


# ---------------------------------------------------------------------------------------------
# Sliding attention


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [*SHAPES, PAPER_SHAPE])
@pytest.mark.parametrize("window", [1, 3, 16, 512])
def test_sliding_attention_sees_the_last_w_tokens_itself_included(
    gen: torch.Generator, dtype: torch.dtype, shape: tuple[int, ...], window: int
) -> None:
    q, k, v = qkv(gen, shape, dtype)
    got = nc.sliding_attention(q, k, v, window)
    brute.assert_matches(got, brute.sliding_attention(q, k, v, window), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("window", "length", "tq"), [(512, 301, 1), (16, 301, 1), (5, 33, 3), (1, 9, 2)]
)
def test_sliding_attention_decode_rows_sit_at_q_start(
    gen: torch.Generator, dtype: torch.dtype, window: int, length: int, tq: int
) -> None:
    q, k, v = qkv(gen, (2, length, 4, 2, 8, 6), dtype, tq=tq)
    q_start = length - tq
    got = nc.sliding_attention(q, k, v, window, 0.3, q_start=q_start)
    ref = brute.sliding_attention(q, k, v, window, 0.3, q_start=q_start)
    brute.assert_matches(got, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 4, 64])
@pytest.mark.parametrize("cuts", VARLEN_CUTS)
def test_sliding_attention_varlen_window_stops_at_the_sequence_start(
    gen: torch.Generator, dtype: torch.dtype, window: int, cuts: list[int]
) -> None:
    cu = torch.tensor(cuts, dtype=torch.int32)
    q, k, v = qkv(gen, (1, cuts[-1], 4, 2, 8, 6), dtype)
    got = nc.sliding_attention(q, k, v, window, cu_seqlens=cu)
    brute.assert_matches(got, brute.sliding_attention(q, k, v, window, cu_seqlens=cu), dtype)


# ---------------------------------------------------------------------------------------------
# Gated combine and RoPE


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_combine_weights_each_branch_by_its_gate(
    gen: torch.Generator, dtype: torch.dtype
) -> None:
    o = [randn(gen, 2, 7, 3, 5, dtype=dtype) for _ in range(3)]
    gates = torch.rand(2, 7, 3, 3, generator=gen, dtype=torch.float64).to(dtype)
    brute.assert_matches(
        nc.gated_combine(o[0], o[1], o[2], gates),
        brute.gated_combine(o[0], o[1], o[2], gates),
        dtype,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [2, 8, 14])
@pytest.mark.parametrize("theta", [10000.0, 500.0])
def test_rope_rotates_channel_pairs_c_and_c_plus_half_by_position_times_frequency(
    gen: torch.Generator, dtype: torch.dtype, dim: int, theta: float
) -> None:
    x = randn(gen, 2, 9, 3, dim, dtype=dtype)
    positions = torch.arange(9) + 3
    got = nc.apply_rope(x, positions, theta)
    brute.assert_matches(got, brute.apply_rope(x, positions, theta), dtype)
    per_batch = torch.stack([torch.arange(9), torch.arange(9) * 7 + 100])
    got = nc.apply_rope(x, per_batch, theta)
    brute.assert_matches(got, brute.apply_rope(x, per_batch, theta), dtype)
