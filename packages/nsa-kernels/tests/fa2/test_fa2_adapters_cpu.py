"""The FA-2 adapters end to end on CPU, flash_attn replaced by a float64 model of its semantics.

Everything the adapters do around FA-2 (head-dim padding, the compressed fold, varlen packing, the
force toggles, q_start) runs for real and is compared with the nsa-core reference: float32 inputs
within docs/spec.md's 1e-5 of the float64 reference, float64 gradients equal to the reference's.
"""

from __future__ import annotations

import fa2_fake_flash
import pytest
import torch
from fa2_testing import FLOAT32_BOUND, cu_seqlens_of, randn, rel_err, toggles

from nsa_core.blocks import cmp_cu_seqlens, num_cmp_blocks
from nsa_core.reference import compressed_attention, sliding_attention
from nsa_kernels.common import flash as _flash
from nsa_kernels.compressed.fa2 import compressed_attention_fa2
from nsa_kernels.sliding.fa2 import sliding_attention_fa2

PATHS = ["auto", "force_varlen", "force_dense"]


@pytest.fixture(autouse=True)
def fake_flash_attn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_flash, "_module", fa2_fake_flash)
    fa2_fake_flash.calls.clear()


def _toggles_for(path: str) -> dict[str, str]:
    return {} if path == "auto" else {path.replace("force_", "debug_fa2_"): "1"}


def _expected_entry(path: str, varlen: bool) -> str:
    if path == "force_varlen":
        return "varlen"
    if path == "force_dense":
        return "dense"
    return "varlen" if varlen else "dense"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    ("tq", "q_start", "extra_keys", "window"),
    [(37, 0, 0, 8), (37, 0, 0, 100), (20, 13, 4, 6), (1, 50, 0, 16), (1, 3, 0, 16), (64, 0, 0, 1)],
)
def test_sliding_dense_matches_reference(
    path: str, tq: int, q_start: int, extra_keys: int, window: int
) -> None:
    b, hq, h, dk, dv = 2, 6, 2, 12, 8  # dk != dv and dk % 8 != 0: both paddings run
    q = randn(b, tq, hq, dk, dtype=torch.float32)
    k = randn(b, q_start + tq + extra_keys, h, dk, dtype=torch.float32)
    v = randn(b, q_start + tq + extra_keys, h, dv, dtype=torch.float32)
    ref = sliding_attention(q.double(), k.double(), v.double(), window, q_start=q_start)
    with toggles(**_toggles_for(path)):
        out = sliding_attention_fa2(q, k, v, window, q_start=q_start)
    assert out.shape == (b, tq, hq, dv)
    assert out.dtype == q.dtype
    assert rel_err(out, ref) < FLOAT32_BOUND
    expected = "varlen" if path == "force_varlen" else "dense"
    assert fa2_fake_flash.calls == [expected]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("window", [1, 5, 40])
def test_sliding_varlen_matches_reference(path: str, window: int) -> None:
    lengths = [17, 0, 1, 33, 6]
    cu = cu_seqlens_of(lengths)
    total = sum(lengths)
    q = randn(1, total, 4, 16, dtype=torch.float32)
    k = randn(1, total, 2, 16, dtype=torch.float32)
    v = randn(1, total, 2, 16, dtype=torch.float32)
    ref = sliding_attention(q.double(), k.double(), v.double(), window, cu_seqlens=cu)
    with toggles(**_toggles_for(path)):
        out = sliding_attention_fa2(q, k, v, window, cu_seqlens=cu)
    assert rel_err(out, ref) < FLOAT32_BOUND
    assert fa2_fake_flash.calls == [_expected_entry(path, varlen=True)]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("cl", "d"), [(8, 4), (4, 4), (6, 2), (2, 1)])
@pytest.mark.parametrize(("tq", "q_start"), [(45, 0), (30, 11), (1, 40), (1, 7), (1, 2), (5, 0)])
def test_compressed_dense_matches_reference(
    path: str, cl: int, d: int, tq: int, q_start: int
) -> None:
    b, hq, h, dk, dv = 2, 4, 2, 8, 12
    n = num_cmp_blocks(q_start + tq, cl, d) + 1  # one block more than needed: must stay unseen
    q = randn(b, tq, hq, dk, dtype=torch.float32)
    kc = randn(b, n, h, dk, dtype=torch.float32)
    vc = randn(b, n, h, dv, dtype=torch.float32)
    ref = compressed_attention(q.double(), kc.double(), vc.double(), cl, d, q_start=q_start)
    with toggles(**_toggles_for(path)):
        out = compressed_attention_fa2(q, kc, vc, cl, d, q_start=q_start)
    assert out.shape == (b, tq, hq, dv)
    if ref.abs().sum() == 0:  # no query sees a block: zeros without calling FA-2
        assert torch.equal(out, torch.zeros_like(out))
        assert fa2_fake_flash.calls == []
    else:
        assert rel_err(out, ref) < FLOAT32_BOUND
        expected = "varlen" if path == "force_varlen" else "dense"
        assert fa2_fake_flash.calls == [expected]
    blind = torch.arange(q_start, q_start + tq) < cl - 1
    assert torch.equal(out[:, blind], torch.zeros_like(out[:, blind]))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("cl", "d"), [(8, 4), (4, 2), (3, 3)])
