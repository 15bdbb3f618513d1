"""The fused decode step against nsa_core's reference, on small shapes.

Runs on CPU under TRITON_INTERPRET=1 (CI) or on a CUDA GPU, in float32: outputs are held to the
float32 bound of docs/spec.md against the float64 reference (prefill path: the ops over the
prefix at q_start = t; decode path: an NSACache advanced token by token), indices to the top-n
contract of step.py, reads to the formula. l=8, d=4, l'=16, n=4, w=24 (decode_testlib).
"""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch
from decode_testlib import (
    ReferenceDecoder,
    Stream,
    assert_same_cache,
    check_reads,
    check_step,
    small_config,
)
from kernel_testlib import BOUND, DEVICE, INTERPRET, SKIP_REASON, rel_err

pytestmark = [pytest.mark.triton, pytest.mark.skipif(DEVICE is None, reason=SKIP_REASON)]
pytest.importorskip("triton")

from nsa_core import NSAAttention, NSAConfig  # noqa: E402
from nsa_core.reference import CompressMLP, apply_rope  # noqa: E402
from nsa_kernels.common.launch_chain import pdl_supported  # noqa: E402
from nsa_kernels.decode import (  # noqa: E402
    DecodeKernelConfig,
    DecodePlan,
    DecodeState,
    LayerDecoder,
    PageTable,
    StepInputs,
    StepOutputs,
    block_phi,
    decode_step,
)

F32 = torch.float32
DEV = DEVICE or "cpu"
# Splits as thin as the tiles allow (every split-K path with several partials) ...
THIN = DecodeKernelConfig(
    key_tile=16,
    cmp_chunk_tiles=1,
    window_chunk=16,
    sel_tile=16,
    sel_splits=4,
    score_chunk=16,
    combine_tile=2,
    combine_heads=1,
)
# ... and as fat (one program per branch and (sequence, kv head)): fewer interpreted programs.
FAT = DecodeKernelConfig(
    key_tile=64,
    cmp_chunk_tiles=4,
    window_chunk=64,
    sel_tile=16,
    sel_splits=1,
    score_chunk=32,
    combine_heads=16,
)


def _gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def _ragged_batch(
    request: pytest.FixtureRequest,
    cfg: NSAConfig,
    lengths: list[int],
    tokens: int,
    capacity: int,
) -> tuple[Stream, DecodeState, StepInputs]:
    """``tokens`` random tokens a sequence; a state of ``capacity`` holding each sequence's
    first ``lengths[b]``; the inputs of each sequence's next token."""
    stream = Stream.random(cfg, len(lengths), tokens, _gen(request), dtype=F32, device=DEV)
    state = DecodeState.from_prefixes(cfg, stream.k, stream.v, lengths, capacity)
    return stream, state, stream.inputs_at(lengths)


def _assert_same_bits(got: StepOutputs, want: StepOutputs, where: str) -> None:
    for name in ("o", "indices", "reads"):
        assert torch.equal(getattr(got, name), getattr(want, name)), f"{where}: {name}"


def _run_steps(
    cfg: NSAConfig,
    lengths: list[int],
    steps: int,
    kernel_cfg: DecodeKernelConfig,
    gen: torch.Generator,
    *,
    phi: tuple[torch.nn.Module, torch.nn.Module] | None = None,
    capacity: int = 160,
) -> tuple[int, int]:
    """``steps`` steps of a ragged batch, each checked against both reference paths."""
    stream = Stream.random(cfg, len(lengths), max(lengths) + steps, gen, dtype=F32, device=DEV)
    phi_k = phi_v = None
    ref_phi_k = ref_phi_v = None
    if phi is not None:
        ref_phi_k, ref_phi_v = phi
        phi_k, phi_v = block_phi(ref_phi_k), block_phi(ref_phi_v)
    state = DecodeState.from_prefixes(
        cfg, stream.k, stream.v, lengths, capacity, phi_k=phi_k, phi_v=phi_v
    )
    plan = DecodePlan(state, kernel_cfg)
    ref = ReferenceDecoder(cfg, stream, lengths, ref_phi_k, ref_phi_v)
    exact = ties = 0
    for s in range(steps):
        positions = [n + s for n in lengths]
        out = decode_step(state, stream.inputs_at(positions), phi_k=phi_k, phi_v=phi_v, plan=plan)
        assert state.lengths() == [t + 1 for t in positions]
        e, t = check_step(cfg, stream, positions, out, BOUND[F32], phi_k=ref_phi_k, phi_v=ref_phi_v)
        exact, ties = exact + e, ties + t
        for b in range(len(lengths)):
            o_ref = ref.step(b, out.indices[b])
            err = rel_err(out.o[b], o_ref)
            assert err <= BOUND[F32], f"seq {b} step {s}: decode-path rel err {err:.3g}"
    for b in range(len(lengths)):
        assert_same_cache(state.to_cache(b), ref.caches[b], 1e-6, f"seq {b}")
    return exact, ties


