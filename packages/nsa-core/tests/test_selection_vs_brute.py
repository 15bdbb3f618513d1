"""Selection scores and top-n choice against the brute force of docs/spec.md (paper Eq. 8-10).

Indices are compared exactly. Float64 inputs are used wherever indices are compared, so that no
near-tie can flip between the two computations; every comparison also reports the smallest score
margin it relied on. The float32 path compares indices only where the margin exceeds rounding.
"""

from __future__ import annotations

import math

import brute
import pytest
import torch

import nsa_core as nc

F64 = torch.float64
GEOMETRIES = [(32, 16, 64), (8, 4, 8), (4, 2, 8), (4, 4, 4), (8, 8, 16)]


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype = F64) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=F64).to(dtype)


def long(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.int64)


def assert_same_choice(
    got: tuple[torch.Tensor, torch.Tensor], ref: tuple[torch.Tensor, torch.Tensor]
) -> None:
    indices, counts = got
    assert indices.dtype == torch.int32, indices.dtype
    assert counts.dtype == torch.int32, counts.dtype
    assert indices.shape == ref[0].shape, (tuple(indices.shape), tuple(ref[0].shape))
    assert counts.shape == ref[1].shape, (tuple(counts.shape), tuple(ref[1].shape))
    bad = (long(indices) != ref[0]).any(-1) | (long(counts) != ref[1])
    if bad.any():
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(
            f"{int(bad.sum())} rows differ; first at (b, t, g) = {where}: "
            f"got {indices[where].tolist()} (count {int(counts[where])}), "
            f"expected {ref[0][where].tolist()} (count {int(ref[1][where])})"
        )


# ---------------------------------------------------------------------------------------------
# Overlap weights c[i, j]


@pytest.mark.parametrize(("l_cmp", "d", "l_sel"), GEOMETRIES)
def test_overlap_weight_is_the_intersection_of_blocks_in_units_of_d(
    l_cmp: int, d: int, l_sel: int
) -> None:
    num_sel = 5
    num_cmp = (
        brute.n_cmp(num_sel * l_sel, l_cmp, d) + 2
    )  # a few blocks past the last selection block
    c = nc.cmp_block_overlap(num_cmp, num_sel, l_cmp, d, l_sel, dtype=F64)
    assert c.shape == (num_cmp, num_sel)
    for i in range(num_cmp):
        for j in range(num_sel):
            assert c[i, j].item() == brute.overlap(i, j, l_cmp, d, l_sel), (i, j)


def test_paper_overlap_weights_are_1_2_2_2_1_on_compressed_blocks_4j_minus_1_to_4j_plus_3() -> None:
    num_sel = 6
    c = nc.cmp_block_overlap(4 * num_sel + 2, num_sel, 32, 16, 64, dtype=F64)
    for j in range(num_sel):
        expected = torch.zeros(c.shape[0], dtype=F64)
        for i, weight in zip(range(4 * j - 1, 4 * j + 4), [1, 2, 2, 2, 1], strict=True):
            if i >= 0:
                expected[i] = weight
        assert torch.equal(c[:, j], expected), (j, c[:, j].tolist())


# ---------------------------------------------------------------------------------------------
# Scores


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize(("l_cmp", "d", "l_sel"), GEOMETRIES)
@pytest.mark.parametrize(("hq", "heads"), [(4, 4), (4, 2), (6, 2), (8, 2), (16, 1)])
def test_block_scores_are_overlap_weighted_p_cmp_summed_over_the_group(
    gen: torch.Generator, dtype: torch.dtype, l_cmp: int, d: int, l_sel: int, hq: int, heads: int
) -> None:
    length = 3 * l_sel + l_cmp + 1 if l_sel >= 32 else 5 * l_sel + 3
    q = randn(gen, 2, length, hq, 8, dtype=dtype).requires_grad_()
    k_cmp = nc.compress(randn(gen, 2, length, heads, 8, dtype=dtype), l_cmp, d).requires_grad_()
    got = nc.block_scores(q, k_cmp, l_cmp, d, l_sel)
    brute.assert_matches(got, brute.block_scores(q, k_cmp, l_cmp, d, l_sel), dtype, "scores")
    assert not got.requires_grad, "selection is a discrete choice: scores carry no gradient"


@pytest.mark.parametrize(
    ("l_cmp", "d", "l_sel", "length", "tq"),
    [(32, 16, 64, 400, 1), (8, 4, 8, 61, 1), (4, 2, 8, 40, 3)],
)
def test_block_scores_of_decode_rows_use_position_q_start_plus_r(
    gen: torch.Generator, l_cmp: int, d: int, l_sel: int, length: int, tq: int
) -> None:
    q = randn(gen, 2, tq, 4, 8)
    k_cmp = nc.compress(randn(gen, 2, length, 2, 8), l_cmp, d)
    q_start = length - tq
    got = nc.block_scores(q, k_cmp, l_cmp, d, l_sel, q_start=q_start)
    ref = brute.block_scores(q, k_cmp, l_cmp, d, l_sel, q_start=q_start)
    brute.assert_matches(got, ref, F64, "scores")


