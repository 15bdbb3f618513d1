"""``nsa-bench cmp``: the Triton compressed attention (forward, backward, both) over T.

Defaults: B=1, HQ=64, H=4, dk=dv=128, l=32, d=16, bf16 at T = 8k, 16k, 32k, 64k. One row per
(T, method, config): median milliseconds of the forward, of the backward alone (from the
forward's o and lse; Triton only) and of forward+backward, with the matmul TFLOP/s of each.
Methods: ``triton`` (nsa-kernels), ``reference`` (nsa_core's chunked einsums) and ``sdpa`` (a
chunked SDPA call with a boolean visibility mask; for timing only: rows that see no block come
out NaN or 0 there, by SDPA backend); methods other than triton run up to ``--baseline-max-t``
tokens. ``--configs "block_m=64;dkv_block_n=128"`` times each
:class:`~nsa_kernels.compressed.config.CmpConfig` (fields left out keep their defaults).

``--window W`` times the sliding branch instead, which runs on the same kernels (one block per
token, a window of W keys): k and v hold T tokens, ``triton`` is
``sliding_attention_triton`` (forward and forward+backward; the backward alone is not split
out), and the peers are ``flex`` (nsa-kernels' FlexAttention backend, CUDA) and ``reference``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from nsa_bench import cli_args
from nsa_bench.cases import DTYPES
from nsa_bench.tables import write_dataclass_csv
from nsa_bench.timing import median_ms
from nsa_core.blocks import num_cmp_blocks

if TYPE_CHECKING:
    from nsa_kernels.compressed.function import CmpConfig

METHODS = ("triton", "reference", "sdpa")
WINDOW_METHODS = ("triton", "reference", "flex")
ALL_METHODS = ("triton", "reference", "sdpa", "flex")
# Forward + backward matmuls: 2 forward (q.k, p.v), 5 backward (q.k again, do.v, p^T.do,
# ds.k, ds^T.q).
FWD_BWD_FLOP_FACTOR = 3.5


@dataclass(frozen=True)
class CmpRow:
    """One timed (T, method, config); bwd_ms is NaN where the method has no separate backward."""

    T: int
    blocks: int
    method: str
    config: str
    fwd_ms: float
    bwd_ms: float
    fwd_bwd_ms: float
    fwd_tflops: float
    fwd_bwd_tflops: float

    def line(self) -> str:
        """The row as printed while the bench runs."""
        return (
            f"T={self.T:6d} N={self.blocks:5d} {self.method:9s} fwd {self.fwd_ms:8.3f} ms "
            f"({self.fwd_tflops:5.0f} TFLOP/s)  bwd {self.bwd_ms:8.3f} ms  "
            f"fwd+bwd {self.fwd_bwd_ms:8.3f} ms ({self.fwd_bwd_tflops:5.0f} TFLOP/s)  {self.config}"
        )


@dataclass(frozen=True)
class CmpProblem:
    """Random inputs of one T: q [B, T, HQ, dk], k [B, N, H, dk], v [B, N, H, dv], do like o."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    cmp_block: int
    cmp_stride: int
    window: int = 0


