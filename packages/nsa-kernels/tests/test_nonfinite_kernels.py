"""NaN/Inf containment in the Triton kernels: a bad token reaches only the rows that see it.

docs/spec.md, "Non-finite values". Each check injects NaN or +Inf at a random element of one
token of q, k or v, and requires the kernel's non-finite rows to be exactly the rows whose
softmax covers that token (for an Inf in q or k, where IEEE arithmetic may give a -Inf logit
and weight 0, at most those rows); every other row must equal the kernel's clean run bit for
bit. Runs on CPU under TRITON_INTERPRET=1 (CI) or on a CUDA GPU, in float32 on small tiles so
that one tile holds rows that see different blocks.
"""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

import pytest
import torch
from kernel_testlib import DEVICE, SKIP_REASON

import nsa_core.reference as ref
from nsa_core import NSAConfig
from nsa_core.blocks import num_cmp_blocks

pytest.importorskip("triton")

pytestmark = [pytest.mark.triton, pytest.mark.skipif(DEVICE is None, reason=SKIP_REASON)]

from nsa_kernels.compressed.function import (  # noqa: E402
    CmpConfig,
    compressed_attention_triton,
)
from nsa_kernels.decode import DecodePlan, DecodeState, decode_step  # noqa: E402
from nsa_kernels.decode.step import StepInputs  # noqa: E402
from nsa_kernels.scoring.function import select_blocks_triton  # noqa: E402
from nsa_kernels.selected.function import (  # noqa: E402
    SelConfig,
    selected_attention_triton,
    tma_available,
)
from nsa_kernels.sliding.triton_function import sliding_attention_triton  # noqa: E402

# The containment checks are the reference's (nsa-core's tests/nonfinite_testlib.py): the
# kernels are held to the same rule, row for row.
CORE_TESTS = str(Path(__file__).resolve().parents[2] / "nsa-core" / "tests")
if CORE_TESTS not in sys.path:
    sys.path.append(CORE_TESTS)
import nonfinite_testlib as nonfinite  # noqa: E402

F32 = torch.float32
HQ, H, DK, DV = 4, 2, 16, 16
L_CMP, D_CMP, L_SEL, N_SEL, WINDOW = 8, 4, 16, 3, 24
CMP_TILES = CmpConfig(block_m=16, block_n=16)
# The forced-block prologue (on by default with TMA) takes finite keys and values only, and sums
# the forced blocks first: a bad token anywhere in a call moves every row off it, so rows a bad
# token cannot reach would round otherwise than in the clean run. Off where runs are compared.
SEL_TILES = SelConfig(forced_tokens=1)
INJECTIONS = 2  # bad tokens per check: the interpreter runs each kernel call slowly