@pytest.mark.parametrize("l_cmp", [4, 8])
def test_scores_equal_p_cmp_when_l_equals_l_sel_equals_d(gen: torch.Generator, l_cmp: int) -> None:
    length, hq = 6 * l_cmp + 1, 3
    q = randn(gen, 1, length, hq, 8)
    k_cmp = nc.compress(randn(gen, 1, length, 1, 8), l_cmp, l_cmp)
    got = nc.block_scores(q, k_cmp, l_cmp, l_cmp, l_cmp)
    for t in range(length):
        expected = torch.zeros(got.shape[-1], dtype=F64)
        for h in range(hq):
            probs = brute.p_cmp(
                q[0, t, h].tolist(), k_cmp[0, :, 0].tolist(), t, l_cmp, l_cmp, 8**-0.5
            )
            expected[: len(probs)] += torch.tensor(probs, dtype=F64)
        assert brute.rel_err(got[0, t, 0], expected) <= 1e-10, t


def test_scores_are_zero_for_a_query_that_sees_no_compressed_block(gen: torch.Generator) -> None:
    l_cmp, d, l_sel = 32, 16, 64
    q = randn(gen, 1, l_cmp - 1, 4, 8)
    k_cmp = nc.compress(randn(gen, 1, l_cmp - 1, 2, 8), l_cmp, d)
    assert k_cmp.shape[1] == 0
    got = nc.block_scores(q, k_cmp, l_cmp, d, l_sel)
    assert torch.equal(got, torch.zeros_like(got))


# ---------------------------------------------------------------------------------------------
# Top-n choice on given scores


@pytest.mark.parametrize("l_sel", [1, 4, 64])
@pytest.mark.parametrize("n", [3, 4, 7])
@pytest.mark.parametrize("kind", ["random", "integer_ties"])
def test_topn_blocks_takes_forced_blocks_then_best_scores_with_ties_to_lower_j(
    gen: torch.Generator, l_sel: int, n: int, kind: str
) -> None:
    length = 40 * l_sel if l_sel < 64 else 12 * l_sel
    num_sel = brute.n_sel(length, l_sel)
    if kind == "random":
        scores = torch.rand(2, length, 3, num_sel, generator=gen, dtype=F64)
    else:
        scores = torch.randint(0, 3, (2, length, 3, num_sel), generator=gen).to(F64)
    got = nc.topn_blocks(scores, n, l_sel)
    assert_same_choice(got, brute.topn_blocks(scores, n, l_sel))


@pytest.mark.parametrize(("l_sel", "length", "tq"), [(64, 900, 1), (8, 100, 1), (4, 50, 5)])
@pytest.mark.parametrize("kind", ["random", "integer_ties"])
def test_topn_blocks_decode_rows_sit_at_q_start(
    gen: torch.Generator, l_sel: int, length: int, tq: int, kind: str
) -> None:
    num_sel = brute.n_sel(length, l_sel)
    if kind == "random":
        scores = torch.rand(2, tq, 2, num_sel, generator=gen, dtype=F64)
    else:
        scores = torch.randint(0, 2, (2, tq, 2, num_sel), generator=gen).to(F64)
    q_start = length - tq
    got = nc.topn_blocks(scores, 4, l_sel, q_start=q_start)
    assert_same_choice(got, brute.topn_blocks(scores, 4, l_sel, q_start=q_start))


def test_forced_initial_and_two_local_blocks_win_even_with_the_lowest_scores() -> None:
    l_sel, n, length = 8, 5, 96
    num_sel = brute.n_sel(length, l_sel)
    scores = torch.ones(1, length, 1, num_sel, dtype=F64)
    for t in range(length):
        jt = t // l_sel
        for j in (0, jt, jt - 1):
            if j >= 0:
                scores[0, t, 0, j] = -1.0  # the lowest score of the row
    indices, counts = nc.topn_blocks(scores, n, l_sel)
    for t in range(length):
        jt = t // l_sel
        chosen = set(indices[0, t, 0].tolist()) - {-1}
        forced = {j for j in (0, jt, jt - 1) if j >= 0}
        assert forced <= chosen, (t, sorted(chosen))
        assert int(counts[0, t, 0]) == min(n, jt + 1), t


