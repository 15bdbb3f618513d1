"""Timings of the Triton compressed attention (forward, backward, both) over T, on one GPU.

``python -m nsa_kernels.compressed.triton_bench`` runs B=1, HQ=64, H=4, dk=dv=128, l=32,
d=16, bf16 at T = 8k, 16k, 32k, 64k (all configurable) and prints one row per (T, method, config):
median milliseconds (``triton.testing.do_bench``) of the forward, of the backward alone (from
the forward's o and lse) and of forward+backward, with the forward's matmul TFLOP/s. Baselines on
request (``--baselines reference,sdpa``, up to ``--baseline-max-t`` tokens): nsa_core's
reference op (chunked einsums) and a chunked SDPA call with a boolean visibility mask (timing
only: rows that see no block come out NaN there). ``--configs "block_m=64;dkv_block_n=128"``
times each :class:`~nsa_kernels.compressed.triton_function.CmpConfig` (fields left out keep
their defaults); ``--csv PATH`` writes the rows.
"""

from __future__ import annotations

import argparse
import csv
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from nsa_core.blocks import num_cmp_blocks
from nsa_kernels.compressed.triton_function import (
    CmpConfig,
    attention_flops,
    compressed_attention_bwd,
    compressed_attention_fwd,
    compressed_attention_triton,
    parse_config,
    resolve_config,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Forward + backward matmuls: 2 forward (q.k, p.v), 5 backward (q.k again, do.v, p^T.do,
# ds.k, ds^T.q).
FWD_BWD_FLOP_FACTOR = 3.5


@dataclass
class Row:
    """One timed (T, method, config)."""

    T: int
    blocks: int
    method: str
    config: str
    fwd_ms: float
    bwd_ms: float
    fwd_bwd_ms: float
    fwd_tflops: float
    fwd_bwd_tflops: float


def _median_ms(fn: Callable[[], object], grads: Sequence[torch.Tensor] = ()) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, grad_to_none=list(grads), return_mode="median"))


def sdpa_chunked(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    cmp_block: int,
    cmp_stride: int,
    chunk: int = 4096,
) -> torch.Tensor:
    """Baseline: SDPA over query chunks with the visibility mask ``i*d + l - 1 <= t``.

    q [B, T, HQ, dk], k_cmp [B, N, H, dk], v_cmp [B, N, H, dv] -> [B, T, HQ, dv]; K/V expanded
    to HQ heads. Rows that see no block are NaN (SDPA's softmax over an empty row).
    """
    group = q.shape[2] // k_cmp.shape[2]
    qh = q.transpose(1, 2)
    kh = k_cmp.transpose(1, 2).repeat_interleave(group, dim=1)
    vh = v_cmp.transpose(1, 2).repeat_interleave(group, dim=1)
    last = torch.arange(k_cmp.shape[1], device=q.device) * cmp_stride + cmp_block - 1
    outs = []
    for c0 in range(0, q.shape[1], chunk):
        pos = torch.arange(c0, min(q.shape[1], c0 + chunk), device=q.device)
        mask = last[None, :] <= pos[:, None]
        outs.append(F.scaled_dot_product_attention(qh[:, :, c0 : c0 + chunk], kh, vh, mask))
    return torch.cat(outs, dim=2).transpose(1, 2)


def bench_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    cmp_block: int,
    cmp_stride: int,
    config: CmpConfig,
) -> tuple[float, float, float]:
    """(forward, backward alone, forward+backward) median ms of the Triton kernels."""

    def fwd() -> object:
        return compressed_attention_fwd(q, k, v, cmp_block, cmp_stride, config=config)

    o, lse = compressed_attention_fwd(q, k, v, cmp_block, cmp_stride, config=config)

    def bwd() -> object:
        return compressed_attention_bwd(do, q, k, v, o, lse, cmp_block, cmp_stride, config=config)

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def both() -> None:
        out = compressed_attention_triton(
            leaves[0], leaves[1], leaves[2], cmp_block, cmp_stride, config=config
        )
        torch.autograd.backward(out, do)

    return _median_ms(fwd), _median_ms(bwd), _median_ms(both, leaves)


