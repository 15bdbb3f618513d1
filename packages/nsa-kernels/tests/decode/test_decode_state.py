"""DecodeState construction and argument checks (no kernel launches: plain torch on CPU)."""

from __future__ import annotations

import pytest
import torch
from decode_testlib import ReferenceDecoder, Stream, assert_same_cache, small_config

pytest.importorskip("triton")

from nsa_core import NSAAttention, NSAConfig
from nsa_kernels.decode import (
    DecodeKernelConfig,
    DecodePlan,
    DecodeState,
    PageTable,
    StepInputs,
    decode_step,
)

F32 = torch.float32


def test_from_prefixes_holds_what_the_reference_cache_holds() -> None:
    """Ragged prefixes (0, 1, block and window edges) land where decode expects them."""
    cfg = small_config(2)
    lengths = [0, 1, 7, 8, 24, 25, 61]
    gen = torch.Generator().manual_seed(1)
    stream = Stream.random(cfg, len(lengths), 64, gen, dtype=F32, device="cpu")
    state = DecodeState.from_prefixes(cfg, stream.k, stream.v, lengths, capacity=70)
    ref = ReferenceDecoder(cfg, stream, lengths)
    assert state.lengths() == lengths
    for b, cache in enumerate(ref.caches):
        assert_same_cache(state.to_cache(b), cache, 1e-6, f"seq {b}")
        assert int(state.num_cmp[b]) == cache.num_cmp