def seeded(request: pytest.FixtureRequest) -> torch.Generator:
    """A generator seeded from the test id: fixed, and different for every case."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def dev() -> str:
    assert DEVICE is not None
    return DEVICE


def randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dev(), F32)


def qkv(gen: torch.Generator, batch: int, length: int) -> dict[str, torch.Tensor]:
    """q [B, T, HQ, dk], k [B, T, H, dk], v [B, T, H, dv], drawn in that order."""
    q = randn(gen, batch, length, HQ, DK)
    return {"q": q, "k": randn(gen, batch, length, H, DK), "v": randn(gen, batch, length, H, DV)}


@pytest.mark.parametrize("value", nonfinite.BAD_VALUES, ids=["nan", "inf"])
@pytest.mark.parametrize("where", ["q", "k_cmp", "v_cmp"])
def test_compressed(request: pytest.FixtureRequest, where: str, value: float) -> None:
    gen = seeded(request)
    length = 53
    n = num_cmp_blocks(length, L_CMP, D_CMP)
    inputs = {
        "q": randn(gen, 2, length, HQ, DK),
        "k_cmp": randn(gen, 2, n, H, DK),
        "v_cmp": randn(gen, 2, n, H, DV),
    }
    t = torch.arange(length)

    def expected_rows(b: int, s: int, head: int) -> torch.Tensor:
        if where == "q":
            return nonfinite.query_row(b, s, head, s >= L_CMP - 1, (2, length, HQ))
        return nonfinite.group_rows(
            b, head, nonfinite.cmp_sees(t, s, L_CMP, D_CMP), (2, length, HQ), H
        )

    def run(x: dict[str, torch.Tensor]) -> torch.Tensor:
        return compressed_attention_triton(
            x["q"], x["k_cmp"], x["v_cmp"], L_CMP, D_CMP, config=CMP_TILES
        )

    nonfinite.check_injections(
        gen, inputs, where, value, run, expected_rows, "compressed", INJECTIONS
    )


@pytest.mark.parametrize("value", nonfinite.BAD_VALUES, ids=["nan", "inf"])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_sliding_triton(request: pytest.FixtureRequest, where: str, value: float) -> None:
    """The sliding branch on the compressed kernels (l = d = 1, a window of WINDOW keys): a bad
    token reaches exactly the rows whose window holds it."""
    gen = seeded(request)
    length = 61
    inputs = qkv(gen, 2, length)
    t = torch.arange(length)

    def expected_rows(b: int, s: int, head: int) -> torch.Tensor:
        if where == "q":
            return nonfinite.query_row(b, s, head, True, (2, length, HQ))
        return nonfinite.group_rows(
            b, head, nonfinite.sliding_sees(t, s, WINDOW), (2, length, HQ), H
        )

    def run(x: dict[str, torch.Tensor]) -> torch.Tensor:
        return sliding_attention_triton(x["q"], x["k"], x["v"], WINDOW, config=CMP_TILES)

    nonfinite.check_injections(gen, inputs, where, value, run, expected_rows, "sliding", INJECTIONS)


def random_indices(gen: torch.Generator, batch: int, length: int) -> torch.Tensor:
    scores = torch.rand(batch, length, H, -(-length // L_SEL), generator=gen, dtype=torch.float64)
    return ref.topn_blocks(scores, N_SEL, L_SEL)[0].to(dev())


# The forward loads K tiles through pointers with a mask (tma=2), or (tma=1) whole through a TMA
# descriptor: a whole tile also holds keys the row cannot see (later tokens of its block, the
# next batch row's first tokens, block 0 under a -1 slot), whose V must still weigh exactly 0.
# A bad K there only reaches logits that the visibility mask replaces; the v case under TMA
# keeps the masked V loads honest beside the whole K tiles. The forced-block prologue is off
# (SEL_TILES says why; that it steps aside bit for bit is tests/selected/test_sel_kernels.py's
# fallback test).
SEL_POINTER, SEL_TMA = SelConfig(tma=2), SelConfig(tma=1, forced_tokens=1)
_NO_TMA = pytest.mark.skipif(
    not tma_available(), reason="this triton has no host tensor descriptors (< 3.4)"
)
SEL_LOADS = [
    pytest.param("q", SEL_POINTER, id="q-pointer"),
    pytest.param("k", SEL_POINTER, id="k-pointer"),
    pytest.param("v", SEL_POINTER, id="v-pointer"),
    pytest.param("v", SEL_TMA, id="v-tma", marks=_NO_TMA),
]


@pytest.mark.parametrize("value", nonfinite.BAD_VALUES, ids=["nan", "inf"])
@pytest.mark.parametrize(("where", "tiles"), SEL_LOADS)
def test_selected(
    request: pytest.FixtureRequest, where: str, tiles: SelConfig, value: float
) -> None:
    gen = seeded(request)
    length = 37
    inputs = qkv(gen, 2, length)
    indices = random_indices(gen, 2, length)

    def expected_rows(b: int, s: int, head: int) -> torch.Tensor:
        if where == "q":
            return nonfinite.query_row(b, s, head, True, (2, length, HQ))
        sees = nonfinite.selected_sees(indices, b, head, s, L_SEL)
        return nonfinite.group_rows(b, head, sees, (2, length, HQ), H)

    def run(x: dict[str, torch.Tensor]) -> torch.Tensor:
        return selected_attention_triton(x["q"], x["k"], x["v"], indices, L_SEL, config=tiles)

    nonfinite.check_injections(
        gen, inputs, where, value, run, expected_rows, "selected", INJECTIONS
    )


@pytest.mark.parametrize(
    "where",
    [
        "q",
        "k_cmp",
    ],
)
def test_select_blocks_keeps_forced_blocks(request: pytest.FixtureRequest, where: str) -> None:
    """Rows whose scores are NaN choose as the reference does; other rows do not change."""
    gen = seeded(request)
    length, n = 70, 4
    n_cmp = num_cmp_blocks(length, L_CMP, D_CMP)
    q, k_cmp = randn(gen, 2, length, HQ, DK), randn(gen, 2, n_cmp, H, DK)

    def run(q: torch.Tensor, k_cmp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return select_blocks_triton(q, k_cmp, L_CMP, D_CMP, L_SEL, n)

    clean, _ = run(q, k_cmp)
    for _ in range(2):
        inputs = {"q": q, "k_cmp": k_cmp}
        s = nonfinite.pick(gen, inputs[where].shape[1])
        inputs[where], b, _ = nonfinite.inject(gen, inputs[where], s, nonfinite.NAN)
        indices, counts = run(inputs["q"], inputs["k_cmp"])
        scores = ref.block_scores(
            inputs["q"].double().cpu(), inputs["k_cmp"].double().cpu(), L_CMP, D_CMP, L_SEL
        )
        ref_indices, ref_counts = ref.select_blocks(
            inputs["q"].double().cpu(), inputs["k_cmp"].double().cpu(), L_CMP, D_CMP, L_SEL, n
        )
        bad = ~torch.isfinite(scores).all(dim=-1)  # [B, T, H]
        what = f"select_blocks {where}[{b}, {s}] = nan"
        assert bad.any(), f"{what}: no row met the bad value"
        assert torch.equal(indices.cpu()[bad], ref_indices[bad]), f"{what}: fallback rows"
        assert torch.equal(counts.cpu()[bad], ref_counts[bad]), f"{what}: fallback counts"
        assert torch.equal(indices.cpu()[~bad], clean.cpu()[~bad]), f"{what}: a clean row changed"


@pytest.mark.parametrize("value", nonfinite.BAD_VALUES, ids=["nan", "inf"])
def test_varlen_sequences_are_isolated(request: pytest.FixtureRequest, value: float) -> None:
    """A bad token in one packed sequence leaves the others bit-identical in both kernels."""
    gen = seeded(request)
    cu = torch.tensor([0, 21, 50, 71], dtype=torch.int32)
    length = int(cu[-1])
    q, k, v = qkv(gen, 1, length).values()
    cu_dev = cu.to(dev())
    indices = torch.cat(
        [random_indices(gen, 1, int(cu[i + 1] - cu[i])) for i in range(len(cu) - 1)], dim=1
    )

    def run(k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        k_cmp = ref.compress(k, L_CMP, D_CMP, cu_seqlens=cu_dev)
        v_cmp = ref.compress(v, L_CMP, D_CMP, cu_seqlens=cu_dev)
        return {
            "cmp": compressed_attention_triton(
                q, k_cmp, v_cmp, L_CMP, D_CMP, cu_seqlens=cu_dev, config=CMP_TILES
            ),
            "sel": selected_attention_triton(
                q, k, v, indices, L_SEL, cu_seqlens=cu_dev, config=SEL_TILES
            ),
        }

    clean = run(k, v)
    s = 30  # inside the second sequence, [21, 50)
    bad_v, _, _ = nonfinite.inject(gen, v, s, value)
    bad = run(k, bad_v)
    for name, o in bad.items():
        assert not nonfinite.row_nonfinite(o[:, :s]).any(), (
            f"{name}: a row before {s} turned non-finite"
        )
        for start, end in ((0, 21), (50, 71)):
            assert torch.equal(o[:, start:end], clean[name][:, start:end]), (
                f"{name}: sequence [{start}, {end}) changed by a bad token at {s}"
            )


# One value per branch keeps the interpreter time down; each value meets two branches overall.
@pytest.mark.parametrize(
    ("branch", "value"),
    [("cmp", nonfinite.NAN), ("sel", nonfinite.INF), ("win", nonfinite.NAN)],
    ids=["cmp", "sel", "win"],
)
def test_decode_steps_follow_the_reference(
    request: pytest.FixtureRequest, branch: str, value: float
) -> None:
    """A bad v token of one sequence: each step's non-finite heads are the reference's."""
    gen = seeded(request)
    cfg = NSAConfig(
        num_q_heads=HQ, num_kv_heads=H, head_dim_qk=DK, head_dim_v=DV, cmp_block=L_CMP,
        cmp_stride=D_CMP, sel_block=L_SEL, num_selected=4, window=WINDOW,
    )  # fmt: skip
    tokens, s, start = 44, 20, 12
    q = randn(gen, 2, tokens, HQ, DK)
    k = {name: randn(gen, 2, tokens, H, DK) for name in ("cmp", "sel", "win")}
    v = {name: randn(gen, 2, tokens, H, DV) for name in ("cmp", "sel", "win")}
    gates = torch.rand(2, tokens, HQ, 3, generator=gen).to(dev(), F32)
    v[branch] = v[branch].clone()
    v[branch][0, s, nonfinite.pick(gen, H), nonfinite.pick(gen, DV)] = value
    state = DecodeState.from_prefixes(cfg, k, v, [start, start], 128)
    plan = DecodePlan(state)
    for t in range(start, tokens):
        pos = torch.full((2,), t, device=dev())
        seq = torch.arange(2, device=dev())
        step = StepInputs(
            q=q[seq, pos], k_cmp=k["cmp"][seq, pos], v_cmp=v["cmp"][seq, pos],
            k_sel=k["sel"][seq, pos], v_sel=v["sel"][seq, pos], k_win=k["win"][seq, pos],
            v_win=v["win"][seq, pos], gates=gates[seq, pos],
        )  # fmt: skip
        out = decode_step(state, step, plan=plan)
        got = ~torch.isfinite(out.o.cpu()).all(dim=-1)  # [B, HQ]
        assert not got[1].any(), f"step {t}: the clean sequence turned non-finite"
        # The prefill path over sequence 0's prefix, with the kernel's blocks.
        k0 = {name: x[:1, : t + 1].double().cpu() for name, x in k.items()}
        v0 = {name: x[:1, : t + 1].double().cpu() for name, x in v.items()}
        q0 = q[:1, t : t + 1].double().cpu()
        k_cmp = ref.compress(k0["cmp"], L_CMP, D_CMP)
        v_cmp = ref.compress(v0["cmp"], L_CMP, D_CMP)
        idx = out.indices[:1].cpu().to(torch.int64).unsqueeze(1)
        o_ref = ref.gated_combine(
            ref.compressed_attention(q0, k_cmp, v_cmp, L_CMP, D_CMP, q_start=t),
            ref.selected_attention(q0, k0["sel"], v0["sel"], idx, L_SEL, q_start=t),
            ref.sliding_attention(q0, k0["win"], v0["win"], WINDOW, q_start=t),
            gates[:1, t : t + 1].double().cpu(),
        )
        want = ~torch.isfinite(o_ref[0, 0]).all(dim=-1)
        assert torch.equal(got[0], want), (
            f"step {t}: non-finite heads {got[0].tolist()}, reference {want.tolist()}"
        )
        if t < s:
            assert not got[0].any(), f"step {t}: a step before the bad token turned non-finite"


def test_nan_compressed_key_makes_the_whole_row_score_nan() -> None:
    """A NaN key in a visible compressed block gives the row a NaN normaliser, so every score of
    the row is NaN and the row keeps its forced blocks, then the lowest valid j (docs/spec.md,
    "Non-finite values"), exactly as the reference; a normaliser that skipped the NaN would let
    the row's other blocks rank by their finite scores instead. The same holds when the kernel
    takes the compressed branch's lse (-inf on those rows) instead of its own first pass."""
    from nsa_kernels.compressed.function import compressed_attention_triton_with_lse

    gen = torch.Generator().manual_seed(7)
    tq, hq, h, dk, l_cmp, d, l_sel, n = 160, 2, 1, 16, 16, 16, 16, 4
    q = torch.randn(1, tq, hq, dk, generator=gen, device="cpu").to(DEVICE)
    k_cmp = torch.randn(1, tq // d, h, dk, generator=gen, device="cpu").to(DEVICE)
    # Keys that rank the late blocks first, so "lowest valid j" and "best score" disagree.
    k_cmp[0, 5:, 0] = q[0, -1, 0] * 4.0
    k_cmp[0, 1, 0, 3] = float("nan")
    want, _ = ref.select_blocks(q, k_cmp, l_cmp, d, l_sel, n)
    _, cmp_lse = compressed_attention_triton_with_lse(q, k_cmp, k_cmp, l_cmp, d)
    rows = torch.arange(tq, device=q.device) >= 2 * d - 1  # rows that see block 1
    for lse in (None, cmp_lse):
        got, _ = select_blocks_triton(q, k_cmp, l_cmp, d, l_sel, n, lse=lse)
        assert torch.equal(got[0, rows], want[0, rows])
        # The last row (t = 159, jt = 9): forced {0, 8, 9}, then the lowest valid j, 1.
        assert got[0, -1, 0].tolist() == [0, 1, 8, 9]
