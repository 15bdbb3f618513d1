"""The sliding branch handing the selected one each row's softmax over its forced blocks.

A query at t always selects its blocks 0, jt - 1 and jt (forced, docs/spec.md); the keys of the
last two, ``[max(jt - 1, 0) l', t]``, a window of w >= 2 l' holds too. Where the two branches
share k and v, the core asks the sliding backend for that softmax (``fn_with_local``) and hands
it to a selected backend whose one-step gated sum starts from it (``gated_local``); everywhere
else the sliding branch computes nothing more. The layer's output is the all-reference one
either way.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import nsa_core
from nsa_core import NSAConfig, ops
from nsa_kernels.common.local_softmax import LocalSoftmax, holds_local_keys, local_softmax_reference
from nsa_core.reference.combine import gated_combine_impl
from nsa_core.reference.selected_attention import selected_attention_impl
from nsa_core.reference.sliding_attention import sliding_attention_impl
from nsa_core.registry import Backend, OpContext, register_backend
from nsa_core.toggles import Toggles

CONFIG = NSAConfig(
    num_q_heads=4,
    num_kv_heads=2,
    head_dim_qk=8,
    head_dim_v=8,
    cmp_block=4,
    cmp_stride=2,
    sel_block=4,
    num_selected=3,
    window=8,
)
F64 = torch.float64


def accept(ctx: OpContext, toggles: Toggles) -> str | None:
    return None


class LocalSpy:
    """A sliding backend with ``fn_with_local`` (the reference window and the float64 local
    softmax) and a selected backend whose ``fn_gated`` records the local softmax it got and
    sums the three branches with the reference ops (differentiable: ``gated_grad``)."""

    def __init__(self, gated_local: bool = True) -> None:
        self.gated_local = gated_local
        self.local_calls = 0
        self.given: list[LocalSoftmax | None] = []

    def sliding_with_local(self, q: Any, k: Any, v: Any, window: int, scale: Any = None, *,
                           sel_block: int, toggles: Toggles, **kwargs: Any) -> Any:  # fmt: skip
        self.local_calls += 1
        o = sliding_attention_impl(q, k, v, window, scale, **kwargs)
        return o, local_softmax_reference(q, k, v, sel_block, scale, **kwargs)

    def gated(self, *args: Any, o_cmp: Any, o_win: Any, gates: Any, toggles: Toggles,
              local: LocalSoftmax | None = None, **kwargs: Any) -> Any:  # fmt: skip
        self.given.append(local)
        return gated_combine_impl(o_cmp, selected_attention_impl(*args, **kwargs), o_win, gates)

    def register(self) -> None:
        register_backend(
            Backend(
                "sliding_attention", "win_spy",
                lambda *a, toggles, **k: sliding_attention_impl(*a, **k), accept, priority=5,
                fn_with_local=self.sliding_with_local,
            )
        )  # fmt: skip
        register_backend(
            Backend(
                "selected_attention", "sel_spy",
                lambda *a, toggles, **k: selected_attention_impl(*a, **k), accept, priority=5,
                fn_gated=self.gated, gated_grad=True,
                gated_local=(lambda ctx: True) if self.gated_local else None,
            )
        )  # fmt: skip
        register_backend(
            Backend(
                "gated_combine", "combine_spy",
                lambda *a, toggles, **k: gated_combine_impl(*a, **k), accept, priority=5,
            )
        )  # fmt: skip


def _inputs(seed: int, t: int = 23) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, t, 4, 8, generator=gen, dtype=F64)
    k = torch.randn(1, t, 2, 8, generator=gen, dtype=F64)
    v = torch.randn(1, t, 2, 8, generator=gen, dtype=F64)
    gates = torch.rand(1, t, 4, 3, generator=gen, dtype=F64)
    return [q, k, v, gates]


@pytest.mark.usefixtures("isolated_registry")
def test_core_hands_the_local_softmax_to_a_gated_step_that_takes_it() -> None:
    q, k, v, gates = _inputs(0)
    want = nsa_core.nsa_attention(q, k, v, gates, CONFIG)  # all reference
    spy = LocalSpy()
    spy.register()
    with torch.no_grad():
        out = nsa_core.nsa_attention(q, k, v, gates, CONFIG)
    assert spy.local_calls == 1
    (local,) = spy.given
    assert local is not None
    assert local.sel_block == CONFIG.sel_block
    expected = local_softmax_reference(q, k, v, CONFIG.sel_block, CONFIG.softmax_scale)
    torch.testing.assert_close(local.o, expected.o, rtol=0, atol=0)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.usefixtures("isolated_registry")
@pytest.mark.parametrize(
    "why",
    ["branches own their keys", "window shorter than 2 l'", "no gated_local"],
)
def test_no_local_softmax_where_it_cannot_serve(why: str) -> None:
    """Separate keys per branch, a window that does not hold the local blocks, or a selected
    step that does not take their softmax: the sliding branch computes none and the gated step
    gets none."""
    q, k, v, gates = _inputs(1)
    config = CONFIG
    keys: Any = k
    values: Any = v
    if why == "branches own their keys":
        keys = {"cmp": k, "slc": k.clone(), "win": k}
        values = {"cmp": v, "slc": v, "win": v}
    elif why == "window shorter than 2 l'":
        config = dataclasses.replace(CONFIG, window=7)
    want = nsa_core.nsa_attention(q, keys, values, gates, config)
    spy = LocalSpy(gated_local=why != "no gated_local")
    spy.register()
    with torch.no_grad():
        out = nsa_core.nsa_attention(q, keys, values, gates, config)
    assert spy.local_calls == 0
    assert spy.given == [None]
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.usefixtures("isolated_registry")
def test_with_a_gradient_the_local_softmax_is_handed_over_and_gradients_flow() -> None:
    """The local softmax carries no gradient: the gradients are the all-reference ones."""
    inputs = _inputs(2)
    leaves = [t.clone().requires_grad_() for t in inputs]
    nsa_core.nsa_attention(*leaves, CONFIG).sum().backward()
    want = [t.grad for t in leaves]
    spy = LocalSpy()
    spy.register()
    leaves = [t.clone().requires_grad_() for t in inputs]
    nsa_core.nsa_attention(*leaves, CONFIG).sum().backward()
    assert spy.local_calls == 1
    assert spy.given[0] is not None
    for a, b in zip([t.grad for t in leaves], want, strict=True):
        assert a is not None
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.usefixtures("isolated_registry")
@pytest.mark.parametrize("gated_local", [True, False], ids=["taken", "not taken"])
def test_routing_report_says_where_the_sliding_branch_hands_over_its_softmax(
    gated_local: bool,
) -> None:
    from nsa_core.registry import routing_report

    LocalSpy(gated_local=gated_local).register()
    ctx = OpContext(
        device=torch.device("cpu"), dtype=F64, seq_len=23, num_q_heads=4, num_kv_heads=2,
        head_dim_qk=8, head_dim_v=8, requires_grad=False, varlen=False,
    )  # fmt: skip
    (line,) = [x for x in routing_report(ctx, Toggles()).splitlines() if "sliding_attention" in x]
    assert "win_spy" in line
    assert ("softmax over its forced blocks" in line) == gated_local


def test_the_local_keys_are_the_forced_blocks_keys() -> None:
    """The definition: row t attends to positions 0 .. l' - 1 and max(t // l' - 1, 0) l' .. t
    (those up to t), in one softmax (here against a loop over rows), restarting in every packed
    sequence."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 19, 2, 4, generator=gen, dtype=F64)
    k = torch.randn(1, 19, 1, 4, generator=gen, dtype=F64)
    v = torch.randn(1, 19, 1, 3, generator=gen, dtype=F64)
    cu = torch.tensor([0, 1, 12, 19], dtype=torch.int32)
    got = local_softmax_reference(q, k, v, 4, 0.5, cu_seqlens=cu)
    for start, end in ((0, 1), (1, 12), (12, 19)):
        for r in range(start, end):
            t = r - start
            lo = start + max(t // 4 - 1, 0) * 4
            keys = sorted(set(range(start, min(start + 4, r + 1))) | set(range(lo, r + 1)))
            s = torch.einsum("hd,nd->hn", q[0, r], k[0, keys, 0]) * 0.5
            torch.testing.assert_close(got.lse[0, r], torch.logsumexp(s, -1))
            torch.testing.assert_close(got.o[0, r], torch.softmax(s, -1) @ v[0, keys, 0])


def test_a_window_holds_the_local_keys_from_2_l_or_over_all_keys() -> None:
    assert holds_local_keys(128, 64, 10_000)
    assert not holds_local_keys(127, 64, 10_000)
    assert holds_local_keys(127, 64, 127)


def test_sliding_with_local_refuses_a_window_that_cannot_hold_them() -> None:
    q, k, v, _ = _inputs(4)
    with pytest.raises(ValueError, match="does not hold every row's local blocks"):
        ops.sliding_attention_with_local(q, k, v, 7, 4)
