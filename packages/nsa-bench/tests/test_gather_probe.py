"""The gather probe of ``nsa-bench sel --probe``: it reads what the forward reads.

Marked ``triton``: on CPU it needs the interpreter (TRITON_INTERPRET=1, the interpreter tier), on
a GPU it compiles.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytest.importorskip("triton")

from nsa_bench.gather_probe import gather_probe_kernel, run_probe

RUNS_TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(
        not RUNS_TRITON, reason="needs a CUDA GPU or the Triton interpreter (TRITON_INTERPRET=1)"
    ),
]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
T, H, D, SEL, N, ROWS = 34, 1, 16, 16, 2, 16


def _problem() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k, v [1, T, H, D] float32 and idx [1, T, H, N]: each row's own block, then block 0 or -1.

    K and V hold small integers, so every sum is exact in float32 whatever order the kernel adds
    in: a wrong key shows as a wrong integer, not as rounding."""
    gen = torch.Generator().manual_seed(3)
    k = torch.randint(-8, 9, (1, T, H, D), generator=gen).float().to(DEVICE)
    v = torch.randint(-8, 9, (1, T, H, D), generator=gen).float().to(DEVICE)
    own = (torch.arange(T) // SEL).view(1, T, 1, 1).expand(1, T, H, 1)
    other = torch.where(own > 0, 0, -1)
    idx = torch.cat([own, other], dim=-1).to(torch.int32).to(DEVICE).contiguous()
    return k, v, idx


def test_pointer_loads_sum_exactly_the_visible_keys() -> None:
    k, v, idx = _problem()
    out = torch.empty(T, H, 2 * D, device=DEVICE)
    gather_probe_kernel[(T, H)](
        k, v, idx, out, k, v, k.stride(1), v.stride(1), idx.stride(1), N,
        H=H, DK=D, DV=D, SEL=SEL, BL=SEL, ROWS=ROWS, DOT=False, TMA=False,
    )  # fmt: skip
    want = torch.zeros(T, H, 2 * D)
    kv = torch.cat([k, v], dim=-1)[0].cpu()
    for t in range(T):
        for h in range(H):
            for blk in idx[0, t, h].tolist():
                if blk >= 0:
                    want[t, h] += kv[blk * SEL : min((blk + 1) * SEL, t + 1), h].sum(0)
    torch.testing.assert_close(out.cpu(), ROWS * want)


@pytest.mark.skipif(
    importlib.util.find_spec("triton.tools.tensor_descriptor") is None,
    reason="this triton has no host tensor descriptors (< 3.4), which the probe's TMA loads need",
)
def test_every_variant_runs() -> None:
    """Pointer loads with and without dots, TMA loads: each launches and is timed."""
    k, v, idx = _problem()
    variants = [(4, 2, 16, 1, 0), (4, 2, 16, 0, 0), (4, 2, 16, 1, 1)]
    results = run_probe(k, v, idx, SEL, lambda launch: 1.0, variants)
    assert [name for name, _, _ in results] == [
        "dot/w4/s2/bl16",
        "sum/w4/s2/bl16",
        "dot/w4/s2/bl16/tma",
    ]
    assert all(ms == 1.0 for _, ms, _ in results)
