"""The reference attention core hands the compressed branch's log-sum-exp to block scoring, and
the gated combine is a registry op like the others (NSA_COMBINE_BACKEND)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import nsa_core
from nsa_core import NSAConfig, ops, registry
from nsa_core.reference import compressed_attention as reference_compressed_attention
from nsa_core.reference.combine import gated_combine as reference_gated_combine
from nsa_core.reference.compressed_attention import compressed_attention_impl
from nsa_core.reference.selection import select_blocks_impl
from nsa_core.registry import Backend, OpContext, register_backend
from nsa_core.toggles import Toggles, reload_toggles

CONFIG = NSAConfig(
    num_q_heads=4,
    num_kv_heads=2,
    head_dim_qk=8,
    head_dim_v=8,
    cmp_block=4,
    cmp_stride=2,
    sel_block=4,
    num_selected=3,
    window=3,
)


@pytest.fixture
def restore_toggles(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    yield monkeypatch
    monkeypatch.undo()
    reload_toggles()


def accept(ctx: OpContext, toggles: Toggles) -> str | None:
    return None


def exact_lse(
    q: torch.Tensor, k_cmp: torch.Tensor, cmp_block: int, cmp_stride: int, scale: float | None
) -> torch.Tensor:
    """float32 [B, Tq, HQ]: log sum_i exp(scale q . k_cmp[i]) over the visible blocks (dense)."""
    group = q.shape[2] // k_cmp.shape[2]
    keys = k_cmp.repeat_interleave(group, dim=2).double()
    logits = torch.einsum("bthd,bnhd->bthn", q.double(), keys) * (scale or q.shape[-1] ** -0.5)
    t = torch.arange(q.shape[1])[:, None]
    visible = torch.arange(k_cmp.shape[1])[None, :] * cmp_stride + cmp_block - 1 <= t
    return torch.logsumexp(logits.masked_fill(~visible[None, :, None], float("-inf")), -1).float()


class Recorder:
    """A compressed backend with an lse (``fn_with_lse``) and a select_blocks spy."""

    def __init__(self) -> None:
        self.lse_given: list[torch.Tensor | None] = []
        self.lse_made: list[torch.Tensor] = []

    def cmp_with_lse(self, *args: Any, toggles: Toggles, **kwargs: Any) -> Any:
        q, k_cmp, _, cmp_block, cmp_stride, scale = args
        o = compressed_attention_impl(*args, **kwargs)
        # Tied to q's graph, so the test sees whether the core detaches it.
        lse = exact_lse(q, k_cmp, cmp_block, cmp_stride, scale) + 0 * q.sum(-1).float()
        self.lse_made.append(lse)
        return o, lse

    def select(self, *args: Any, toggles: Toggles, **kwargs: Any) -> Any:
        self.lse_given.append(kwargs.get("lse"))
        return select_blocks_impl(*args, **kwargs)


def _register(recorder: Recorder, *, with_lse: bool = True) -> None:
    register_backend(
        Backend(
            "compressed_attention",
            "cmp_spy",
            lambda *a, toggles, **k: compressed_attention_impl(*a, **k),
            accept,
            priority=5,
            fn_with_lse=recorder.cmp_with_lse if with_lse else None,
        )
    )
    register_backend(Backend("select_blocks", "score_spy", recorder.select, accept, priority=5))


def _inputs(gen: torch.Generator, t: int = 13) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randn(1, t, 4, 8, generator=gen, dtype=torch.float64).requires_grad_()
    k = torch.randn(1, t, 2, 8, generator=gen, dtype=torch.float64).requires_grad_()
    v = torch.randn(1, t, 2, 8, generator=gen, dtype=torch.float64).requires_grad_()
    return q, k, v


@pytest.mark.usefixtures("isolated_registry")
def test_core_hands_the_compressed_lse_to_block_scoring_detached(gen: torch.Generator) -> None:
    recorder = Recorder()
    _register(recorder)
    q, k, v = _inputs(gen)
    gates = torch.rand(1, q.shape[1], 4, 3, generator=gen, dtype=torch.float64)
    out = nsa_core.nsa_attention(q, k, v, gates, CONFIG)
    assert len(recorder.lse_given) == 1
    given = recorder.lse_given[0]
    assert given is not None
    assert recorder.lse_made[0].requires_grad
    assert not given.requires_grad
    assert torch.equal(given, recorder.lse_made[0].detach())
    # Rows before l - 1 see no compressed block: -inf, natural log, the config's scale.
    assert torch.isneginf(given[:, : CONFIG.cmp_block - 1]).all()
    assert torch.isfinite(given[:, CONFIG.cmp_block - 1 :]).all()
    # The reference select_blocks ignores the lse: the output is the all-reference output.
    with torch.no_grad():
        registry._backends["compressed_attention"] = [
            b for b in registry._backends["compressed_attention"] if b.name == "reference"
        ]
        registry._backends["select_blocks"] = [
            b for b in registry._backends["select_blocks"] if b.name == "reference"
        ]
        torch.testing.assert_close(out, nsa_core.nsa_attention(q, k, v, gates, CONFIG))
    out.sum().backward()  # the lse takes no part in the graph
    assert q.grad is not None
    assert torch.isfinite(q.grad).all()


@pytest.mark.usefixtures("isolated_registry")
def test_no_lse_without_fn_with_lse(gen: torch.Generator) -> None:
    recorder = Recorder()
    _register(recorder, with_lse=False)
    q, k, v = _inputs(gen)
    gates = torch.rand(1, q.shape[1], 4, 3, generator=gen, dtype=torch.float64)
    nsa_core.nsa_attention(q, k, v, gates, CONFIG)
    assert recorder.lse_given == [None]


@pytest.mark.usefixtures("isolated_registry")
def test_debug_hooks_run_fn_and_go_without_the_lse(
    gen: torch.Generator, restore_toggles: pytest.MonkeyPatch
) -> None:
    restore_toggles.setenv("NSA_DEBUG_SHAPES", "1")
    reload_toggles()
    recorder = Recorder()
    _register(recorder)
    q, k, v = _inputs(gen)
    o, lse = ops.compressed_attention_with_lse(q, *_cmp_keys(k, v), 4, 2)
    assert lse is None
    assert recorder.lse_made == []
    torch.testing.assert_close(o, reference_compressed_attention(q, *_cmp_keys(k, v), 4, 2))


def _cmp_keys(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return nsa_core.compress(k, 4, 2), nsa_core.compress(v, 4, 2)


def test_compressed_attention_with_lse_on_the_reference(gen: torch.Generator) -> None:
    """The reference has no lse: (its output, None), the output of compressed_attention."""
    q, k, v = _inputs(gen)
    o, lse = ops.compressed_attention_with_lse(q, *_cmp_keys(k, v), 4, 2)
    assert lse is None
    assert torch.equal(o, ops.compressed_attention(q, *_cmp_keys(k, v), 4, 2))


def test_reference_select_blocks_ignores_the_lse(gen: torch.Generator) -> None:
    q, k, _ = _inputs(gen, t=40)
    k_cmp = nsa_core.compress(k, 4, 2)
    want = ops.select_blocks(q, k_cmp, 4, 2, 4, 3)
    garbage = torch.randn(q.shape[:3], generator=gen).float() * 100
    got = ops.select_blocks(q, k_cmp, 4, 2, 4, 3, lse=garbage)
    assert torch.equal(got[0], want[0])
    assert torch.equal(got[1], want[1])


@pytest.mark.parametrize(
    ("lse", "error", "match"),
    [
        ("not a tensor", TypeError, "lse must be a float32 tensor"),
        (torch.zeros(1, 40, 4, dtype=torch.float64), TypeError, "lse must be float32"),
        (torch.zeros(1, 40, 2), ValueError, r"must be \[B, Tq, HQ\]"),
        (torch.zeros(1, 39, 4), ValueError, r"must be \[B, Tq, HQ\]"),
        (torch.zeros(1, 40, 4, device="meta"), ValueError, "lse is on meta"),
    ],
)
def test_select_blocks_checks_the_lse(
    gen: torch.Generator, lse: Any, error: type[Exception], match: str
) -> None:
    q, k, _ = _inputs(gen, t=40)
    k_cmp = nsa_core.compress(k, 4, 2)
    with pytest.raises(error, match=match):
        ops.select_blocks(q, k_cmp, 4, 2, 4, 3, lse=lse)


# ----------------------------------------------------------------------------- gated combine


def _branches(gen: torch.Generator, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    shape = (2, 5, 3, 4)
    outs = [torch.randn(shape, generator=gen, dtype=dtype) for _ in range(3)]
    return [*outs, torch.rand(*shape[:3], 3, generator=gen, dtype=dtype)]


def test_public_gated_combine_is_the_routed_op(gen: torch.Generator) -> None:
    assert nsa_core.gated_combine is ops.gated_combine
    inputs = [x.requires_grad_() for x in _branches(gen)]
    out = nsa_core.gated_combine(*inputs)
    assert torch.equal(out, reference_gated_combine(*inputs))
    out.sum().backward()
    assert all(x.grad is not None for x in inputs)


@pytest.mark.usefixtures("isolated_registry")
def test_gated_combine_runs_the_backend_the_registry_picks(
    gen: torch.Generator, restore_toggles: pytest.MonkeyPatch
) -> None:
    calls: list[OpContext | None] = []

    def spy(*args: Any, toggles: Toggles) -> torch.Tensor:
        calls.append(None)
        return reference_gated_combine(*args) * 2

    register_backend(Backend("gated_combine", "spy", spy, accept, priority=5))
    inputs = _branches(gen)
    assert torch.equal(ops.gated_combine(*inputs), 2 * reference_gated_combine(*inputs))
    assert len(calls) == 1
    restore_toggles.setenv("NSA_COMBINE_BACKEND", "reference")
    reload_toggles()
    assert torch.equal(ops.gated_combine(*inputs), reference_gated_combine(*inputs))
    assert len(calls) == 1
    report = registry.routing_report(
        ops.op_context(inputs[0], inputs[0], inputs[0], 5, varlen=False), Toggles()
    )
    assert "gated_combine          -> spy" in report


@pytest.mark.usefixtures("isolated_registry")
def test_module_combines_through_the_registry(gen: torch.Generator) -> None:
    seen: list[tuple[int, ...]] = []

    def spy(*args: Any, toggles: Toggles) -> torch.Tensor:
        seen.append(tuple(args[0].shape))
        return reference_gated_combine(*args)

    register_backend(Backend("gated_combine", "spy", spy, accept, priority=5))
    layer = nsa_core.NSAAttention(CONFIG, 16).double()
    x = torch.randn(1, 9, 16, generator=gen, dtype=torch.float64)
    layer(x)
    _, cache = layer.prefill(x)
    layer.decode(x[:, :1], cache)
    assert seen == [(1, 9, 4, 8), (1, 9, 4, 8), (1, 1, 4, 8)]


def test_gated_combine_checks_its_arguments(gen: torch.Generator) -> None:
    o_cmp, o_sel, o_win, gates = _branches(gen)
    with pytest.raises(ValueError, match="gates"):
        ops.gated_combine(o_cmp, o_sel, o_win, gates[..., :2])
    with pytest.raises(TypeError, match="dtype"):
        ops.gated_combine(o_cmp, o_sel.float(), o_win, gates)
