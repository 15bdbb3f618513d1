"""Block scoring on the compressed branch's own log-sum-exp, as the attention core runs it.

The Triton compressed kernel's lse has the convention ``select_blocks`` takes (float32
[B, Tq, HQ], natural log, the same scale, -inf on rows that see no block); given to the scoring
kernel it keeps the index contract of docs/spec.md, directly and through the public ops with the
Triton backends routed (under TRITON_INTERPRET=1 the test registers them for the CPU).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch
from kernel_testlib import DEVICE, SKIP_REASON
from scoring_testlib import Case, check, make_inputs, positions, reference_lse, reference_selection

pytestmark = [pytest.mark.triton, pytest.mark.skipif(DEVICE is None, reason=SKIP_REASON)]
pytest.importorskip("triton")

from nsa_core import NSAConfig, registry  # noqa: E402
from nsa_core.attention import branch_outputs  # noqa: E402
from nsa_core.registry import OpContext  # noqa: E402
from nsa_core.toggles import Toggles  # noqa: E402
from nsa_kernels.compressed.backends import backends as cmp_backends  # noqa: E402
from nsa_kernels.compressed.function import (  # noqa: E402
    compressed_attention_triton,
    compressed_attention_triton_with_lse,
)
from nsa_kernels.scoring.backends import backends as score_backends  # noqa: E402
from nsa_kernels.scoring.function import ScoreConfig, select_blocks_triton  # noqa: E402

TILES = {"block_rows": 64, "block_sel": 16}
CASES = [
    Case("dense_g3", tq=150, h=2, group=3, dk=24, n=5, config=TILES),
    # Chunked prefill: rows at 170 .. 259, k_cmp longer than they see.
    Case("q_start_chunk", tq=90, q_start=170, extra_cmp=7, h=1, group=2, dk=16, n=5,
         config=TILES),
    Case("varlen", tq=160, seqlens=[1, 70, 0, 80, 9], h=1, group=2, dk=16, n=5, config=TILES),
]  # fmt: skip


def _gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def _cmp_lse(
    case: Case, q: torch.Tensor, k: torch.Tensor, cu: torch.Tensor | None, gen: torch.Generator
) -> torch.Tensor:
    v = torch.randn(k.shape, generator=gen).to(k.device, k.dtype)
    o, lse = compressed_attention_triton_with_lse(
        q, k, v, case.cmp_block, case.cmp_stride, q_start=case.q_start, cu_seqlens=cu
    )
    # The output is the plain op's, bit for bit: exposing the lse changes no numerics.
    plain = compressed_attention_triton(
        q, k, v, case.cmp_block, case.cmp_stride, q_start=case.q_start, cu_seqlens=cu
    )
    assert torch.equal(o, plain)
    return lse


def _inputs_and_cmp_lse(
    case: Case, request: pytest.FixtureRequest
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """q [B, Tq, HQ, dk], k_cmp [B, N, H, dk], cu_seqlens and the compressed branch's lse
    [B, Tq, HQ] of ``case``, drawn from the test's own generator."""
    assert DEVICE is not None
    gen = _gen(request)
    q, k, cu = make_inputs(case, gen, torch.float32, DEVICE)
    return q, k, cu, _cmp_lse(case, q, k, cu, gen)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_compressed_lse_has_the_scoring_convention(
    case: Case, request: pytest.FixtureRequest
) -> None:
    q, k, cu, lse = _inputs_and_cmp_lse(case, request)
    want = reference_lse(case, q, k, cu)
    assert lse.dtype == torch.float32
    assert lse.shape == want.shape
    empty = torch.isneginf(want)
    # Rows before l - 1 (of each sequence) see no block; a chunk from q_start = 170 has none.
    assert bool(empty.any()) == (case.q_start < case.cmp_block - 1)
    assert torch.equal(torch.isneginf(lse), empty)
    torch.testing.assert_close(
        lse[~empty], want[~empty], rtol=0, atol=2e-6 * (1 + want.abs().max())
    )


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_scoring_on_the_compressed_lse_keeps_the_contract(
    case: Case, request: pytest.FixtureRequest
) -> None:
    q, k, cu, lse = _inputs_and_cmp_lse(case, request)
    args = (q, k, case.cmp_block, case.cmp_stride, case.sel_block, case.n)
    kw = {"q_start": case.q_start, "cu_seqlens": cu, "config": ScoreConfig(**case.config)}
    got = select_blocks_triton(*args, lse=lse, **kw)  # type: ignore[arg-type]
    check(case, got, reference_selection(case, q, k, cu), cu)
    own = select_blocks_triton(*args, **kw)  # type: ignore[arg-type]
    differ = (got[0] != own[0]).any(dim=-1)
    assert int(differ.sum()) <= max(1, differ.numel() // 100)


@pytest.fixture
def triton_routed_on_cpu() -> Iterator[None]:
    """The Triton compressed and scoring backends registered as serving this device."""

    def accept(ctx: OpContext, toggles: Toggles) -> str | None:
        return None

    with registry.isolated_registry():
        for backend in [*cmp_backends(), *score_backends()]:
            if backend.name in ("triton_cmp", "triton_score"):
                registry.register_backend(replace(backend, supports=accept))
        yield


@pytest.mark.usefixtures("triton_routed_on_cpu")
def test_attention_core_scores_on_the_compressed_lse(request: pytest.FixtureRequest) -> None:
    """branch_outputs: the compressed branch's lse reaches the scoring backend, whose indices keep
    the contract; the reference of the same call (its own normaliser) agrees."""
    case = CASES[0]
    assert DEVICE is not None
    gen = _gen(request)
    q, k, cu = make_inputs(case, gen, torch.float32, DEVICE)
    raw = torch.randn(1, case.tq, case.h, case.dk, generator=gen).to(DEVICE)
    cfg = NSAConfig(
        num_q_heads=case.h * case.group, num_kv_heads=case.h, head_dim_qk=case.dk,
        head_dim_v=case.dk, cmp_block=case.cmp_block, cmp_stride=case.cmp_stride,
        sel_block=case.sel_block, num_selected=case.n, window=16,
    )  # fmt: skip
    given: list[torch.Tensor | None] = []
    score = registry.backends("select_blocks")[0]
    assert score.name == "triton_score"

    def spy(*args: object, toggles: Toggles, **kwargs: object) -> object:
        lse = kwargs.get("lse")
        given.append(lse if isinstance(lse, torch.Tensor) else None)
        return score.fn(*args, toggles=toggles, **kwargs)

    registry.register_backend(replace(score, fn=spy))
    v_cmp = torch.randn(k.shape, generator=gen).to(DEVICE)
    o_cmp, _, _, indices = branch_outputs(cfg, q, k, v_cmp, raw, raw, raw, raw)
    assert len(given) == 1
    assert given[0] is not None
    torch.testing.assert_close(given[0], reference_lse(case, q, k, cu), rtol=0, atol=1e-4)
    counts = (indices >= 0).sum(-1).to(torch.int32)
    check(case, (indices, counts), reference_selection(case, q, k, cu), cu)
    assert positions(case, cu).shape[0] == case.tq
    assert o_cmp.shape == (1, case.tq, case.h * case.group, case.dk)
