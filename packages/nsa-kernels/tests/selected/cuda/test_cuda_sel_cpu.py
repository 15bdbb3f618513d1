"""The CUDA selection backend's Python side on a machine without a GPU: routing and errors."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from cuda_sel_testing import nsa_like_indices
from kernel_testlib import op_context

from nsa_core.toggles import Toggles
from nsa_kernels.selected import cuda as cuda_sel
from nsa_kernels.selected.cuda import backends, cuda_sel_supports, selected_attention_cuda
from nsa_kernels.selected.cuda.build import CSRC, SOURCES
from nsa_kernels.selected.cuda.selected import sequence_starts

# The calls this backend is built for: fp16 on a GPU, 1024 keys, forward only.
ctx = partial(op_context, device="cuda", dtype=torch.float16, seq_len=1024)


def test_backend_entry() -> None:
    (backend,) = backends()
    assert (backend.op, backend.name) == ("selected_attention", "cuda_sel")
    assert backend.fn is selected_attention_cuda
    assert backend.requested_by(Toggles(sel_cuda=True))
    assert not backend.requested_by(Toggles())


def test_supports_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    on = Toggles(sel_cuda=True)
    assert cuda_sel_supports(ctx(), Toggles()) == "NSA_SEL_CUDA is off"
    assert "CUDA device" in str(cuda_sel_supports(ctx(device="cpu"), on))
    assert "forward only" in str(cuda_sel_supports(ctx(grad=True), on))
    assert "float16 or bfloat16" in str(cuda_sel_supports(ctx(dtype=torch.float32), on))
    assert "head dims" in str(cuda_sel_supports(ctx(dk=320), on))
    assert "head dims" in str(cuda_sel_supports(ctx(dk=63), on))
    monkeypatch.setattr(cuda_sel, "build_unavailable_reason", lambda: None)
    assert cuda_sel_supports(ctx(), on) is None
    monkeypatch.setattr(cuda_sel, "build_unavailable_reason", lambda: "needs ninja")
    assert cuda_sel_supports(ctx(), on) == "needs ninja"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_clear_error_without_gpu() -> None:
    reason = cuda_sel.build_unavailable_reason()
    assert reason is not None
    assert "CUDA" in reason
    with pytest.raises(RuntimeError, match=r"cannot be built: .*CUDA"):
        cuda_sel.load_extension()
    # The kernel's inputs say what it needs before any build is tried: CUDA tensors.
    q = torch.zeros(1, 4, 2, 8, dtype=torch.float16)
    k = torch.zeros(1, 4, 1, 8, dtype=torch.float16)
    idx = torch.zeros(1, 4, 1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="q is on cpu: cuda_sel runs on CUDA tensors"):
        selected_attention_cuda(q, k, k, idx, 4)


def test_refuses_gradients_before_building() -> None:
    q = torch.zeros(1, 4, 2, 8, requires_grad=True)
    k = torch.zeros(1, 4, 1, 8)
    idx = torch.zeros(1, 4, 1, 2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="forward only"):
        selected_attention_cuda(q, k, k, idx, 4)


def test_sequence_starts() -> None:
    cu = torch.tensor([0, 3, 3, 7, 8], dtype=torch.int32)
    assert sequence_starts(cu).tolist() == [0, 0, 0, 3, 3, 3, 3, 7]
    assert sequence_starts(cu).dtype == torch.int32


def test_sources_ship_with_the_package() -> None:
    for name in (*SOURCES, "sel_fwd.h"):
        assert (CSRC / name).is_file(), name


def test_nsa_like_indices_follow_the_spec() -> None:
    idx = nsa_like_indices(2, 300, 3, 6, 16, 5, 20)
    t = torch.arange(5, 305).view(1, -1, 1)
    jt = t // 16
    live = idx >= 0
    assert bool(((idx * 16 <= t.unsqueeze(-1)) | ~live).all())
    for forced in (torch.zeros_like(jt), jt, (jt - 1).clamp_min(0)):
        assert bool((idx == forced.unsqueeze(-1)).any(-1).all())
    ascending = (idx[..., 1:] > idx[..., :-1]) | ~live[..., 1:]
    padding_last = live[..., :-1] | ~live[..., 1:]
    assert bool(ascending.all())
    assert bool(padding_last.all())
