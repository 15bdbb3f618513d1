"""NaN/Inf containment in the reference: a bad token reaches only the rows that see it.

docs/spec.md, "Non-finite values". Each check injects NaN or +Inf at a random element of one
token of q, k or v (or x for the module), computes from the masks which output rows see that
token, and requires exactly those rows to turn non-finite (for an Inf in q or k, where IEEE
arithmetic may give a -Inf logit and weight 0, at most those rows), and every other row to equal
the clean run bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from nonfinite_testlib import (
    BAD_VALUES,
    INF,
    NAN,
    check_injections,
    cmp_sees,
    group_rows,
    inject,
    pick,
    query_row,
    row_nonfinite,
    selected_sees,
    sliding_sees,
)

import nsa_core.reference as ref
from nsa_core import NSAAttention, NSAConfig
from nsa_core.attention import positions_of
from nsa_core.blocks import num_cmp_blocks

LayerFactory = Callable[..., NSAAttention]

F64 = torch.float64
# (l, d, l', n, w, T): overlapping compressed blocks, l' > l, a window shorter than l.
GEOMETRY = (8, 4, 16, 3, 5, 45)
HQ, H, DK, DV = 4, 2, 8, 6
INJECTIONS = 4  # bad tokens per check


def randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=F64)


def qkv(gen: torch.Generator, batch: int, length: int) -> tuple[torch.Tensor, ...]:
    """q [B, T, HQ, dk], k [B, T, H, dk], v [B, T, H, dv], drawn in that order."""
    q = randn(gen, batch, length, HQ, DK)
    return q, randn(gen, batch, length, H, DK), randn(gen, batch, length, H, DV)


def random_indices(
    gen: torch.Generator, batch: int, length: int, l_sel: int, n: int
) -> torch.Tensor:
    scores = torch.rand(batch, length, H, -(-length // l_sel), generator=gen, dtype=F64)
    return ref.topn_blocks(scores, n, l_sel)[0]


@pytest.mark.parametrize("value", BAD_VALUES, ids=["nan", "inf"])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_sliding(gen: torch.Generator, where: str, value: float) -> None:
    _, _, _, _, w, length = GEOMETRY
    q, k, v = qkv(gen, 2, length)
    t = torch.arange(length)

    def expected_rows(b: int, s: int, head: int) -> torch.Tensor:
        if where == "q":
            return query_row(b, s, head, True, (2, length, HQ))
        return group_rows(b, head, sliding_sees(t, s, w), (2, length, HQ), H)

    def run(x: dict[str, torch.Tensor]) -> torch.Tensor:
        return ref.sliding_attention(x["q"], x["k"], x["v"], w)

    check_injections(
        gen, {"q": q, "k": k, "v": v}, where, value, run, expected_rows, "sliding", INJECTIONS
    )


@pytest.mark.parametrize("value", BAD_VALUES, ids=["nan", "inf"])
@pytest.mark.parametrize("where", ["q", "k_cmp", "v_cmp"])
def test_compressed(gen: torch.Generator, where: str, value: float) -> None:
    l_cmp, d, _, _, _, length = GEOMETRY
    n = num_cmp_blocks(length, l_cmp, d)
    q = randn(gen, 2, length, HQ, DK)
    k_cmp, v_cmp = randn(gen, 2, n, H, DK), randn(gen, 2, n, H, DV)
    t = torch.arange(length)

    def expected_rows(b: int, s: int, head: int) -> torch.Tensor:
        if where == "q":
            return query_row(b, s, head, s >= l_cmp - 1, (2, length, HQ))
        return group_rows(b, head, cmp_sees(t, s, l_cmp, d), (2, length, HQ), H)

    def run(x: dict[str, torch.Tensor]) -> torch.Tensor:
        return ref.compressed_attention(x["q"], x["k_cmp"], x["v_cmp"], l_cmp, d)

    inputs = {"q": q, "k_cmp": k_cmp, "v_cmp": v_cmp}
    check_injections(gen, inputs, where, value, run, expected_rows, "compressed", INJECTIONS)


@pytest.mark.parametrize("value", BAD_VALUES, ids=["nan", "inf"])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_selected(gen: torch.Generator, where: str, value: float) -> None:
    _, _, l_sel, n, _, length = GEOMETRY
    q, k, v = qkv(gen, 2, length)
    indices = random_indices(gen, 2, length, l_sel, n)

    def expected_rows(b: int, s: int, head: int) -> torch.Tensor:
        if where == "q":
            return query_row(b, s, head, True, (2, length, HQ))
        sees = selected_sees(indices, b, head, s, l_sel)
        return group_rows(b, head, sees, (2, length, HQ), H)

    def run(x: dict[str, torch.Tensor]) -> torch.Tensor:
        return ref.selected_attention(x["q"], x["k"], x["v"], indices, l_sel)

    check_injections(
        gen, {"q": q, "k": k, "v": v}, where, value, run, expected_rows, "selected", INJECTIONS
    )


def fallback_choice(t: int, l_sel: int, n: int) -> list[int]:
    """The blocks a row with no finite score keeps: forced ones, then the lowest valid j."""
    jt = t // l_sel
    forced = sorted({0, jt, jt - 1} & set(range(jt + 1)))
    rest = [j for j in range(jt + 1) if j not in forced]
    return sorted(forced + rest[: max(0, n - len(forced))])


@pytest.mark.parametrize("scores_value", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
def test_topn_non_finite_scores_keep_forced_blocks(
    gen: torch.Generator, scores_value: float
) -> None:
    """A non-finite score never takes a slot from a finite one or from a forced block."""
    l_sel, n, length = 4, 4, 40
    n_sel = length // l_sel
    scores = torch.rand(1, length, 1, n_sel, generator=gen, dtype=F64)
    # All scores of row 30 bad; block 2 bad (and so the largest if it were +Inf) for every row.
    scores[0, 30] = scores_value
    scores[0, :, 0, 2] = scores_value
    indices, counts = ref.topn_blocks(scores, n, l_sel)
    assert indices[0, 30, 0].tolist() == fallback_choice(30, l_sel, n)
    for t in range(length):
        jt = t // l_sel
        row = [j for j in indices[0, t, 0].tolist() if j >= 0]
        assert len(row) == counts[0, t, 0] == min(n, jt + 1), f"row {t}: {row}"
        assert {0, jt, max(jt - 1, 0)} <= set(row), f"row {t} lost a forced block: {row}"
        if t == 30:
            continue
        finite_free = [j for j in range(jt + 1) if j != 2 and j not in {0, jt, jt - 1}]
        free_slots = n - len({0, jt, max(jt - 1, 0)})
        # Block 2, unless forced, enters only when finite candidates run out.
        if 2 not in {0, jt, jt - 1} and len(finite_free) >= free_slots:
            assert 2 not in row, f"row {t}: the non-finite block 2 took a slot: {row}"


@pytest.mark.parametrize("value", BAD_VALUES, ids=["nan", "inf"])
@pytest.mark.parametrize("where", ["q", "k_cmp"])
def test_select_blocks(gen: torch.Generator, where: str, value: float) -> None:
    """Rows whose scores meet the bad value fall back to the forced and lowest blocks."""
    l_cmp, d, l_sel, n, _, length = GEOMETRY
    n_cmp = num_cmp_blocks(length, l_cmp, d)
    q, k_cmp = randn(gen, 2, length, HQ, DK), randn(gen, 2, n_cmp, H, DK)
    clean_scores = ref.block_scores(q, k_cmp, l_cmp, d, l_sel)
    clean, _ = ref.select_blocks(q, k_cmp, l_cmp, d, l_sel, n)
    t = torch.arange(length)
    for _ in range(4):
        inputs = {"q": q, "k_cmp": k_cmp}
        s = pick(gen, inputs[where].shape[1])
        inputs[where], b, head = inject(gen, inputs[where], s, value)
        scores = ref.block_scores(inputs["q"], inputs["k_cmp"], l_cmp, d, l_sel)
        indices, counts = ref.select_blocks(inputs["q"], inputs["k_cmp"], l_cmp, d, l_sel, n)
        if where == "q":
            rows = torch.zeros(length, dtype=torch.bool)
            rows[s] = s >= l_cmp - 1
            head = head // (HQ // H)
        else:
            rows = cmp_sees(t, s, l_cmp, d)
        expected = torch.zeros(2, length, H, dtype=torch.bool)
        expected[b, :, head] = rows
        got = ~torch.isfinite(scores).all(dim=-1)
        what = f"select_blocks {where}[{b}, {s}] = {value}"
        assert not (got & ~expected).any(), f"{what}: a row that cannot see it has bad scores"
        assert torch.equal(scores[~expected], clean_scores[~expected]), f"{what}: a score changed"
        assert torch.equal(indices[~expected], clean[~expected]), f"{what}: a choice changed"
        if value == value:
            continue  # an Inf gives some rows finite and NaN scores side by side
        assert torch.equal(got, expected), f"{what}: non-finite score rows"
        for bb, r, g in got.nonzero().tolist():
            fallback = fallback_choice(r, l_sel, n)
            assert indices[bb, r, g, : len(fallback)].tolist() == fallback, f"{what}: row {r}"
            assert counts[bb, r, g] == len(fallback)


@pytest.mark.parametrize("value", BAD_VALUES, ids=["nan", "inf"])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_varlen_sequences_are_isolated(gen: torch.Generator, where: str, value: float) -> None:
    """A bad token in one packed sequence leaves the other sequences bit-identical."""
    l_cmp, d, l_sel, n, w, _ = GEOMETRY
    cu = torch.tensor([0, 13, 30, 47], dtype=torch.int32)
    length = int(cu[-1])
    q, k, v = qkv(gen, 1, length)
    spans = [(int(cu[i]), int(cu[i + 1])) for i in range(len(cu) - 1)]

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        k_cmp, v_cmp = (
            ref.compress(k, l_cmp, d, cu_seqlens=cu),
            ref.compress(v, l_cmp, d, cu_seqlens=cu),
        )
        indices, _ = ref.select_blocks(q, k_cmp, l_cmp, d, l_sel, n, cu_seqlens=cu)
        return {
            "cmp": ref.compressed_attention(q, k_cmp, v_cmp, l_cmp, d, cu_seqlens=cu),
            "sel": ref.selected_attention(q, k, v, indices, l_sel, cu_seqlens=cu),
            "win": ref.sliding_attention(q, k, v, w, cu_seqlens=cu),
        }

    clean = run(q, k, v)
    s = 20  # inside the second sequence, [13, 30)
    inputs = {"q": q, "k": k, "v": v}
    inputs[where], b, _ = inject(gen, inputs[where], s, value)
    bad = run(inputs["q"], inputs["k"], inputs["v"])
    for name, o in bad.items():
        for start, end in spans:
            if start <= s < end:
                rows = row_nonfinite(o[:, start:end])
                assert not row_nonfinite(o[:, start:s]).any(), (
                    f"{name}: a row before {s} turned bad"
                )
                if name == "win":
                    assert rows[b, s - start :].any(), f"{name}: the bad token reached no row"
                continue
            assert torch.equal(o[:, start:end], clean[name][:, start:end]), (
                f"{name}: sequence [{start}, {end}) changed by a bad token at {s}"
            )


MODULE_CONFIG = NSAConfig(
    num_q_heads=HQ, num_kv_heads=H, head_dim_qk=DK, head_dim_v=DV,
    cmp_block=8, cmp_stride=4, sel_block=16, num_selected=3, window=5,
)  # fmt: skip


def module_expected_rows(layer: NSAAttention, x: torch.Tensor, s: int) -> torch.Tensor:
    """[T] rows that see token s through some branch, with the selection of the bad input."""
    cfg = layer.config
    length = x.shape[1]
    with torch.no_grad():
        inp = layer.branch_inputs(x, positions_of(length, None, x.device))
        k_cmp, _ = layer.compress_kv(inp.k["cmp"], inp.v["cmp"])
        indices, _ = ref.select_blocks(
            inp.q, k_cmp, cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, cfg.num_selected, cfg.scale
        )
    t = torch.arange(length)
    first_block = max(0, -(-(s - cfg.cmp_block + 1) // cfg.cmp_stride))
    # The first compressed block holding s is the first a query sees: blocks end in order.
    sees_cmp = cmp_sees(t, first_block, cfg.cmp_block, cfg.cmp_stride)
    sees_sel = (indices[0] == s // cfg.sel_block).any(dim=-1).any(dim=-1) & (s <= t)
    return sliding_sees(t, s, cfg.window) | sees_cmp | sees_sel


@pytest.mark.parametrize("value", BAD_VALUES, ids=["nan", "inf"])
@pytest.mark.parametrize("phi", ["avg", "mlp"])
def test_module_forward(
    make_layer: LayerFactory, gen: torch.Generator, phi: str, value: float
) -> None:
    cfg = dataclasses.replace(MODULE_CONFIG, phi=phi)  # type: ignore[arg-type]
    layer = make_layer(cfg, 12)
    length = 45
    x = randn(gen, 1, length, 12)
    with torch.no_grad():
        clean = layer(x)
        for s in (3, 10, 26, 44):
            bad_x = x.clone()
            bad_x[0, s, pick(gen, 12)] = value
            bad = layer(bad_x)
            got = ~torch.isfinite(bad[0]).all(dim=-1)
            expected = module_expected_rows(layer, bad_x, s)
            assert torch.equal(got, expected), (
                f"x[{s}] = {value}: non-finite rows {got.nonzero().flatten().tolist()}, "
                f"expected {expected.nonzero().flatten().tolist()}"
            )
            assert torch.equal(bad[:, :s], clean[:, :s]), f"x[{s}]: an earlier row changed"


@pytest.mark.parametrize("value", BAD_VALUES, ids=["nan", "inf"])
def test_decode_matches_prefill(
    make_layer: LayerFactory, gen: torch.Generator, value: float
) -> None:
    """Stepping through a bad token gives the prefill's rows: the same non-finite set."""
    layer = make_layer(MODULE_CONFIG, 12)
    length, s = 40, 17
    x = randn(gen, 1, length, 12)
    x[0, s, pick(gen, 12)] = value
    with torch.no_grad():
        prefill = layer(x)
        _, cache = layer.prefill(x[:, :1])
        steps = [prefill[:, :1]]
        for t in range(1, length):
            y, _ = layer.decode(x[:, t : t + 1], cache)
            steps.append(y)
    decode = torch.cat(steps, dim=1)
    bad_prefill = ~torch.isfinite(prefill[0]).all(dim=-1)
    bad_decode = ~torch.isfinite(decode[0]).all(dim=-1)
    assert bad_prefill[s], "the bad token's own row stayed finite"
    assert not bad_prefill[:s].any()
    assert torch.equal(bad_decode, bad_prefill), (
        f"decode rows {bad_decode.nonzero().flatten().tolist()} != "
        f"prefill rows {bad_prefill.nonzero().flatten().tolist()}"
    )
    finite = ~bad_prefill
    torch.testing.assert_close(decode[0, finite], prefill[0, finite], rtol=1e-10, atol=1e-12)
