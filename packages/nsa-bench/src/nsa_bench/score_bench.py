"""``nsa-bench score``: the Triton block-scoring kernel (``select_blocks_triton``) over T.

Defaults are the paper's shapes (B=1, HQ=64, H=4, dk=128, l=32, d=16, l'=64, n=16, bf16). Each
T is timed twice: with the compressed branch's lse given (one pass over the compressed keys)
and without it (two passes: one for the lse, one for the scores). Printed per row: median
milliseconds, the q.k work of one pass (TFLOP) and the rate (passes * work / time).
``--config "block_rows=64,warps=4"`` fixes a :class:`~nsa_kernels.scoring.function.ScoreConfig`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from nsa_bench import cli_args
from nsa_bench.cases import DTYPES
from nsa_bench.tables import write_dataclass_csv
from nsa_bench.timing import median_ms
from nsa_core.blocks import num_cmp_blocks


@dataclass(frozen=True)
class ScoreRow:
    """One timed (T, with_lse). ms: median of one call; qk_tflop: the q.k work of one pass
    (2 * B * HQ * dk * visible (row, block) pairs); tflops: qk_tflop * passes / time."""

    T: int
    with_lse: bool
    ms: float
    qk_tflop: float
    tflops: float

    def line(self) -> str:
        """The row as printed while the bench runs."""
        passes = "1 pass (lse given)" if self.with_lse else "2 passes"
        return (
            f"T={self.T:6d} {passes:18s} {self.ms:9.3f} ms  "
            f"{self.qk_tflop:8.4f} TFLOP/pass  {self.tflops:6.1f} TFLOP/s"
        )


def visible_pairs(seq_len: int, cmp_block: int, cmp_stride: int) -> int:
    """sum over t < seq_len of N_cmp(t + 1): the (row, block) pairs one head scores."""
    return sum(num_cmp_blocks(t + 1, cmp_block, cmp_stride) for t in range(seq_len))


def compressed_lse(
    q: torch.Tensor, k_cmp: torch.Tensor, cmp_block: int, cmp_stride: int
) -> torch.Tensor:
    """float32 [B, T, HQ]: the compressed branch's lse from q [B, T, HQ, dk] and
    k_cmp [B, N, H, dk] (float32 matmuls, 1024 rows at a time).

    Rows that see no block get -inf. It sets up the one-pass timing; it is not a reference.
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


def bench_one(args: argparse.Namespace, seq_len: int, with_lse: bool) -> ScoreRow:
    """Time select_blocks_triton on random inputs of ``seq_len`` tokens on ``args.device``."""
    from nsa_kernels.scoring.function import parse_config, select_blocks_triton

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    gen = torch.Generator(device=device).manual_seed(args.seed)
    batch, hq, h, dk = args.batch, args.heads, args.kv_heads, args.dk
    block, stride = args.cmp_block, args.cmp_stride
    q = torch.randn(batch, seq_len, hq, dk, device=device, generator=gen).to(dtype)
    num = num_cmp_blocks(seq_len, block, stride)
    k_cmp = torch.randn(batch, num, h, dk, device=device, generator=gen).to(dtype)
    lse = compressed_lse(q, k_cmp, block, stride) if with_lse else None
    config = parse_config(args.config) if args.config else None

    def call() -> object:
        return select_blocks_triton(
            q, k_cmp, block, stride, args.sel_block, args.num_selected, lse=lse, config=config
        )

    ms = median_ms(call, iters=args.iters, warmup=args.warmup, device=device)
    work = 2.0 * batch * hq * dk * visible_pairs(seq_len, block, stride)
    passes = 1 if with_lse else 2
    return ScoreRow(seq_len, with_lse, ms, work / 1e12, work * passes / (ms * 1e-3) / 1e12)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli_args.add_kernel_shape_args(parser)
    cli_args.add_compression_args(parser)
    cli_args.add_selection_args(parser)
    cli_args.add_dtype_arg(parser)
    parser.add_argument(
        "--lse",
        choices=("both", "given", "computed"),
        default="both",
        help="time with the lse given (one pass), computed by the kernel (two passes), or both",
    )
    parser.add_argument("--config", default="", help='ScoreConfig, e.g. "block_rows=64,warps=4"')
    cli_args.add_kernel_timing_args(parser)
    cli_args.add_device_arg(
        parser, "cpu runs the kernel under the Triton interpreter (TRITON_INTERPRET=1) only"
    )
    cli_args.add_seed_arg(parser)


def check_arguments(args: argparse.Namespace) -> None:
    """The kernel's device, and the rules of block scoring: heads that group, a stride that
    divides both block lengths; a tile config ScoreConfig knows."""
    if torch.device(args.device).type == "cpu" and not cli_args.triton_interpreted():
        raise cli_args.UsageError(
            f"the Triton scoring kernel needs a CUDA GPU ({cli_args.why_no_cuda(args.device)}), "
            "or TRITON_INTERPRET=1 to run Triton's interpreter on CPU"
        )
    cli_args.require_multiple(args.heads, "--heads", args.kv_heads, "--kv-heads")
    cli_args.require_multiple(args.cmp_block, "--cmp-block", args.cmp_stride, "--cmp-stride")
    cli_args.require_multiple(args.sel_block, "--sel-block", args.cmp_stride, "--cmp-stride")
    if args.config:
        from nsa_kernels.scoring.function import parse_config

        cli_args.check_tile_configs("--config", parse_config, [args.config])


def run(args: argparse.Namespace) -> int:
    modes = {"both": (True, False), "given": (True,), "computed": (False,)}[args.lse]
    rows = []
    for seq_len in args.seqlens:
        for with_lse in modes:
            row = bench_one(args, seq_len, with_lse)
            rows.append(row)
            print(row.line(), flush=True)
    if args.csv:
        write_dataclass_csv(Path(args.csv), rows)
    return 0
