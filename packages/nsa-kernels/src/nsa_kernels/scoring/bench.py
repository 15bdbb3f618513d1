"""A micro-bench of :func:`select_blocks_triton` for the benches in nsa-bench to call.

``bench_select_blocks(65536)`` times one call at the paper's shapes (B=1, HQ=64, H=4, dk=128,
l=32, d=16, l'=64, n=16, bf16) with the compressed branch's lse given (one pass) or not (two
passes) and reports the time and the rate of its q.k work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nsa_core.blocks import num_cmp_blocks
from nsa_kernels.scoring.function import ScoreConfig, select_blocks_triton


@dataclass(frozen=True)
class ScoreBench:
    """ms: median time of one call; qk_tflop: the q.k work of one pass (2 * B * HQ * dk *
    sum over rows of their visible blocks); tflops: qk_tflop * passes / time."""

    seq_len: int
    with_lse: bool
    ms: float
    qk_tflop: float
    tflops: float


def visible_pairs(seq_len: int, cmp_block: int, cmp_stride: int) -> int:
    """sum over t < seq_len of N_cmp(t + 1): the (row, block) pairs a head scores."""
    return sum(num_cmp_blocks(t + 1, cmp_block, cmp_stride) for t in range(seq_len))


def compressed_lse(
    q: torch.Tensor, k_cmp: torch.Tensor, cmp_block: int, cmp_stride: int
) -> torch.Tensor:
    """float32 [B, T, HQ]: the compressed branch's lse (float32 matmuls, 1024 rows at a time).

    Rows that see no block get -inf. Meant to set up benches, not as a reference.
    """
    batch, tq, hq, dk = q.shape
    group = hq // k_cmp.shape[2]
    keys = k_cmp.float().repeat_interleave(group, dim=2).permute(0, 2, 3, 1)  # [B, HQ, dk, N]
    blocks = torch.arange(k_cmp.shape[1], device=q.device)
    out = torch.empty(batch, tq, hq, dtype=torch.float32, device=q.device)
    for r0 in range(0, tq, 1024):
        r1 = min(tq, r0 + 1024)
        t = torch.arange(r0, r1, device=q.device)
        visible = blocks[None, :] * cmp_stride + cmp_block - 1 <= t[:, None]  # [C, N]
        logits = torch.matmul(q[:, r0:r1].float().transpose(1, 2), keys) * dk**-0.5
        logits = logits.masked_fill(~visible[None, None], float("-inf"))
        out[:, r0:r1] = torch.logsumexp(logits, dim=-1).transpose(1, 2)
    return out


def bench_select_blocks(
    seq_len: int,
    *,
    batch: int = 1,
    q_heads: int = 64,
    kv_heads: int = 4,
    head_dim: int = 128,
    cmp_block: int = 32,
    cmp_stride: int = 16,
    sel_block: int = 64,
    num_selected: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    with_lse: bool = True,
    config: ScoreConfig | None = None,
    seed: int = 0,
) -> ScoreBench:
    """Time select_blocks_triton on random inputs on the current CUDA device."""
    import triton.testing

    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, seq_len, q_heads, head_dim, device="cuda", generator=gen).to(dtype)
    num = num_cmp_blocks(seq_len, cmp_block, cmp_stride)
    k_cmp = torch.randn(batch, num, kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
    lse = compressed_lse(q, k_cmp, cmp_block, cmp_stride) if with_lse else None

    def call() -> None:
        select_blocks_triton(
            q, k_cmp, cmp_block, cmp_stride, sel_block, num_selected, lse=lse, config=config
        )

    ms = float(triton.testing.do_bench(call, warmup=5, rep=50, return_mode="median"))
    work = 2.0 * batch * q_heads * head_dim * visible_pairs(seq_len, cmp_block, cmp_stride)
    passes = 1 if with_lse else 2
    return ScoreBench(
        seq_len=seq_len,
        with_lse=with_lse,
        ms=ms,
        qk_tflop=work / 1e12,
        tflops=work * passes / (ms * 1e-3) / 1e12,
    )
