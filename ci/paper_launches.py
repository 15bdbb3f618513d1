"""Record the Triton launches of the NSA layer's GPU routes at the paper's shapes (no GPU).

The interpreter tier's launches come from small test shapes; the tiles a kernel gets at the
paper's shapes (B=1, HQ=64, H=4, l=32, d=16, l'=64, n=16, 16 bits) are the ones every
timing in docs/results/ ran. This script runs each Triton op of the layer once, forward and
backward, at those shapes on a short sequence under ``TRITON_INTERPRET=1``, with the launch
recorder of ci/triton_launches.py, and writes ``launches-paper.json`` for ci/compile_triton.py:

    TRITON_INTERPRET=1 python ci/paper_launches.py DIR [--head-dims 128/128,192/128]
    python ci/compile_triton.py DIR --arch 90 --resources

The interpreter does not check the numbers here (bfloat16 dots are unreliable in it, and the
tests check every kernel elsewhere); only the launches matter: their tiles, warps and stages are
resolved as on a device with no shared-memory limit given (that is, as on an H100/H200). The
selected forward's TMA and rows per program follow the device's policy, which the interpreter
does not have: its launch here is the pointer-load one. The sequence (192 tokens) and the window
(64) are short so that the interpreter is quick; neither is a constexpr, and a window shorter than
the sequence gives the sliding branch its windowed kernels, so the tiles are the paper's. Runtime
integers keep the classes Triton specializes on (1, multiples of 16) of this short sequence: the
compressed dk/dv kernel sees one key tile here, so its count is compiled as the constant 1, where
a long sequence passes a variable; registers may differ by a few from the long launch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

TOKENS = 192
HEADS, KV_HEADS = 64, 4
CMP_BLOCK, CMP_STRIDE, SEL_BLOCK, NUM_SELECTED, WINDOW = 32, 16, 64, 16, 64


def _backward(out: torch.Tensor) -> None:
    """out.float().sum() backward, typed."""
    torch.autograd.backward(out.float().sum())


def _step(name: str, run: Callable[[], object]) -> None:
    t0 = time.perf_counter()
    run()
    print(f"[paper launches] {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)


def record_layer(dk: int, dv: int, dtype: torch.dtype) -> None:
    """Run the layer's Triton ops once, forward and backward, at head dims dk / dv."""
    from nsa_core.blocks import num_cmp_blocks
    from nsa_kernels.combine.function import gated_combine_triton
    from nsa_kernels.compressed.function import compressed_attention_triton_with_lse
    from nsa_kernels.scoring.function import select_blocks_triton
    from nsa_kernels.selected.function import selected_attention_triton
    from nsa_kernels.sliding.triton_function import sliding_attention_triton

    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).requires_grad_()

    q = rand(1, TOKENS, HEADS, dk)
    k, v = rand(1, TOKENS, KV_HEADS, dk), rand(1, TOKENS, KV_HEADS, dv)
    blocks = num_cmp_blocks(TOKENS, CMP_BLOCK, CMP_STRIDE)
    k_cmp, v_cmp = rand(1, blocks, KV_HEADS, dk), rand(1, blocks, KV_HEADS, dv)
    tag = f"dk={dk} dv={dv} {str(dtype).removeprefix('torch.')}"

    o_cmp, lse = compressed_attention_triton_with_lse(q, k_cmp, v_cmp, CMP_BLOCK, CMP_STRIDE)
    _step(f"{tag} compressed backward", lambda: _backward(o_cmp))
    indices, _ = select_blocks_triton(
        q.detach(), k_cmp.detach(), CMP_BLOCK, CMP_STRIDE, SEL_BLOCK, NUM_SELECTED, lse=lse
    )
    o_sel = selected_attention_triton(q, k, v, indices, SEL_BLOCK)
    _step(f"{tag} selected backward", lambda: _backward(o_sel))
    o_win = sliding_attention_triton(q, k, v, WINDOW)
    _step(f"{tag} sliding backward", lambda: _backward(o_win))
    gates = torch.rand(1, TOKENS, HEADS, 3, generator=gen).to(dtype).requires_grad_()
    out = gated_combine_triton(o_cmp.detach(), o_sel.detach(), o_win.detach(), gates)
    _step(f"{tag} combine backward", lambda: _backward(out))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="where launches-paper.json goes")
    parser.add_argument("--head-dims", default="128/128,192/128", help="dk/dv pairs")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("set TRITON_INTERPRET=1: the launches are recorded from the interpreter")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    # The recorder is the pytest plugin's (ci/triton_launches.py); ci/ is a folder of scripts.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from ci.triton_launches import LaunchRecorder

    recorder = LaunchRecorder()
    recorder.install()
    try:
        for pair in args.head_dims.split(","):
            dk, dv = (int(x) for x in pair.split("/"))
            t0 = time.perf_counter()
            record_layer(dk, dv, dtype)
            print(f"[paper launches] dk={dk} dv={dv}: {time.perf_counter() - t0:.1f} s")
    finally:
        recorder.uninstall()
    path = recorder.write(args.folder, "paper")
    print(f"[paper launches] {len(recorder.launches)} distinct launches -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