@pytest.mark.parametrize(
    ("group", "kernel_cfg"),
    [(1, THIN), (3, THIN), (16, FAT)],
    ids=["g1_thin", "g3_thin", "g16_fat"],
)
def test_ragged_steps_match_reference(
    group: int, kernel_cfg: DecodeKernelConfig, request: pytest.FixtureRequest
) -> None:
    """Lengths 0, 1, 45 and 117 in one batch, 5 steps each.

    Every sequence completes a compressed block within 4 steps (d=4); 45 -> 49 crosses a
    selection block boundary (48); 117 has 8 valid blocks for n=4 slots, so top-n chooses.
    """
    cfg = small_config(group)
    exact, ties = _run_steps(cfg, [0, 1, 45, 117], 5, kernel_cfg, _gen(request))
    assert exact >= 0.9 * (exact + ties), f"only {exact} of {exact + ties} rows checked exactly"


def test_long_selection_many_candidates(request: pytest.FixtureRequest) -> None:
    """Several scoring chunks and candidates merged across them (16 selection blocks per chunk).

    n=6 of up to 16 valid blocks, with score chunks of 16 and compressed chunks of one tile.
    """
    cfg = small_config(2, num_selected=6)
    kernel_cfg = DecodeKernelConfig(
        key_tile=16, cmp_chunk_tiles=2, score_chunk=16, sel_splits=2, combine_heads=2
    )
    exact, ties = _run_steps(cfg, [200, 255], 3, kernel_cfg, _gen(request), capacity=300)
    assert exact >= 0.9 * (exact + ties)


def test_head_dims_192_128(request: pytest.FixtureRequest) -> None:
    """dk = 192 (a padded tile of 256) with dv = 128."""
    cfg = small_config(2, dk=192, dv=128)
    _run_steps(cfg, [30, 61], 2, FAT, _gen(request), capacity=80)


def test_stages_follow_the_tiles_and_the_batch() -> None:
    """float32 K/V tiles of 256 + 128 columns in two stages need more shared memory than an
    sm_89 SM has (ci/compile_triton.py): such plans run one stage. 16-bit tiles up to 128 + 128
    columns run three stages once the batch holds 64 kv heads (B*H), two below; a stage count
    asked for is kept."""
    for (dk, dv, dtype, batch), stages in {
        (192, 128, F32, 1): 1,
        (192, 128, F32, 32): 1,
        (128, 128, F32, 32): 2,
        (192, 128, torch.float16, 32): 2,
        (128, 128, torch.float16, 31): 2,
        (128, 128, torch.float16, 32): 3,
    }.items():
        cfg = small_config(2, dk=dk, dv=dv)
        state = DecodeState.empty(cfg, batch, 40, device=DEV, dtype=dtype)
        assert DecodePlan(state).stages == stages, (dk, dv, dtype, batch)
        assert DecodePlan(state, DecodeKernelConfig(stages=2)).stages == 2, "asked for: kept"


