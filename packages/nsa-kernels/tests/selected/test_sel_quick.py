"""The quick-sanity entry points (sel_attn_fwd_dense, sel_attn_fwd_varlen) against a plain torch
softmax."""

from __future__ import annotations

import zlib

import pytest
import torch
from kernel_testlib import BOUND, DEVICE, SKIP_REASON, rel_err

pytestmark = [pytest.mark.triton, pytest.mark.skipif(DEVICE is None, reason=SKIP_REASON)]
pytest.importorskip("triton")

from nsa_kernels.selected.quick import sel_attn_fwd_dense, sel_attn_fwd_varlen  # noqa: E402


def _gen(request: pytest.FixtureRequest) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def _softmax_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [H, D], k [L, D], v [L, Dv] -> [H, Dv] in float64 (zeros when L == 0)."""
    if k.shape[0] == 0:
        return torch.zeros(q.shape[0], v.shape[1], dtype=torch.float64)
    scores = q.double() @ k.double().T * q.shape[-1] ** -0.5
    return torch.softmax(scores, dim=-1) @ v.double()


def test_dense_rows_attend_to_their_own_keys(request: pytest.FixtureRequest) -> None:
    assert DEVICE is not None
    gen = _gen(request)
    n, h, d, dv, length = 3, 4, 32, 16, 40  # 40 keys: a partial second tile of 32
    q, k, v = (torch.randn(*s, generator=gen) for s in ((n, h, d), (n, length, d), (n, length, dv)))
    out = sel_attn_fwd_dense(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), block_l=32)
    ref = torch.stack([_softmax_attend(q[i], k[i], v[i]) for i in range(n)])
    assert out.shape == (n, h, dv)
    assert rel_err(out, ref) < BOUND[torch.float32]


def test_varlen_rows_attend_to_their_range(request: pytest.FixtureRequest) -> None:
    assert DEVICE is not None
    gen = _gen(request)
    bounds = [0, 5, 5, 38, 39]  # lengths 5, 0 (empty: output 0), 33, 1
    n, h, d, dv = 4, 2, 16, 32
    total = bounds[-1]
    q = torch.randn(n, h, d, generator=gen)
    k = torch.randn(total, d, generator=gen)
    v = torch.randn(total, dv, generator=gen)
    cu = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    out = sel_attn_fwd_varlen(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), cu, block_l=16)
    ref = torch.stack(
        [
            _softmax_attend(q[i], k[bounds[i] : bounds[i + 1]], v[bounds[i] : bounds[i + 1]])
            for i in range(n)
        ]
    )
    assert rel_err(out, ref) < BOUND[torch.float32]
    assert torch.count_nonzero(out[1].cpu()) == 0


def test_varlen_rejects_bad_cu_seqlens() -> None:
    assert DEVICE is not None
    q = torch.zeros(2, 1, 16, device=DEVICE)
    k = torch.zeros(4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="cu_seqlens"):
        sel_attn_fwd_varlen(q, k, k, torch.tensor([0, 3, 2], dtype=torch.int32, device=DEVICE))
