"""The attention core is one op: a call is validated once and resolved once, the reference core
is the step ops composed, and the checked entry refuses what the spec refuses."""

from __future__ import annotations

import pytest
import torch
from call_counts import counting_calls
from geometry_lib import geometry

from nsa_core import NSAAttention, NSAConfig, attention_core, nsa_attention, ops
from nsa_core.reference.compress import compress

# HQ = 4 over H = 2, dk = dv = 8, l = 4, d = 2, l' = 4, n = 3, w = 6.
CONFIG = NSAConfig(**geometry(4, 2, 8, 8, 4, 2, 4, n=3, w=6))
T = 21


def _inputs(gen: torch.Generator, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=dtype)

    q, k, v = draw(1, T, 4, 8), draw(1, T, 2, 8), draw(1, T, 2, 8)
    gates = torch.rand(1, T, 4, 3, generator=gen, dtype=dtype)
    return [q, k, v, gates]


def test_one_nsa_attention_call_validates_once_and_resolves_the_core_once(
    gen: torch.Generator,
) -> None:
    q, k, v, gates = _inputs(gen)
    with counting_calls() as counts:
        nsa_attention(q, k, v, gates, CONFIG)
    assert dict(counts.validated) == {"check_nsa_attention": 1}
    assert counts.resolved["attention_core"] == 1
    # The reference core resolves each step once: compressed, scoring, selected, sliding, combine.
    assert counts.step_resolutions == 5


def test_a_packed_call_validates_once_too(gen: torch.Generator) -> None:
    q, k, v, gates = _inputs(gen)
    cu_seqlens = torch.tensor([0, 9, T], dtype=torch.int32)
    with counting_calls() as counts:
        nsa_attention(q, k, v, gates, CONFIG, cu_seqlens=cu_seqlens)
    assert dict(counts.validated) == {"check_nsa_attention": 1}
    assert counts.resolved["attention_core"] == 1


def test_the_layer_runs_no_op_validator_on_its_own_projections(gen: torch.Generator) -> None:
    """The layer checks x once; rotary embedding, compression and the core then run unchecked."""
    layer = NSAAttention(CONFIG, 16).double()
    x = torch.randn(2, T, 16, generator=gen, dtype=torch.float64)
    with counting_calls() as counts:
        layer(x)
    assert dict(counts.validated) == {}
    assert counts.resolved["attention_core"] == 1


def test_reference_core_is_the_step_ops_composed(gen: torch.Generator) -> None:
    q, k, v, gates = _inputs(gen)
    k_cmp = compress(k, CONFIG.cmp_block, CONFIG.cmp_stride)
    v_cmp = compress(v, CONFIG.cmp_block, CONFIG.cmp_stride)
    scale = CONFIG.softmax_scale
    o_cmp = ops.compressed_attention(q, k_cmp, v_cmp, 4, 2, scale)
    indices, _ = ops.select_blocks(q, k_cmp, 4, 2, 4, 3, scale)
    o_sel = ops.selected_attention(q, k, v, indices, 4, scale)
    o_win = ops.sliding_attention(q, k, v, 6, scale)
    expected = ops.gated_combine(o_cmp, o_sel, o_win, gates)
    torch.testing.assert_close(
        attention_core(q, k_cmp, v_cmp, k, v, k, v, gates, CONFIG), expected, rtol=0, atol=0
    )
    torch.testing.assert_close(nsa_attention(q, k, v, gates, CONFIG), expected, rtol=0, atol=0)


def test_queries_at_the_end_of_the_keys_see_what_the_full_call_gives_them(
    gen: torch.Generator,
) -> None:
    """q_start: the last rows of a call alone, over every key before them, equal those rows of
    the whole call (the window's keys may start later: win_start)."""
    q, k, v, gates = _inputs(gen)
    k_cmp = compress(k, CONFIG.cmp_block, CONFIG.cmp_stride)
    v_cmp = compress(v, CONFIG.cmp_block, CONFIG.cmp_stride)
    whole = attention_core(q, k_cmp, v_cmp, k, v, k, v, gates, CONFIG)
    start, win_from = 15, 8
    tail = attention_core(
        q[:, start:], k_cmp, v_cmp, k, v, k[:, win_from:], v[:, win_from:], gates[:, start:],
        CONFIG, q_start=start, win_start=start - win_from,
    )  # fmt: skip
    torch.testing.assert_close(tail, whole[:, start:], rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"config": "paper"}, TypeError, "config must be an NSAConfig"),
        ({"gates": torch.zeros(1, T, 4, 2, dtype=torch.float64)}, ValueError, "gates"),
        (
            {
                "k_cmp": torch.zeros(1, 3, 2, 8, dtype=torch.float64),
                "v_cmp": torch.zeros(1, 3, 2, 8, dtype=torch.float64),
            },
            ValueError,
            "compressed blocks",
        ),
        ({"k_win": torch.zeros(1, T, 2, 8)}, TypeError, "k_win dtype"),
        ({"q_start": 1}, ValueError, "need keys up to"),
        ({"win_start": True}, TypeError, "win_start must be an int"),
    ],
    ids=["config", "gates", "k_cmp", "k_win dtype", "q_start", "win_start"],
)
def test_the_checked_core_refuses_bad_arguments(
    gen: torch.Generator, change: dict[str, object], error: type[Exception], match: str
) -> None:
    q, k, v, gates = _inputs(gen)
    k_cmp = compress(k, CONFIG.cmp_block, CONFIG.cmp_stride)
    v_cmp = compress(v, CONFIG.cmp_block, CONFIG.cmp_stride)
    args: dict[str, object] = {
        "q": q, "k_cmp": k_cmp, "v_cmp": v_cmp, "k_sel": k, "v_sel": v, "k_win": k,
        "v_win": v, "gates": gates, "config": CONFIG,
    }  # fmt: skip
    args.update(change)
    with pytest.raises(error, match=match):
        attention_core(**args)  # type: ignore[arg-type]