def test_ties_go_to_the_lower_block_index() -> None:
    l_sel, n, length = 4, 5, 60
    num_sel = brute.n_sel(length, l_sel)
    scores = torch.full((1, length, 1, num_sel), 0.5, dtype=F64)  # every block ties
    indices, _ = nc.topn_blocks(scores, n, l_sel)
    for t in range(length):
        jt = t // l_sel
        forced = {j for j in (0, jt, jt - 1) if j >= 0}
        free = [j for j in range(jt + 1) if j not in forced][: n - len(forced)]
        expected = sorted(forced | set(free))
        assert indices[0, t, 0, : len(expected)].tolist() == expected, t


@pytest.mark.parametrize("n", [3, 6])
def test_fewer_valid_blocks_than_n_selects_all_valid_padded_with_minus_one(n: int) -> None:
    l_sel, length = 8, 5 * 8
    scores = torch.rand(1, length, 2, brute.n_sel(length, l_sel), dtype=F64)
    indices, counts = nc.topn_blocks(scores, n, l_sel)
    assert indices.shape == (1, length, 2, n)
    for t in range(length):
        valid = list(range(t // l_sel + 1))
        if len(valid) <= n:
            expected = valid + [-1] * (n - len(valid))
            assert indices[0, t, 0].tolist() == expected, t
            assert indices[0, t, 1].tolist() == expected, t
            assert counts[0, t].tolist() == [len(valid)] * 2, t


def test_indices_are_ascending_valid_and_padded_only_at_the_end(gen: torch.Generator) -> None:
    l_sel, n, length = 4, 6, 80
    scores = torch.rand(2, length, 3, brute.n_sel(length, l_sel), generator=gen, dtype=F64)
    indices, counts = nc.topn_blocks(scores, n, l_sel)
    for b in range(2):
        for t in range(length):
            for g in range(3):
                row = indices[b, t, g].tolist()
                count = int(counts[b, t, g])
                assert row[count:] == [-1] * (n - count), row
                assert row[:count] == sorted(set(row[:count])), row
                assert all(0 <= j <= t // l_sel for j in row[:count]), (t, row)


# ---------------------------------------------------------------------------------------------
# Score + choose from q and compressed keys


@pytest.mark.parametrize(("l_cmp", "d", "l_sel"), GEOMETRIES)
@pytest.mark.parametrize(("hq", "heads"), [(2, 2), (4, 2), (6, 2), (4, 1), (16, 1)])
@pytest.mark.parametrize("n", [3, 5])
def test_select_blocks_matches_brute_force_exactly_in_float64(
    gen: torch.Generator, l_cmp: int, d: int, l_sel: int, hq: int, heads: int, n: int
) -> None:
    length = 7 * l_sel + 5 if l_sel < 64 else 6 * l_sel + 5
    q = randn(gen, 2, length, hq, 8)
    k_cmp = nc.compress(randn(gen, 2, length, heads, 8), l_cmp, d)
    got = nc.select_blocks(q, k_cmp, l_cmp, d, l_sel, n)
    ref_indices, ref_counts, margins = brute.select_blocks(q, k_cmp, l_cmp, d, l_sel, n)
    positive = margins[margins > 0]
    # Exact ties (margin 0) are decided by the tie rule; random inputs have no near-ties.
    assert positive.numel() == 0 or float(positive.min()) > 1e-9, float(positive.min())
    assert_same_choice(got, (ref_indices, ref_counts))


@pytest.mark.parametrize(("l_cmp", "d", "l_sel"), GEOMETRIES[:4])
def test_select_blocks_in_float32_agrees_wherever_the_margin_exceeds_rounding(
    gen: torch.Generator, l_cmp: int, d: int, l_sel: int
) -> None:
    length = 7 * l_sel + 5 if l_sel < 64 else 6 * l_sel + 5
    q = randn(gen, 2, length, 4, 8, dtype=torch.float32)
    k_cmp = nc.compress(randn(gen, 2, length, 2, 8, dtype=torch.float32), l_cmp, d)
    indices, counts = nc.select_blocks(q, k_cmp, l_cmp, d, l_sel, 4)
    ref_indices, ref_counts, margins = brute.select_blocks(q, k_cmp, l_cmp, d, l_sel, 4)
    clear = margins > 1e-5  # float32 scores of G probabilities round at about 1e-7
    assert clear.float().mean() > 0.9, "too few rows with a clear margin to compare"
    assert torch.equal(long(indices)[clear], ref_indices[clear])
    assert torch.equal(long(counts), ref_counts)


@pytest.mark.parametrize(
    ("l_cmp", "d", "l_sel", "length"), [(32, 16, 64, 900), (8, 4, 8, 100), (4, 4, 4, 30)]
)
def test_select_blocks_for_a_decode_row_at_the_end_of_a_long_prefix(
    gen: torch.Generator, l_cmp: int, d: int, l_sel: int, length: int
) -> None:
    q = randn(gen, 2, 1, 4, 8)
    k_cmp = nc.compress(randn(gen, 2, length, 2, 8), l_cmp, d)
    got = nc.select_blocks(q, k_cmp, l_cmp, d, l_sel, 5, q_start=length - 1)
    ref_indices, ref_counts, _ = brute.select_blocks(
        q, k_cmp, l_cmp, d, l_sel, 5, q_start=length - 1
    )
    assert_same_choice(got, (ref_indices, ref_counts))


@pytest.mark.parametrize(("l_cmp", "d", "l_sel"), GEOMETRIES[1:])
@pytest.mark.parametrize("cuts", [[0, 1, 1, 37, 52, 90], [0, 0, 25, 26, 70]])
def test_select_blocks_varlen_indices_are_local_to_each_sequence(
    gen: torch.Generator, l_cmp: int, d: int, l_sel: int, cuts: list[int]
) -> None:
    cu = torch.tensor(cuts, dtype=torch.int32)
    q = randn(gen, 1, cuts[-1], 4, 8)
    k_cmp = nc.compress(randn(gen, 1, cuts[-1], 2, 8), l_cmp, d, cu_seqlens=cu)
    got = nc.select_blocks(q, k_cmp, l_cmp, d, l_sel, 3, cu_seqlens=cu)
    ref_indices, ref_counts, _ = brute.select_blocks(q, k_cmp, l_cmp, d, l_sel, 3, cu_seqlens=cu)
    assert_same_choice(got, (ref_indices, ref_counts))


@pytest.mark.parametrize(("l_cmp", "d", "l_sel"), [(32, 16, 64), (8, 4, 8), (4, 4, 4), (8, 8, 16)])
def test_equal_scores_from_identical_keys_go_to_the_lower_block_index(
    l_cmp: int, d: int, l_sel: int
) -> None:
    # All compressed keys equal: p_cmp is uniform, so every full, non-forced block ties.
    length, n = 9 * l_sel, 4
    q = torch.ones(1, length, 2, 8, dtype=F64)
    k_cmp = torch.zeros(1, brute.n_cmp(length, l_cmp, d), 1, 8, dtype=F64)
    got = nc.select_blocks(q, k_cmp, l_cmp, d, l_sel, n)
    ref_indices, ref_counts, margins = brute.select_blocks(q, k_cmp, l_cmp, d, l_sel, n)
    assert (margins == 0).any(), "the construction should produce exact ties"
    assert_same_choice(got, (ref_indices, ref_counts))
    # Spelled out: once the first free blocks are full, the free slots take blocks 1, 2, ...
    for t in range(4 * l_sel, length):
        jt = t // l_sel
        assert got[0][0, t, 0].tolist() == [0, 1, jt - 1, jt], t


def test_scores_of_repeated_compressed_blocks_tie_and_the_lower_j_wins(
    gen: torch.Generator,
) -> None:
    # With l = l' = d each selection block has its own compressed key; repeat one key everywhere
    # except a few distinct ones, and the repeated blocks tie exactly.
    l_cmp = 4
    length, n = 20 * l_cmp, 6
    q = randn(gen, 1, length, 1, 8)
    k_cmp = randn(gen, 1, 1, 1, 8).expand(1, brute.n_cmp(length, l_cmp, l_cmp), 1, 8).clone()
    k_cmp[0, 7] = randn(gen, 1, 8)
    k_cmp[0, 12] = randn(gen, 1, 8)
    got = nc.select_blocks(q, k_cmp, l_cmp, l_cmp, l_cmp, n)
    ref_indices, ref_counts, margins = brute.select_blocks(q, k_cmp, l_cmp, l_cmp, l_cmp, n)
    assert (margins == 0).any(), "the construction should produce exact ties"
    assert_same_choice(got, (ref_indices, ref_counts))


def test_select_blocks_with_fewer_valid_blocks_than_n_pads_with_minus_one(
    gen: torch.Generator,
) -> None:
    l_cmp, d, l_sel, n = 8, 4, 8, 6
    length = 3 * l_sel + 2  # at most 4 valid blocks
    q = randn(gen, 1, length, 2, 8)
    k_cmp = nc.compress(randn(gen, 1, length, 1, 8), l_cmp, d)
    indices, counts = nc.select_blocks(q, k_cmp, l_cmp, d, l_sel, n)
    for t in range(length):
        valid = t // l_sel + 1
        assert indices[0, t, 0].tolist() == list(range(valid)) + [-1] * (n - valid), t
        assert int(counts[0, t, 0]) == valid, t


def test_margin_helper_is_infinite_when_nothing_is_rejected() -> None:
    # The brute force's own bookkeeping: a row with no rejected candidate has no near-tie.
    assert brute.choice_margin([0.1, 0.2, 0.3], 20, 8, 3) == math.inf
    assert brute.choice_margin([0.5, 0.4, 0.1, 0.3, 0.9, 0.0], 45, 8, 4) == pytest.approx(0.1)
