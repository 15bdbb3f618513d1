"""``nsa-bench``: benches and tools for Native Sparse Attention, one sub-command each."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NamedTuple

import torch

from nsa_bench.cli_args import UsageError


class Command(NamedTuple):
    """A sub-command: the module that implements it and its one-line help.

    ``needs_cuda``: every run of it needs a CUDA GPU, so on a host where torch sees none it is
    refused as a usage error before anything runs. A command that needs one only for some of
    its flags (a Triton method, a mode) says so in its module's ``check_arguments``.
    """

    module: str
    help: str
    needs_cuda: bool = False


# Each module exposes ``add_arguments(parser)`` and ``run(args) -> int``, and may expose
# ``check_arguments(args)``, which raises UsageError for flags that are each valid but refused
# together. This table is the only place that lists the sub-commands.
COMMANDS: dict[str, Command] = {
    "demo": Command("nsa_bench.demo", "small NSA prefill + decode: routing and a reads table"),
    "cmp": Command(
        "nsa_bench.cmp_bench", "Triton compressed attention fwd/bwd over T vs its peers"
    ),
    "cp": Command("nsa_bench.cp_bench", "context-parallel NSA fwd+bwd per world size, comm apart"),
    "decode": Command(
        "nsa_bench.decode_bench",
        "fused decode step and layer step (CUDA graphs) vs dense decode, B x S, per branch",
        # The fused step and LayerDecoder are CUDA kernels replayed in CUDA graphs.
        needs_cuda=True,
    ),
    "decode-module": Command(
        "nsa_bench.decode_module_bench",
        "NSAAttention.decode (any device, CPU too) per context length, whole and per branch",
    ),
    "needle": Command(
        "nsa_bench.needle.cli",
        "train a small NSA LM and two ablations on passkey retrieval; accuracy, selection stats",
    ),
    "layer": Command(
        "nsa_bench.layer.cli", "whole NSA layer vs fla-core, SDPA, FA-2 over T; by step"
    ),
    "fa2": Command(
        "nsa_bench.fa2_bench", "FA-2 vs its torch fallbacks per branch over T and D, cutoffs"
    ),
    "routing": Command("nsa_bench.routing", "backend chosen per op, with reasons, and the pairing"),
    "score": Command(
        "nsa_bench.score_bench", "Triton block scoring + top-n over T, lse given or not"
    ),
    "sel": Command(
        "nsa_bench.sel_bench", "Triton selection vs fallbacks and fla-core; its min length"
    ),
    "summarize": Command("nsa_bench.summarize", "per-branch shares and reads of a decode CSV"),
}


def build_parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and each sub-command's own (whose usage a refusal prints).

    Abbreviated flags are off: each flag has one spelling, and a removed one is an unrecognized
    argument rather than the prefix of a flag it never meant (score's old ``--l`` of ``--lse``).
    """
    parser = argparse.ArgumentParser(
        prog="nsa-bench",
        description="Benches and tools for Native Sparse Attention (nsa): time the kernels "
        "against their fallbacks and peers, show which backend serves each op and why.",
        epilog="`nsa-bench COMMAND --help` shows a command's options. To check a whole host "
        "(every test tier, the benches, a report), run `bash ci/runner.sh` from a checkout.",
        allow_abbrev=False,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    subparsers = {}
    for name, command in COMMANDS.items():
        module = importlib.import_module(command.module)
        subparsers[name] = sub.add_parser(
            name, help=command.help, description=command.help, allow_abbrev=False
        )
        module.add_arguments(subparsers[name])
    return parser, subparsers


def build_parser() -> argparse.ArgumentParser:
    return build_parsers()[0]


def register_kernels() -> None:
    """Register nsa-kernels' backends even when it runs from source with no entry points."""
    from nsa_core.registry import register_backend
    from nsa_kernels.registration import register

    register(register_backend)


def checked_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The parsed flags of a command line that passes every check.

    A refusal (a bad value, flags refused together, a GPU this host lacks) is a usage error of
    the sub-command: its usage and the reason on stderr, SystemExit(2), no traceback.
    """
    parser, subparsers = build_parsers()
    args = parser.parse_args(argv)
    command = COMMANDS[args.command]
    usage = subparsers[args.command]
    if command.needs_cuda and not torch.cuda.is_available():
        usage.error(f"nsa-bench {args.command} needs a CUDA GPU (torch sees none)")
    check = getattr(importlib.import_module(command.module), "check_arguments", None)
    if check is not None:
        try:
            check(args)
        except UsageError as exc:
            usage.error(str(exc))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = checked_args(argv)
    register_kernels()
    return int(importlib.import_module(COMMANDS[args.command].module).run(args))


if __name__ == "__main__":
    sys.exit(main())