def test_scoring_chunks_follow_the_length() -> None:
    """16 to 32 scoring chunks a sequence (the power of two at or above 1/32 of its selection
    blocks), at least 64 blocks each, whatever the batch; a chunk asked for is kept."""
    cfg = small_config(2)  # l' = 16
    for (batch, capacity), chunk in {
        (1, 16 * 64 * 16): 64,
        (40, 16 * 64 * 16): 64,
        (1, 32 * 64 * 16): 64,
        (1, 32 * 64 * 16 + 1): 128,
        (1, 32 * 128 * 16): 128,
        (2, 16 * 100): 64,
    }.items():
        state = DecodeState.empty(cfg, batch, capacity, device=DEV, dtype=F32)
        plan = DecodePlan(state)
        assert plan.score_chunk == chunk, (batch, capacity)
        assert plan.score_chunks == -(-capacity // (16 * chunk))
        assert DecodePlan(state, DecodeKernelConfig(score_chunk=32)).score_chunk == 32, "kept"


def test_learned_phi(request: pytest.FixtureRequest) -> None:
    """phi = an MLP, run every step on the device and written where a block completes."""
    gen = _gen(request)
    cfg = small_config(2, phi="mlp")
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    phi_k = CompressMLP(cfg.head_dim_qk, cfg.cmp_block).to(DEV)
    phi_v = CompressMLP(cfg.head_dim_v, cfg.cmp_block).to(DEV)
    _run_steps(cfg, [7, 22], 5, FAT, gen, phi=(phi_k, phi_v), capacity=40)


def test_ties_go_to_the_lower_block(request: pytest.FixtureRequest) -> None:
    """Equal compressed keys give equal scores to every block with a full band: the kernel
    must pick the lowest such blocks, as the reference's stable sort does."""
    gen = _gen(request)
    cfg = small_config(2, num_selected=5)
    lengths = [150, 97]
    stream = Stream.random(cfg, 2, 160, gen, dtype=F32, device=DEV)
    # One key for every token, and q and that key on a grid of 1/4: every sum of products is
    # exact in float32, so the logits are bit-equal in any summation order.
    stream.k["cmp"][:] = torch.round(stream.k["cmp"][:, :1] * 4) / 4
    stream.q.copy_(torch.round(stream.q * 4) / 4)
    state = DecodeState.from_prefixes(cfg, stream.k, stream.v, lengths, 160)
    out = decode_step(state, stream.inputs_at(lengths), plan=DecodePlan(state, THIN))
    for b, t in enumerate(lengths):
        jt = t // cfg.sel_block
        # Forced {0, jt-1, jt}; blocks 1, 2 have full bands and the lowest j among the ties.
        want = [0, 1, 2, jt - 1, jt]
        for h in range(cfg.num_kv_heads):
            assert out.indices[b, h].tolist() == want, (b, h, out.indices[b, h].tolist())
    check_step(cfg, stream, lengths, out, BOUND[F32])


def test_every_ranking_of_the_scoring_chunks_chooses_the_same_blocks(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A scoring chunk sorts its keys with tl.topk where Triton has it, and the selected kernel
    merges the chunks' candidates with it; without it a chunk of at most 64 blocks ranks its
    keys by an all-pairs count, a longer one and the merge take n max-reductions. Chunks of 16
    and of 128 blocks, each way, give the same indices, outputs and reads, bit for bit (the
    ways without tl.topk under the interpreter only: they swap a constexpr global, which only
    the interpreter reads per call)."""
    import triton.language as tl

    from nsa_kernels.decode import topn_kernels

    cfg = small_config(3, num_selected=6)
    lengths = [20, 97, 300]
    stream, base, inputs = _ragged_batch(request, cfg, lengths, 320, 320)
    outs = {}
    for has_topk in (True, False) if INTERPRET else (topn_kernels.HAS_TOPK,):
        monkeypatch.setattr(topn_kernels, "HAS_TOPK", tl.constexpr(has_topk))
        for score_chunk in (16, 128):
            state = base.clone()
            plan = DecodePlan(state, dataclasses.replace(THIN, score_chunk=score_chunk))
            outs[has_topk, score_chunk] = decode_step(state, inputs, plan=plan)
    (first, want), *rest = outs.items()
    assert (want.indices >= 0).sum(-1).max() == cfg.num_selected
    for way, got in rest:
        _assert_same_bits(got, want, f"(has topk, chunk) {way} against {first}")
    check_step(cfg, stream, lengths, want, BOUND[F32])


def test_splits_agree_and_repeat(request: pytest.FixtureRequest) -> None:
    """Thin and fat splits give the same indices and outputs within float32 rounding, and the
    same split run twice from the same state gives the same bits (fixed combine order)."""
    _, base, inputs = _ragged_batch(request, small_config(3), [90, 33, 130], 140, 140)
    outs = []
    for kernel_cfg in (THIN, FAT, THIN):
        state = base.clone()
        outs.append(decode_step(state, inputs, plan=DecodePlan(state, kernel_cfg)))
    thin, fat, thin_again = outs
    assert torch.equal(thin.indices, fat.indices)
    assert torch.equal(thin.reads, fat.reads)
    assert rel_err(thin.o, fat.o) <= 1e-6
    assert torch.equal(thin.o, thin_again.o)
    assert torch.equal(thin.indices, thin_again.indices)


def test_a_plan_sized_for_the_tokens_held_agrees_with_one_sized_for_the_capacity(
    request: pytest.FixtureRequest,
) -> None:
    """A ragged batch in a state sized far past its tokens: a plan told the tokens it holds
    cuts the compressed keys and the scoring into smaller chunks, and gives the indices and
    reads of the capacity-sized plan exactly, the outputs within float32 rounding."""
    lengths = [10, 70, 130]
    _, base, inputs = _ragged_batch(request, small_config(3), lengths, 140, 4096)
    # Four program slots: the chunks' sizes as on a small GPU, the same on every device.
    slots = DecodeKernelConfig(program_slots=4)
    by_capacity = DecodePlan(base, slots)
    by_tokens = DecodePlan(base, slots, tokens=sum(lengths))
    assert by_tokens.cmp_chunk_tiles < by_capacity.cmp_chunk_tiles
    # Each plan on its own copy of the state (a plan's workspace is shared by its steps only).
    outs = [decode_step(base.clone(), inputs, plan=plan) for plan in (by_capacity, by_tokens)]
    assert torch.equal(outs[0].indices, outs[1].indices)
    assert torch.equal(outs[0].reads, outs[1].reads)
    assert rel_err(outs[1].o, outs[0].o) <= 1e-6


@pytest.mark.parametrize("stale", [float("nan"), 1.0e4], ids=["nan", "large"])
def test_workspace_values_left_by_earlier_steps_do_not_reach_a_step(
    stale: float, request: pytest.FixtureRequest
) -> None:
    """A step reads only the workspace entries it wrote: partials, tile maxima and band sums
    left full of NaN or of values far above any real one, with huge read counts, give the same
    bits as a zeroed workspace."""
    cfg = small_config(3)
    lengths = [10, 70, 130]
    # A capacity far past the lengths: most compressed chunks hold no block this step.
    stream, base, inputs = _ragged_batch(request, cfg, lengths, 140, 512)
    outs = []
    for fill in (0.0, stale):
        state = base.clone()
        plan = DecodePlan(state, THIN)
        assert plan.cmp_chunks * plan.cmp_chunk > 2 * int(state.num_cmp.max())
        for buf in (plan.part_m, plan.part_l, plan.part_acc, plan.tile_m, plan.band):
            buf.fill_(fill)
        plan.part_n.fill_(0 if fill == 0.0 else 1 << 20)
        outs.append(decode_step(state, inputs, plan=plan))
    zeros, stale_out = outs
    _assert_same_bits(stale_out, zeros, "stale workspace")
    check_step(cfg, stream, lengths, stale_out, BOUND[F32])


@pytest.mark.parametrize("tokens", [0, 3 * 4096 + 1], ids=["none", "past_the_capacity"])
def test_a_plan_refuses_tokens_the_state_cannot_hold(tokens: int) -> None:
    cfg = small_config(1)
    state = DecodeState.empty(cfg, 3, 4096, device=DEV, dtype=F32)
    with pytest.raises(ValueError, match="tokens"):
        DecodePlan(state, tokens=tokens)


def test_matches_layer_prefill_and_decode(request: pytest.FixtureRequest) -> None:
    """LayerDecoder from NSAAttention.prefill's cache (equal lengths): each step's output
    equals NSAAttention.decode's (projections, RoPE at the device-side position, fused step,
    output projection) and the reads equal its DecodeStats."""
    gen = _gen(request)
    cfg = small_config(2)
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    layer = NSAAttention(cfg, hidden_size=32).to(DEV)
    x = torch.randn(2, 44, 32, generator=gen).to(DEV)
    _, decoder = LayerDecoder.prefill(layer, x[:, :40], capacity=44, config=FAT)
    with torch.no_grad():
        _, cache = layer.prefill(x[:, :40], capacity=44)
    for t in range(40, 44):
        x_t = x[:, t : t + 1]
        y, out = decoder.step(x_t[:, 0])
        with torch.no_grad():
            y_ref, stats = layer.decode(x_t, cache)
        err = rel_err(y, y_ref[:, 0])
        assert err <= BOUND[F32], f"t={t}: rel err {err:.3g}"
        assert torch.equal(out.reads_cmp.cpu(), stats.reads_cmp.cpu().int())
        assert torch.equal(out.reads_sel.cpu(), stats.reads_sel.cpu().int())
        assert torch.equal(out.reads_win.cpu(), stats.reads_win.cpu().int())
        for b in range(2):
            check_reads(cfg, out, b, t)
    assert decoder.state.lengths() == [44, 44]


def test_layer_projections_equal_branch_inputs(request: pytest.FixtureRequest) -> None:
    """LayerDecoder's stacked GEMM and single RoPE call give NSAAttention.branch_inputs, with
    biases and per-sequence positions."""
    gen = _gen(request)
    cfg = small_config(3)
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    layer = NSAAttention(cfg, hidden_size=24, bias=True).to(DEV)
    state = DecodeState.empty(cfg, 2, 64, device=DEV, dtype=F32)
    decoder = LayerDecoder(layer, state)
    x = torch.randn(2, 24, generator=gen).to(DEV)
    positions = torch.tensor([[5], [41]], device=DEV)
    got = decoder.project(x, positions)
    with torch.no_grad():
        want = layer.branch_inputs(x[:, None], positions)
    pairs = {
        "q": want.q,
        "gates": want.gates,
        **{f"k_{b}": want.k[b] for b in ("cmp", "sel", "win")},
        **{f"v_{b}": want.v[b] for b in ("cmp", "sel", "win")},
    }
    for name, ref in pairs.items():
        err = rel_err(getattr(got, name), ref[:, 0])
        assert err <= BOUND[F32], f"{name}: rel err {err:.3g}"


def test_layer_rope_equals_the_reference_rotation_bit_for_bit(
    request: pytest.FixtureRequest,
) -> None:
    """The decoder's one RoPE launch (frequencies computed once, angles from the int32 lengths
    on the device) turns q and the branch keys exactly as nsa_core's reference apply_rope."""
    gen = _gen(request)
    cfg = small_config(3)
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    layer = NSAAttention(cfg, hidden_size=24, bias=True).to(DEV)
    for dtype in (F32, torch.float16):
        state = DecodeState.empty(cfg, 2, 4096, device=DEV, dtype=dtype)
        decoder = LayerDecoder(layer.to(dtype), state)
        x = torch.randn(2, 24, generator=gen).to(DEV, dtype)
        positions = torch.tensor([[5], [4093]], device=DEV, dtype=torch.int32)
        got = decoder.project(x, positions)
        hq, h, dk = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim_qk
        with torch.no_grad():
            projected = torch.nn.functional.linear(x, decoder._w_in, decoder._b_in)
            keys = projected[:, : (hq + 3 * h) * dk].reshape(2, 1, hq + 3 * h, dk)
            want = apply_rope(keys, positions.long(), cfg.rope_theta)[:, 0]
        rotated = torch.cat([got.q, got.k_cmp, got.k_sel, got.k_win], dim=1)
        assert torch.equal(rotated, want), dtype