def test_paged_prefixes_hold_what_the_dense_state_holds() -> None:
    """The same ragged prefixes in pages of a shuffled pool (pages of 8, under a selection
    block, and of 32, over one): every sequence reads back as the dense state's."""
    cfg = small_config(2)
    lengths = [0, 1, 7, 25, 61]
    gen = torch.Generator().manual_seed(2)
    stream = Stream.random(cfg, len(lengths), 64, gen, dtype=F32, device="cpu")
    dense = DecodeState.from_prefixes(cfg, stream.k, stream.v, lengths, capacity=70)
    for page_size in (8, 32):
        pages = PageTable.for_capacities(
            [70] * len(lengths), page_size, device="cpu", generator=torch.Generator().manual_seed(3)
        )
        paged = DecodeState.from_prefixes(cfg, stream.k, stream.v, lengths, 70, pages=pages)
        assert paged.k_sel.shape == (pages.num_pages, page_size, 2, 16)
        for b, n in enumerate(lengths):
            for got, want in zip(paged.sel_tokens(b, n), dense.sel_tokens(b, n), strict=True):
                assert torch.equal(got, want)
            assert_same_cache(paged.to_cache(b), dense.to_cache(b), 0.0, f"seq {b}")


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ([[0, 1], [1, 2]], "lists a page twice"),
        ([[0, 5], [1, 2]], r"page ids in \[0, 4\)"),
        ([[0, -2], [1, 2]], r"must be -1 or page ids"),
    ],
    ids=["shared_page", "past_the_pool", "below_minus_one"],
)
def test_a_page_table_refuses_pages_it_cannot_hold(table: list[list[int]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PageTable(torch.tensor(table, dtype=torch.int32), page_size=8, num_pages=4)


def test_a_page_table_needs_int32_rows_of_the_batch() -> None:
    with pytest.raises(TypeError, match="int32"):
        PageTable(torch.zeros(2, 2, dtype=torch.int64), page_size=8, num_pages=4)
    pages = PageTable.for_capacities([16, 16, 16], 8, device="cpu")
    with pytest.raises(ValueError, match="3 rows for batch 2"):
        DecodeState.empty(small_config(1), 2, 16, device="cpu", dtype=F32, pages=pages)


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_beam_reorder_gives_each_row_its_source_sequence(paged: bool) -> None:
    """Rows take sequences 2, 0, 0, 1 (one taken twice, one by none, a cycle): every row then
    holds exactly what its source held, dense or in its own pages of a shuffled pool."""
    cfg = small_config(2)
    lengths = [9, 30, 61, 0]
    gen = torch.Generator().manual_seed(4)
    stream = Stream.random(cfg, 4, 64, gen, dtype=F32, device="cpu")
    shuffle = torch.Generator().manual_seed(5)
    pages = None
    if paged:
        pages = PageTable.for_capacities([70] * 4, 8, device="cpu", generator=shuffle)
    state = DecodeState.from_prefixes(cfg, stream.k, stream.v, lengths, 70, pages=pages)
    before = [state.to_cache(b) for b in range(4)]
    beam_idx = torch.tensor([2, 0, 0, 1])
    state.reorder(beam_idx)
    assert state.lengths() == [lengths[src] for src in beam_idx.tolist()]
    for r, src in enumerate(beam_idx.tolist()):
        assert_same_cache(state.to_cache(r), before[src], 0.0, f"row {r} <- {src}")


def test_beam_reorder_refuses_what_it_cannot_do_and_leaves_the_state() -> None:
    cfg = small_config(1)
    gen = torch.Generator().manual_seed(6)
    stream = Stream.random(cfg, 2, 40, gen, dtype=F32, device="cpu")
    pages = PageTable.for_capacities([16, 40], 8, device="cpu")
    state = DecodeState.from_prefixes(cfg, stream.k, stream.v, [10, 33], 40, pages=pages)
    saved = state.clone()
    for bad, error, message in (
        (torch.tensor([1, 1]), ValueError, "row 0 has pages for 16 tokens, too few for the 33"),
        (torch.tensor([0, 2]), ValueError, r"values must be in \[0, 2\)"),
        (torch.tensor([0]), ValueError, r"beam_idx must be \[B=2\]"),
        (torch.tensor([0, 1], dtype=torch.int32), TypeError, "int64 tensor, got torch.int32"),
        ([0, 1], TypeError, "int64 tensor, got list"),
    ):
        with pytest.raises(error, match=message):
            state.reorder(bad)  # type: ignore[arg-type]
        for name in ("k_sel", "v_sel", "k_cmp", "k_win", "cache_seqlens", "num_cmp"):
            assert torch.equal(getattr(state, name), getattr(saved, name)), name


def test_from_cache_round_trip() -> None:
    """A prefill's NSACache -> DecodeState -> NSACache is the identity."""
    cfg = small_config(2)
    torch.manual_seed(0)
    layer = NSAAttention(cfg, hidden_size=16)
    with torch.no_grad():
        _, cache = layer.prefill(torch.randn(3, 37, 16))
    state = DecodeState.from_cache(cache, capacity=50)
    assert state.lengths() == [37, 37, 37]
    for b in range(3):
        one = state.to_cache(b)
        want = cache.state()
        for name, x in one.state().items():
            assert torch.equal(x, want[name][b : b + 1]), name


def test_snapshot_restore_and_clone() -> None:
    cfg = small_config(1)
    state = DecodeState.empty(cfg, 2, 10, device="cpu", dtype=F32)
    saved = state.snapshot_counters()
    copy = state.clone()
    state.cache_seqlens += 3
    state.num_cmp += 1
    copy.k_sel += 1
    assert torch.equal(copy.cache_seqlens, torch.zeros(2, dtype=torch.int32))
    assert not torch.equal(copy.k_sel, state.k_sel)
    state.restore_counters(saved)
    assert state.lengths() == [0, 0]
    assert state.num_cmp.tolist() == [0, 0]


def test_bad_arguments() -> None:
    cfg = small_config(2)
    gen = torch.Generator().manual_seed(2)
    stream = Stream.random(cfg, 2, 10, gen, dtype=F32, device="cpu")
    with pytest.raises(ValueError, match="lengths"):
        DecodeState.from_prefixes(cfg, stream.k, stream.v, [3, 11], capacity=20)
    with pytest.raises(ValueError, match="lengths for a batch"):
        DecodeState.from_prefixes(cfg, stream.k, stream.v, [3], capacity=20)
    with pytest.raises(ValueError, match="needs phi_k"):
        DecodeState.from_prefixes(
            small_config(2, phi="mlp"), stream.k, stream.v, [3, 4], capacity=20
        )
    state = DecodeState.from_prefixes(cfg, stream.k, stream.v, [3, 4], capacity=20)
    good = stream.inputs_at([3, 4])
    bad_shape = StepInputs(**{**good.__dict__, "q": good.q[:, :1]})
    with pytest.raises(ValueError, match=r"q \[2, 1, 16\] must be"):
        decode_step(state, bad_shape)
    bad_dtype = StepInputs(**{**good.__dict__, "gates": good.gates.double()})
    with pytest.raises(TypeError, match="gates dtype"):
        decode_step(state, bad_dtype)
    with pytest.raises(ValueError, match="pass no phi_k"):
        decode_step(state, good, phi_k=lambda x: x[..., 0, :], phi_v=lambda x: x[..., 0, :])
    other = DecodeState.empty(cfg, 2, 30, device="cpu", dtype=F32)
    with pytest.raises(ValueError, match="another state geometry"):
        decode_step(state, good, plan=DecodePlan(other))
    with pytest.raises(ValueError, match="power of two"):
        DecodePlan(state, DecodeKernelConfig(key_tile=24))
    odd = NSAConfig(
        num_q_heads=2, num_kv_heads=1, head_dim_qk=16, head_dim_v=16, cmp_block=8,
        cmp_stride=4, sel_block=12, num_selected=3, window=8,
    )  # fmt: skip
    with pytest.raises(ValueError, match="sel_block / cmp_stride a power of two"):
        DecodePlan(DecodeState.empty(odd, 1, 16, device="cpu", dtype=F32))
    assert state.lengths() == [3, 4], "a refused step must leave the state alone"