def bench_baseline(
    method: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    cmp_block: int,
    cmp_stride: int,
) -> tuple[float, float, float]:
    """(forward, nan, forward+backward) median ms of a baseline."""
    from nsa_core.reference.compressed_attention import compressed_attention

    def call(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        if method == "reference":
            return compressed_attention(a, b, c, cmp_block, cmp_stride)
        return sdpa_chunked(a, b, c, cmp_block, cmp_stride)

    def fwd() -> object:
        with torch.no_grad():
            return call(q, k, v)

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def both() -> None:
        torch.autograd.backward(call(leaves[0], leaves[1], leaves[2]), do)

    return _median_ms(fwd), math.nan, _median_ms(both, leaves)


def run(args: argparse.Namespace) -> list[Row]:
    dtype = DTYPES[args.dtype]
    device = torch.device(args.device)
    configs = [parse_config(text) for text in args.configs.split(";")] if args.configs else []
    rows = []
    for tq in (int(x) for x in args.T.split(",")):
        gen = torch.Generator(device=device).manual_seed(tq)
        blocks = num_cmp_blocks(tq, args.l, args.d)
        hq, h = args.hq, args.h
        q = torch.randn(args.B, tq, hq, args.dk, device=device, generator=gen).to(dtype)
        k = torch.randn(args.B, blocks, h, args.dk, device=device, generator=gen).to(dtype)
        v = torch.randn(args.B, blocks, h, args.dv, device=device, generator=gen).to(dtype)
        do = torch.randn(args.B, tq, hq, args.dv, device=device, generator=gen).to(dtype)
        flops = attention_flops(args.B, tq, hq, args.dk, args.dv, args.l, args.d)
        timed: list[tuple[str, str, tuple[float, float, float]]] = []
        for config in configs or [CmpConfig()]:
            shown = resolve_config(config, args.dk, args.dv, dtype).describe()
            timed.append(("triton", shown, bench_triton(q, k, v, do, args.l, args.d, config)))
        for method in filter(None, args.baselines.split(",")):
            if tq <= args.baseline_max_t:
                timed.append((method, "", bench_baseline(method, q, k, v, do, args.l, args.d)))
        for method, shown, (fwd_ms, bwd_ms, both_ms) in timed:
            rows.append(
                Row(
                    T=tq,
                    blocks=blocks,
                    method=method,
                    config=shown,
                    fwd_ms=fwd_ms,
                    bwd_ms=bwd_ms,
                    fwd_bwd_ms=both_ms,
                    fwd_tflops=flops / fwd_ms * 1e-9,
                    fwd_bwd_tflops=FWD_BWD_FLOP_FACTOR * flops / both_ms * 1e-9,
                )
            )
            print(
                f"T={tq:6d} N={blocks:5d} {method:9s} fwd {fwd_ms:8.3f} ms "
                f"({rows[-1].fwd_tflops:5.0f} TFLOP/s)  bwd {bwd_ms:8.3f} ms  "
                f"fwd+bwd {both_ms:8.3f} ms ({rows[-1].fwd_bwd_tflops:5.0f} TFLOP/s)  {shown}",
                flush=True,
            )
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--T", default="8192,16384,32768,65536", help="comma-separated tokens")
    parser.add_argument("--B", type=int, default=1)
    parser.add_argument("--hq", type=int, default=64)
    parser.add_argument("--h", type=int, default=4)
    parser.add_argument("--dk", type=int, default=128)
    parser.add_argument("--dv", type=int, default=128)
    parser.add_argument("--l", type=int, default=32, help="compression block length")
    parser.add_argument("--d", type=int, default=16, help="compression stride")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--configs", default="", help='CmpConfig strings separated by ";"')
    parser.add_argument("--baselines", default="", help="comma-separated: reference, sdpa")
    parser.add_argument("--baseline-max-t", type=int, default=16384)
    parser.add_argument("--csv", default="", help="write the rows to this CSV file")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    rows = run(args)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
            writer.writeheader()
            writer.writerows(asdict(r) for r in rows)


if __name__ == "__main__":
    main()
