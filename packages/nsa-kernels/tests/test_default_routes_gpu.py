"""On a GPU with no toggle set, every NSA step runs on a GPU backend, and the public ops use it."""

from __future__ import annotations

import pytest
import torch

from nsa_core import registry, selected_attention
from nsa_core.ops import op_context
from nsa_core.reference import select_blocks as select_blocks_reference
from nsa_core.toggles import Toggles

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.usefixtures("kernels_registered"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _ctx(dtype: torch.dtype) -> registry.OpContext:
    q = torch.empty(1, 4096, 64, 128, device="cuda", dtype=dtype)
    k = torch.empty(1, 4096, 4, 128, device="cuda", dtype=dtype)
    return op_context(q, k, k, 4096, varlen=False)


def test_default_routes_on_cuda_are_gpu_backends() -> None:
    report = registry.routing_report(_ctx(torch.bfloat16), Toggles())
    print(report)
    chosen = dict(
        (line.split("->")[0].strip(), line.split("->")[1].split()[0])
        for line in report.splitlines()
    )
    assert chosen["select_blocks"] == "triton_score"
    assert chosen["compressed_attention"] in ("fa2", "triton_cmp")
    assert chosen["selected_attention"] == "triton_sel"
    assert chosen["sliding_attention"] in ("fa2", "triton_win")


def test_float64_and_pinned_reference_run_the_reference() -> None:
    report = registry.routing_report(_ctx(torch.float64), Toggles())
    assert all(line.split("->")[1].split()[0] == "reference" for line in report.splitlines())
    pinned = Toggles(sel_backend="reference")
    res = registry.resolve("selected_attention", _ctx(torch.bfloat16), pinned)
    assert res.backend.name == "reference"


def test_public_selected_attention_runs_the_triton_kernel() -> None:
    from nsa_kernels.selected.function import selected_attention_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    t, hq, h, d, l_sel = 512, 8, 2, 64, 64
    q = torch.randn(1, t, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(1, t, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(1, t, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_cmp = k.view(1, t // 16, 16, h, d).float().mean(2).to(torch.bfloat16)
    idx, _ = select_blocks_reference(q, k_cmp, 16, 16, l_sel, 4)
    out = selected_attention(q, k, v, idx, l_sel)
    # Bit-equal to the Triton kernel called by name: the public op dispatched to it.
    assert torch.equal(out, selected_attention_triton(q, k, v, idx, l_sel))