def test_compressed_varlen_matches_reference(path: str, cl: int, d: int) -> None:
    lengths = [0, 2, cl - 1, cl, 3 * cl + 1, 1, 5 * cl + d - 1]
    cu = cu_seqlens_of(lengths)
    n = int(cmp_cu_seqlens(cu, cl, d)[-1])
    q = randn(1, sum(lengths), 6, 8, dtype=torch.float32)
    kc = randn(1, n, 3, 8, dtype=torch.float32)
    vc = randn(1, n, 3, 4, dtype=torch.float32)
    ref = compressed_attention(q.double(), kc.double(), vc.double(), cl, d, cu_seqlens=cu)
    with toggles(**_toggles_for(path)):
        out = compressed_attention_fa2(q, kc, vc, cl, d, cu_seqlens=cu)
    assert rel_err(out, ref) < FLOAT32_BOUND
    assert fa2_fake_flash.calls == [_expected_entry(path, varlen=True)]
    assert not torch.isnan(out).any()


def test_compressed_varlen_with_no_visible_block_gives_zeros() -> None:
    cu = cu_seqlens_of([3, 0, 7])
    q = randn(1, 10, 2, 8, dtype=torch.float32)
    kc = randn(1, 0, 1, 8, dtype=torch.float32)
    out = compressed_attention_fa2(q, kc, kc, 8, 4, cu_seqlens=cu)
    assert torch.equal(out, torch.zeros_like(out))


def test_compressed_refuses_too_few_blocks() -> None:
    q = randn(1, 40, 2, 8, dtype=torch.float32)
    kc = randn(1, num_cmp_blocks(40, 8, 4) - 1, 1, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="k_cmp holds"):
        compressed_attention_fa2(q, kc, kc, 8, 4)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("branch", ["sliding", "compressed"])
def test_gradients_match_reference(path: str, branch: str) -> None:
    """float64 through the fake: the adapters' padding, folding and packing are differentiable."""
    cl, d, window = 8, 4, 6
    cu = cu_seqlens_of([11, 26, 3])
    total = int(cu[-1])
    n = total if branch == "sliding" else int(cmp_cu_seqlens(cu, cl, d)[-1])
    inputs = (
        randn(1, total, 4, 12, dtype=torch.float64, grad=True),
        randn(1, n, 2, 12, dtype=torch.float64, grad=True),
        randn(1, n, 2, 8, dtype=torch.float64, grad=True),
    )

    def attend(adapter: bool) -> torch.Tensor:
        if branch == "sliding":
            win = sliding_attention_fa2 if adapter else sliding_attention
            return win(*inputs, window, cu_seqlens=cu)
        cmp = compressed_attention_fa2 if adapter else compressed_attention
        return cmp(*inputs, cl, d, cu_seqlens=cu)

    grad_out = torch.randn(1, total, 4, 8, dtype=torch.float64)
    with toggles(**_toggles_for(path)):
        grads = torch.autograd.grad(attend(adapter=True), inputs, grad_out)
    assert fa2_fake_flash.calls == [_expected_entry(path, varlen=True)]
    ref_grads = torch.autograd.grad(attend(adapter=False), inputs, grad_out)
    for got, want in zip(grads, ref_grads, strict=True):
        assert rel_err(got, want) < 1e-12


def test_dense_gradients_with_q_start() -> None:
    cl, d, q_start, tq = 8, 4, 9, 23
    n = num_cmp_blocks(q_start + tq, cl, d)
    q = randn(2, tq, 4, 8, dtype=torch.float64, grad=True)
    kc = randn(2, n, 2, 8, dtype=torch.float64, grad=True)
    vc = randn(2, n, 2, 8, dtype=torch.float64, grad=True)
    grad_out = torch.randn(2, tq, 4, 8, dtype=torch.float64)
    got = torch.autograd.grad(
        compressed_attention_fa2(q, kc, vc, cl, d, q_start=q_start), (q, kc, vc), grad_out
    )
    want = torch.autograd.grad(
        compressed_attention(q, kc, vc, cl, d, q_start=q_start), (q, kc, vc), grad_out
    )
    for a, b in zip(got, want, strict=True):
        assert rel_err(a, b) < 1e-12