def sdpa_chunked(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    cmp_block: int,
    cmp_stride: int,
    chunk: int = 4096,
) -> torch.Tensor:
    """Peer: SDPA over query chunks with the visibility mask ``i*d + l - 1 <= t``.

    q [B, T, HQ, dk], k_cmp [B, N, H, dk], v_cmp [B, N, H, dv] -> [B, T, HQ, dv]; K/V expanded
    to HQ heads. Rows that see no block are NaN or 0 (SDPA's softmax over an empty row; which one
    depends on the SDPA backend).
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


def make_problem(args: argparse.Namespace, seq_len: int, device: torch.device) -> CmpProblem:
    dtype = DTYPES[args.dtype]
    gen = torch.Generator(device=device).manual_seed(args.seed + seq_len)
    blocks = seq_len if args.window else num_cmp_blocks(seq_len, args.cmp_block, args.cmp_stride)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=gen).to(dtype)

    return CmpProblem(
        q=randn(args.batch, seq_len, args.heads, args.dk),
        k=randn(args.batch, blocks, args.kv_heads, args.dk),
        v=randn(args.batch, blocks, args.kv_heads, args.dv),
        do=randn(args.batch, seq_len, args.heads, args.dv),
        cmp_block=args.cmp_block,
        cmp_stride=args.cmp_stride,
        window=args.window,
    )


def window_flops(batch: int, tq: int, hq: int, dk: int, dv: int, window: int) -> int:
    """Matmul FLOPs of the sliding forward: 2 * B * HQ * (dk + dv) * sum_t min(t + 1, w)."""
    full = max(0, tq - window)  # rows that see a whole window
    visible = full * window + sum(range(1, tq - full + 1))
    return 2 * batch * hq * (dk + dv) * visible


Timer = Callable[[Callable[[], object]], float]


def time_triton(p: CmpProblem, config_text: str, timer: Timer) -> tuple[str, float, float, float]:
    """(resolved config, forward, backward alone, forward+backward) ms of the Triton kernels."""
    from nsa_kernels.common.triton_inputs import max_shared_bytes
    from nsa_kernels.compressed.function import (
        compressed_attention_bwd,
        compressed_attention_fwd,
        compressed_attention_triton,
        parse_config,
        resolve_config,
    )

    config = parse_config(config_text)
    dk, dv = p.q.shape[-1], p.v.shape[-1]
    # The tiles the op resolves: the sliding kernels' own where the window bounds anything,
    # and fewer stages or smaller tiles where the device has less shared memory.
    shown = resolve_config(
        config, dk, dv, p.q.dtype,
        windowed=0 < p.window < p.q.shape[1], shared_bytes=max_shared_bytes(p.q.device),
    ).describe()  # fmt: skip
    if p.window:
        return (shown, *time_sliding(p, "triton", timer, config))
    block, stride = p.cmp_block, p.cmp_stride
    o, lse = compressed_attention_fwd(p.q, p.k, p.v, block, stride, config=config)
    leaves = [t.detach().clone().requires_grad_() for t in (p.q, p.k, p.v)]

    def fwd() -> object:
        return compressed_attention_fwd(p.q, p.k, p.v, block, stride, config=config)

    def bwd() -> object:
        return compressed_attention_bwd(p.do, p.q, p.k, p.v, o, lse, block, stride, config=config)

    def both() -> None:
        q, k, v = leaves
        out = compressed_attention_triton(q, k, v, block, stride, config=config)
        torch.autograd.backward(out, p.do)
        for leaf in leaves:
            leaf.grad = None

    return shown, timer(fwd), timer(bwd), timer(both)


def time_sliding(
    p: CmpProblem, method: str, timer: Timer, config: CmpConfig | None = None
) -> tuple[float, float, float]:
    """(forward, NaN, forward+backward) ms of the sliding branch by ``method``."""
    if method == "triton":
        from nsa_kernels.sliding.triton_function import sliding_attention_triton

        def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return sliding_attention_triton(q, k, v, p.window, config=config)

    elif method == "flex":
        from nsa_kernels.common.flex import sliding_attention_flex

        def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return sliding_attention_flex(q, k, v, p.window)

    else:
        from nsa_core.reference.sliding_attention import sliding_attention

        def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return sliding_attention(q, k, v, p.window)

    fwd_ms, both_ms = _time_fwd_and_both(call, p, timer)
    return fwd_ms, math.nan, both_ms


def _time_fwd_and_both(
    call: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    p: CmpProblem,
    timer: Timer,
) -> tuple[float, float]:
    """(forward, forward+backward) ms of ``call(q, k, v)`` on ``p``."""
    leaves = [t.detach().clone().requires_grad_() for t in (p.q, p.k, p.v)]

    def fwd() -> object:
        with torch.no_grad():
            return call(p.q, p.k, p.v)

    def both() -> None:
        torch.autograd.backward(call(leaves[0], leaves[1], leaves[2]), p.do)
        for leaf in leaves:
            leaf.grad = None

    return timer(fwd), timer(both)


def time_peer(method: str, p: CmpProblem, timer: Timer) -> tuple[float, float]:
    """(forward, forward+backward) ms of ``reference`` or ``sdpa``."""
    from nsa_core.reference.compressed_attention import compressed_attention

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if method == "reference":
            return compressed_attention(q, k, v, p.cmp_block, p.cmp_stride)
        return sdpa_chunked(q, k, v, p.cmp_block, p.cmp_stride)

    return _time_fwd_and_both(call, p, timer)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli_args.add_kernel_shape_args(parser)
    parser.add_argument("--dv", type=cli_args.positive_int, default=128, help="value head dim")
    cli_args.add_compression_args(parser)
    cli_args.add_dtype_arg(parser)
    parser.add_argument(
        "--methods",
        type=cli_args.names(ALL_METHODS),
        default="triton",
        help=f"comma-separated, of {', '.join(METHODS)} (with --window: "
        f"{', '.join(WINDOW_METHODS)})",
    )
    parser.add_argument("--configs", default="", help='CmpConfig strings separated by ";"')
    parser.add_argument(
        "--window",
        type=cli_args.non_negative_int,
        default=0,
        help="time the sliding branch with this window instead (0: the compressed branch)",
    )
    parser.add_argument(
        "--baseline-max-t",
        type=cli_args.seqlen,
        default=16384,
        help="longest T for reference and sdpa",
    )
    cli_args.add_kernel_timing_args(parser)
    cli_args.add_device_arg(
        parser, "cpu runs the Triton method under the Triton interpreter (TRITON_INTERPRET=1) only"
    )
    cli_args.add_seed_arg(parser)


def check_arguments(args: argparse.Namespace) -> None:
    """The methods of the branch timed, heads that group, a stride that divides the block (the
    compressed branch), a device each method runs on, and tile configs CmpConfig knows."""
    known = WINDOW_METHODS if args.window else METHODS
    unknown = [m for m in args.methods if m not in known]
    if unknown:
        branch = "the sliding branch (--window)" if args.window else "the compressed branch"
        raise cli_args.UsageError(
            f"--methods: {', '.join(unknown)} cannot time {branch}; choose from {', '.join(known)}"
        )
    cli_args.require_multiple(args.heads, "--heads", args.kv_heads, "--kv-heads")
    if not args.window:
        cli_args.require_multiple(args.cmp_block, "--cmp-block", args.cmp_stride, "--cmp-stride")
    if torch.device(args.device).type == "cpu":
        # FlexAttention's backward runs on CUDA only; Triton's kernels on CUDA, or on CPU
        # tensors under Triton's interpreter (TRITON_INTERPRET=1).
        why = cli_args.why_no_cuda(args.device)
        if "flex" in args.methods:
            raise cli_args.UsageError(f"--methods flex needs a CUDA GPU ({why})")
        if "triton" in args.methods and not cli_args.triton_interpreted():
            raise cli_args.UsageError(
                f"--methods triton needs a CUDA GPU ({why}), or TRITON_INTERPRET=1 to run "
                "Triton's interpreter on CPU"
            )
    if "triton" in args.methods and args.configs:
        from nsa_kernels.compressed.function import parse_config

        cli_args.check_tile_configs("--configs", parse_config, args.configs.split(";"))


def run(args: argparse.Namespace) -> int:
    from nsa_kernels.compressed.function import attention_flops

    methods = args.methods
    device = torch.device(args.device)

    def timer(fn: Callable[[], object]) -> float:
        return median_ms(fn, iters=args.iters, warmup=args.warmup, device=device)

    rows: list[CmpRow] = []
    for seq_len in args.seqlens:
        p = make_problem(args, seq_len, device)
        if args.window:
            flops = window_flops(args.batch, seq_len, args.heads, args.dk, args.dv, args.window)
        else:
            flops = attention_flops(
                args.batch, seq_len, args.heads, args.dk, args.dv, args.cmp_block, args.cmp_stride
            )
        timed: list[tuple[str, str, float, float, float]] = []
        for method in methods:
            if method == "triton":
                from triton.runtime.errors import OutOfResources

                for config_text in args.configs.split(";") if args.configs else [""]:
                    try:
                        timed.append(("triton", *time_triton(p, config_text, timer)))
                    except OutOfResources as exc:
                        # One entry of a tile sweep that this GPU cannot hold: say so, go on.
                        print(f"T={seq_len} config {config_text!r}: not run: {exc}", flush=True)
            elif args.window and (method == "flex" or seq_len <= args.baseline_max_t):
                timed.append((method, "", *time_sliding(p, method, timer)))
            elif seq_len <= args.baseline_max_t:
                fwd_ms, both_ms = time_peer(method, p, timer)
                timed.append((method, "", fwd_ms, math.nan, both_ms))
        for method, shown, fwd_ms, bwd_ms, both_ms in timed:
            row = CmpRow(
                T=seq_len,
                blocks=p.k.shape[1],
                method=method,
                config=shown,
                fwd_ms=fwd_ms,
                bwd_ms=bwd_ms,
                fwd_bwd_ms=both_ms,
                fwd_tflops=flops / fwd_ms * 1e-9,
                fwd_bwd_tflops=FWD_BWD_FLOP_FACTOR * flops / both_ms * 1e-9,
            )
            rows.append(row)
            print(row.line(), flush=True)
    if args.csv:
        write_dataclass_csv(Path(args.csv), rows)
    return 0
