"""Where a compiled NSAAttention's intermediates leave eager's, on a GPU.

    python3 ci/compile_drift.py [--seqlen 65536] [--emulate-precision-casts]

Compiles (fullgraph, Inductor) the layer's steps before the attention core: the projections
with RoPE and the gates, then the mean compression, each as its own function, and compares
every intermediate with eager's bit for bit (elements that differ, largest difference). Then
the blocks that top-n selection picks from each side's q and compressed keys: the share of
(token, kv head) rows whose n blocks differ. Shape of the layer bench: bf16, HQ=64, H=4,
dk=dv=128, the paper's l, d, l', n, w, hidden 2048, B=1.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from nsa_core import NSAAttention, NSAConfig, ops
from nsa_core.reference.compress import compress_impl

CONFIG = NSAConfig(num_q_heads=64, num_kv_heads=4, head_dim_qk=128, head_dim_v=128)
HIDDEN = 2048


def _differ(name: str, got: torch.Tensor, want: torch.Tensor) -> str:
    unequal = int((got != want).sum())
    largest = float((got.float() - want.float()).abs().max())
    return f"| {name} | {tuple(got.shape)} | {unequal:,} of {got.numel():,} | {largest:.3e} |"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqlen", type=int, default=65536)
    parser.add_argument("--emulate-precision-casts", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    layer = NSAAttention(CONFIG, HIDDEN).to(device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1, args.seqlen, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16)
    positions = torch.arange(args.seqlen, device="cuda")
    cfg = CONFIG

    def project(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        inp = layer.branch_inputs(x, positions)
        return (inp.q, inp.k["cmp"], inp.v["cmp"], inp.k["sel"], inp.k["win"], inp.gates)

    def compress(k: torch.Tensor) -> torch.Tensor:
        return compress_impl(k, cfg.cmp_block, cfg.cmp_stride, None)

    def both(fn: Callable[..., object], *inputs: torch.Tensor) -> tuple[object, object]:
        with torch.no_grad():
            eager = fn(*inputs)
            compiled = torch.compile(fn, fullgraph=True)(*inputs)
        return eager, compiled

    with torch._inductor.config.patch(emulate_precision_casts=args.emulate_precision_casts):
        eager_p, compiled_p = both(project, x)
        assert isinstance(eager_p, tuple)
        assert isinstance(compiled_p, tuple)
        # The compression from the same (eager) raw keys, to see its own drift.
        eager_c, compiled_c = both(compress, eager_p[1])
        assert isinstance(eager_c, torch.Tensor)
        assert isinstance(compiled_c, torch.Tensor)
    print(f"T={args.seqlen}, emulate_precision_casts={args.emulate_precision_casts}")
    print("| tensor | shape | elements that differ | largest difference |")
    print("|---|---|---:|---:|")
    names = ("q", "k_cmp_raw", "v_cmp_raw", "k_sel", "k_win", "gates")
    for name, e, c in zip(names, eager_p, compiled_p, strict=True):
        print(_differ(name, c, e))
    print(_differ("k_cmp (same raw keys)", compiled_c, eager_c))

    with torch.no_grad():
        picks = []
        for q, k_raw in ((eager_p[0], eager_p[1]), (compiled_p[0], compiled_p[1])):
            k_cmp = compress(k_raw)
            idx, _ = ops.select_blocks(
                q, k_cmp, cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, cfg.num_selected
            )
            picks.append(idx.sort(-1).values)
    rows = picks[0].shape[1] * picks[0].shape[2]
    moved = int((picks[0] != picks[1]).any(-1).sum())
    print(f"selection: {moved:,} of {rows:,} (token, kv head) rows pick other blocks")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