def test_full_sequence_is_left_unchanged(request: pytest.FixtureRequest) -> None:
    """A sequence at capacity is not advanced and is flagged; the others go on."""
    gen = _gen(request)
    cfg = small_config(1)
    stream = Stream.random(cfg, 2, 20, gen, dtype=F32, device=DEV)
    state = DecodeState.from_prefixes(cfg, stream.k, stream.v, [20, 5], capacity=20)
    decode_step(state, stream.inputs_at([19, 5]), plan=DecodePlan(state, FAT))
    assert state.lengths() == [20, 6]
    assert state.overflow.tolist() == [1, 0]
    with pytest.raises(RuntimeError, match=r"sequences \[0\] reached the capacity"):
        state.check_capacity()


@pytest.mark.parametrize("kernel_cfg", [THIN, FAT], ids=["one_block_a_split", "four_a_split"])
@pytest.mark.parametrize("page_size", [8, 32], ids=["pages_of_8", "pages_of_32"])
def test_paged_steps_equal_dense_steps_bit_for_bit(
    page_size: int, kernel_cfg: DecodeKernelConfig, request: pytest.FixtureRequest
) -> None:
    """A ragged batch whose selected K/V sit in pages of a shuffled pool (8 tokens: a selection
    block spans two pages; 32: a page holds two blocks, and a split loads its blocks' pages
    before its loop) steps exactly as the dense state: the same outputs, indices and reads bit
    for bit, and the same caches after 6 steps."""
    gen = _gen(request)
    cfg = small_config(3)
    lengths = [0, 45, 117]
    stream = Stream.random(cfg, 3, 130, gen, dtype=F32, device=DEV)
    dense = DecodeState.from_prefixes(cfg, stream.k, stream.v, lengths, 130)
    pages = PageTable.for_capacities(
        [130] * 3, page_size, device=DEV, generator=torch.Generator().manual_seed(1)
    )
    paged = DecodeState.from_prefixes(cfg, stream.k, stream.v, lengths, 130, pages=pages)
    for s in range(6):
        inputs = stream.inputs_at([n + s for n in lengths])
        want = decode_step(dense, inputs, plan=DecodePlan(dense, kernel_cfg))
        got = decode_step(paged, inputs, plan=DecodePlan(paged, kernel_cfg))
        _assert_same_bits(got, want, f"step {s}")
    assert paged.lengths() == dense.lengths() == [n + 6 for n in lengths]
    for b in range(3):
        assert_same_cache(paged.to_cache(b), dense.to_cache(b), 0.0, f"seq {b}")


