"""Command-line pieces the ``nsa-bench`` sub-commands share: list parsers and flag groups.

A flag group is added here only where its flags are the same in name, type, default and help in
every command that takes it, so a command's ``--help`` reads as it did when each wrote its own.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import torch

from nsa_bench.cases import DTYPES
from nsa_core import NSAConfig

# ---------------------------------------------------------------------------------------------
# Comma-separated values


def parse_ints(text: str) -> list[int]:
    """``"256, 512,"`` -> [256, 512] (empty items skipped)."""
    return [int(x) for x in text.split(",") if x.strip()]


def parse_floats(text: str) -> list[float]:
    """``"0.1,0.5"`` -> [0.1, 0.5] (empty items skipped)."""
    return [float(x) for x in text.split(",") if x.strip()]


def parse_length(text: str) -> int:
    """``8192``, ``8k`` (= 8192) or ``1m``."""
    text = text.strip().lower()
    scale = {"k": 1 << 10, "m": 1 << 20}.get(text[-1:], 1)
    return int(text[:-1] if scale > 1 else text) * scale


def parse_pairs(text: str) -> list[tuple[int, int]]:
    """``128/128,192/128`` -> [(128, 128), (192, 128)]."""
    pairs = []
    for item in text.split(","):
        if not item.strip():
            continue
        a, sep, b = item.partition("/")
        if not sep:
            raise argparse.ArgumentTypeError(f"{item!r} is not A/B")
        pairs.append((int(a), int(b)))
    return pairs


def parse_names(text: str, allowed: Sequence[str]) -> list[str]:
    """Comma-separated names, each one of ``allowed`` (else ``ArgumentTypeError``)."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in names if x not in allowed]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {', '.join(allowed)}")
    return names


# ---------------------------------------------------------------------------------------------
# Flag groups


def add_device_arg(parser: argparse.ArgumentParser, help_text: str | None = None) -> None:
    """``--device``: cuda when torch sees a GPU, else cpu."""
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help=help_text
    )


def add_seed_arg(parser: argparse.ArgumentParser) -> None:
    """``--seed``: where the command's random inputs (and weights, where it builds any) start."""
    parser.add_argument("--seed", type=int, default=0)


def add_dtype_arg(parser: argparse.ArgumentParser) -> None:
    """``--dtype``: one of the :data:`~nsa_bench.cases.DTYPES` names, bf16 by default."""
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")


def add_batch_arg(parser: argparse.ArgumentParser) -> None:
    """``--B``: the batch of the kernel and module benches."""
    parser.add_argument("--B", type=int, default=1, help="batch")


def add_layer_heads_args(parser: argparse.ArgumentParser) -> None:
    """``--batch`` and ``--heads`` (HQ/H) of the layer and cp benches."""
    parser.add_argument("--batch", type=int, default=1, help="B")
    parser.add_argument("--heads", default="64/4", help="HQ/H, query and kv heads")


def add_layer_blocks_args(parser: argparse.ArgumentParser) -> None:
    """The NSA block geometry of the layer and cp benches: l, d, l', n and w."""
    parser.add_argument("--cmp-block", type=int, default=32, help="l")
    parser.add_argument("--cmp-stride", type=int, default=16, help="d")
    parser.add_argument("--sel-block", type=int, default=64, help="l'")
    parser.add_argument("--num-selected", type=int, default=16, help="n")
    parser.add_argument("--window", type=int, default=512, help="w")


# NSAConfig's block geometry, named as the flags of add_layer_blocks_args (and as the fields of
# the layer bench's LayerShape and the needle task's settings) name it.
BLOCK_GEOMETRY = ("cmp_block", "cmp_stride", "sel_block", "num_selected", "window")


def block_geometry(source: object) -> dict[str, Any]:
    """The l, d, l', n, w that ``source`` carries, by their :data:`BLOCK_GEOMETRY` names.

    ``source`` is anything with those attributes: parsed flags of :func:`add_layer_blocks_args`,
    the layer bench's ``LayerShape``, the needle task's settings.
    """
    return {name: getattr(source, name) for name in BLOCK_GEOMETRY}


def blocks_config(
    geometry: object, heads: tuple[int, int], head_dims: tuple[int, int]
) -> NSAConfig:
    """The NSAConfig of (HQ, H), (dk, dv) and the :func:`block_geometry` of ``geometry``."""
    (hq, h), (dk, dv) = heads, head_dims
    blocks = block_geometry(geometry)
    return NSAConfig(num_q_heads=hq, num_kv_heads=h, head_dim_qk=dk, head_dim_v=dv, **blocks)


def add_kernel_shape_args(parser: argparse.ArgumentParser) -> None:
    """Lengths, batch, heads and dk of the compressed-branch kernel benches (cmp, score)."""
    parser.add_argument("--T", default="8192,16384,32768,65536", help="comma-separated tokens")
    add_batch_arg(parser)
    parser.add_argument("--hq", type=int, default=64, help="query heads HQ")
    parser.add_argument("--h", type=int, default=4, help="kv heads H")
    parser.add_argument("--dk", type=int, default=128, help="query/key head dim")


def add_compression_args(parser: argparse.ArgumentParser) -> None:
    """``--l`` and ``--d``: the compression block length and stride."""
    parser.add_argument("--l", type=int, default=32, help="compression block length")
    parser.add_argument("--d", type=int, default=16, help="compression stride")


def add_do_bench_args(parser: argparse.ArgumentParser) -> None:
    """``--warmup-ms`` and ``--rep-ms``: how long do_bench warms a call up and times it."""
    parser.add_argument("--warmup-ms", type=float, default=25.0, help="do_bench warm-up (ms)")
    parser.add_argument("--rep-ms", type=float, default=100.0, help="do_bench repetition (ms)")


def add_kernel_timing_args(parser: argparse.ArgumentParser) -> None:
    """Timed and warm-up runs and the optional CSV of the kernel benches (cmp, score)."""
    parser.add_argument("--iters", type=int, default=20, help="timed runs")
    parser.add_argument("--warmup", type=int, default=5, help="warm-up runs")
    parser.add_argument("--csv", default="", help="write the rows to this CSV file")
