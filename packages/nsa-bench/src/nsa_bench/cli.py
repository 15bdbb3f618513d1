"""``nsa-bench``: benches and tools for Native Sparse Attention, one sub-command each."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# sub-command -> (module, one-line help). Each module exposes ``add_arguments(parser)`` and
# ``run(args) -> int``; this table is the only place that lists them.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("nsa_bench.demo", "small NSA prefill + decode: routing and a reads table"),
    "cmp": ("nsa_bench.cmp_bench", "Triton compressed attention fwd/bwd over T vs its peers"),
    "cp": ("nsa_bench.cp_bench", "context-parallel NSA fwd+bwd per world size, comm apart"),
    "decode": (
        "nsa_bench.decode_bench",
        "fused decode step and layer step (CUDA graphs) vs dense decode, B x S, per branch",
    ),
    "decode-fused": ("nsa_bench.decode_bench", "deprecated name of `decode`"),
    "decode-module": (
        "nsa_bench.decode_module_bench",
        "NSAAttention.decode (any device, CPU too) per context length, whole and per branch",
    ),
    "needle": (
        "nsa_bench.needle.cli",
        "train a small NSA LM and two ablations on passkey retrieval; accuracy, selection stats",
    ),
    "layer": ("nsa_bench.layer.cli", "whole NSA layer vs fla-core, SDPA, FA-2 over T; by step"),
    "fa2": ("nsa_bench.fa2_bench", "FA-2 vs its torch fallbacks per branch over T and D, cutoffs"),
    "routing": ("nsa_bench.routing", "backend chosen per op, with reasons, and the pairing"),
    "score": ("nsa_bench.score_bench", "Triton block scoring + top-n over T, lse given or not"),
    "sel": ("nsa_bench.sel_bench", "Triton selection vs fallbacks and fla-core; its min length"),
    "summarize": ("nsa_bench.summarize", "per-branch shares and reads of a decode CSV"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nsa-bench",
        description="Benches and tools for Native Sparse Attention (nsa): time the kernels "
        "against their fallbacks and peers, show which backend serves each op and why.",
        epilog="`nsa-bench COMMAND --help` shows a command's options. To check a whole host "
        "(every test tier, the benches, a report), run `bash ci/runner.sh` from a checkout.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def register_kernels() -> None:
    """Register nsa-kernels' backends even when it runs from source with no entry points."""
    from nsa_core.registry import register_backend
    from nsa_kernels.registration import register

    register(register_backend)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    register_kernels()
    module = importlib.import_module(COMMANDS[args.command][0])
    return int(module.run(args))


if __name__ == "__main__":
    sys.exit(main())