def test_a_sequence_out_of_pages_is_full_and_left_unchanged(request: pytest.FixtureRequest) -> None:
    """Pages for 24 and 40 tokens: the first sequence, at 24, has no page for its next token,
    so the step leaves it as it was and flags it; the second goes on."""
    gen = _gen(request)
    cfg = small_config(1)
    stream = Stream.random(cfg, 2, 40, gen, dtype=F32, device=DEV)
    pages = PageTable.for_capacities([24, 40], 8, device=DEV)
    state = DecodeState.from_prefixes(cfg, stream.k, stream.v, [24, 5], 40, pages=pages)
    before = state.clone()
    decode_step(state, stream.inputs_at([24, 5]), plan=DecodePlan(state, FAT))
    assert state.lengths() == [24, 6]
    assert state.overflow.tolist() == [1, 0]
    assert torch.equal(state.k_sel, _with_token(before, state, 1, 5))
    with pytest.raises(RuntimeError, match=r"sequences \[0\] reached the capacity"):
        state.check_capacity()


def _with_token(before: DecodeState, after: DecodeState, b: int, pos: int) -> torch.Tensor:
    """``before``'s page pool with sequence b's token ``pos`` as ``after`` holds it: a step that
    advanced only b wrote nothing else into the pool."""
    pool = before.k_sel.clone()
    assert after.pages is not None
    row = after.pages.rows(b, pos, pos + 1)
    pool.flatten(0, 1)[row] = after.k_sel.flatten(0, 1)[row]
    return pool


def test_half_precision(request: pytest.FixtureRequest) -> None:
    """float16 storage, float32 softmax state (the interpreter's bfloat16 dots are wrong, so the
    step refuses bfloat16 there; test_decode_gpu.py runs it on the GPU).

    The reference takes the state's compressed blocks, so that scores and outputs compare on
    the same (rounded) inputs: the fp16 bound of docs/spec.md and the top-n contract.
    """
    gen = _gen(request)
    cfg = small_config(3)
    lengths = [5, 70, 140]
    steps = 3
    stream = Stream.random(cfg, 3, max(lengths) + steps, gen, dtype=torch.float16, device=DEV)
    state = DecodeState.from_prefixes(cfg, stream.k, stream.v, lengths, 150)
    plan = DecodePlan(state, FAT)
    exact = ties = 0
    for s in range(steps):
        positions = [n + s for n in lengths]
        out = decode_step(state, stream.inputs_at(positions), plan=plan)
        e, t = check_step(cfg, stream, positions, out, BOUND[torch.float16], state=state)
        exact, ties = exact + e, ties + t
    assert exact >= 0.9 * (exact + ties)


def test_a_plan_chains_its_launches_by_pdl_only_where_the_device_supports_it() -> None:
    """pdl=0 chooses programmatic dependent launch on sm_90+ GPUs only (never in the
    interpreter), pdl=2 turns it off, pdl=1 is refused where it cannot run."""
    cfg = small_config(1)
    state = DecodeState.empty(cfg, 1, 256, device=DEV, dtype=F32)
    supported = pdl_supported(state.device)
    if state.device.type != "cuda":
        assert not supported
    assert DecodePlan(state).pdl == supported
    assert not DecodePlan(state, DecodeKernelConfig(pdl=2)).pdl
    if supported:
        assert DecodePlan(state, DecodeKernelConfig(pdl=1)).pdl
    else:
        with pytest.raises(ValueError, match="programmatic dependent launch needs"):
            DecodePlan(state, DecodeKernelConfig(pdl=1))
    with pytest.raises(ValueError, match="pdl=3"):
        DecodePlan(state, DecodeKernelConfig(pdl=3))
