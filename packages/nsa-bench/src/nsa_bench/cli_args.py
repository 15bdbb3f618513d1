"""Command-line pieces the ``nsa-bench`` sub-commands share: typed flag values, flag groups, and
the error a command's own checks raise.

Every flag value is parsed and checked by its ``type=`` callable, so a bad value ends as a usage
error of argparse (the command's usage, the flag and the rule, exit 2) before anything runs.
What one flag alone cannot tell (flags that must agree, a run that needs a GPU) a command checks
in its ``check_arguments(args)``, raising :class:`UsageError`; ``nsa_bench.cli.main`` reports
that the same way.

A flag group is added here only where its flags are the same in name, type, default and help in
every command that takes it.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from nsa_bench.cases import DTYPES
from nsa_core import NSAConfig

T = TypeVar("T")


class UsageError(Exception):
    """Flags that are each valid but that the command refuses together (or on this host).

    ``nsa_bench.cli.main`` turns it into a usage error of the sub-command: exit 2, no traceback.
    """


# ---------------------------------------------------------------------------------------------
# Flag values: each callable takes the flag's text and returns its value, or raises
# ArgumentTypeError with the rule the text breaks (argparse prefixes the flag's name).


def positive_int(text: str) -> int:
    """A count or a size: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def non_negative_int(text: str) -> int:
    """A count that may be zero (warm-up runs, say)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 0") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 0")
    return value


def _finite_float(text: str, rule: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {rule}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not {rule}")
    return value


def positive_float(text: str) -> float:
    """A duration or a ratio: a finite number > 0."""
    value = _finite_float(text, "a positive number")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def non_negative_float(text: str) -> float:
    """A duration that may be zero: a finite number >= 0."""
    value = _finite_float(text, "a number >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number >= 0")
    return value


def seed(text: str) -> int:
    """A random seed: an integer in [0, 2**63), the range every torch generator takes."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a seed (an integer >= 0)") from None
    if not 0 <= value < 1 << 63:
        raise argparse.ArgumentTypeError(f"{text!r} is not a seed (an integer in [0, 2**63))")
    return value


def fraction(text: str) -> float:
    """A position in a sequence as a share of its length: a number in [0, 1]."""
    value = _finite_float(text, "a number in [0, 1]")
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number in [0, 1]")
    return value


def seqlen(text: str) -> int:
    """A length in tokens: ``8192``, ``8k`` (= 8192) or ``1m`` (= 1048576), >= 1."""
    rule = "a positive length (such as 8192, 8k or 1m)"
    lowered = text.strip().lower()
    scale = {"k": 1 << 10, "m": 1 << 20}.get(lowered[-1:], 1)
    digits = lowered[:-1] if scale > 1 else lowered
    if not re.fullmatch(r"[0-9]+", digits) or int(digits) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not {rule}")
    return int(digits) * scale


def pair(text: str) -> tuple[int, int]:
    """``A/B`` of two positive integers, e.g. HQ/H heads or dk/dv head dims."""
    a, sep, b = text.strip().partition("/")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} is not A/B (two positive integers)")
    try:
        return positive_int(a.strip()), positive_int(b.strip())
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not A/B (two positive integers)") from None


def comma_list(item: Callable[[str], T], *, empty_ok: bool = False) -> Callable[[str], list[T]]:
    """A comma-separated list of ``item`` values (blank items skipped); at least one value
    unless ``empty_ok`` (then ``''`` is the empty list)."""

    def parse(text: str) -> list[T]:
        values = [item(part.strip()) for part in text.split(",") if part.strip()]
        if not values and not empty_ok:
            raise argparse.ArgumentTypeError(f"{text!r} holds no value; give at least one")
        return values

    return parse


def names(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    """A comma-separated list of names, each one of ``allowed``, at least one."""

    def parse(text: str) -> list[str]:
        given = [x.strip() for x in text.split(",") if x.strip()]
        unknown = [x for x in given if x not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(map(repr, unknown))}; choose from {', '.join(allowed)}"
            )
        if not given:
            raise argparse.ArgumentTypeError(f"{text!r} names none of {', '.join(allowed)}")
        return given

    return parse


positive_ints = comma_list(positive_int)
seqlens = comma_list(seqlen)
pairs = comma_list(pair)


def existing_file(text: str) -> str:
    """The path of a file that exists."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    return text


def existing_dir(text: str) -> str:
    """The path of a folder that exists."""
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"no such folder: {text!r}")
    return text


def device_name(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``, where torch sees that GPU."""
    try:
        parsed = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a device (cpu, cuda or cuda:N)"
        ) from None
    if parsed.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device (cpu, cuda or cuda:N)")
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise argparse.ArgumentTypeError(f"{text!r} needs a CUDA GPU (torch sees none)")
        if parsed.index is not None and parsed.index >= count:
            raise argparse.ArgumentTypeError(f"{text!r}: torch sees {count} CUDA GPU(s)")
    return text


# ---------------------------------------------------------------------------------------------
# Checks of flags together


def require_multiple(value: int, flag: str, divisor: int, divisor_flag: str) -> None:
    """UsageError unless ``value``, given by ``flag``, is a multiple of ``divisor``, given by
    ``divisor_flag``."""
    if value % divisor:
        raise UsageError(f"{flag} ({value}) must be a multiple of {divisor_flag} ({divisor})")


def check_tile_configs(flag: str, parse: Callable[[str], object], texts: Sequence[str]) -> None:
    """Each tile-config string of ``flag`` parses (``parse`` raises ValueError naming the field
    it does not know or the value that is not a count), else UsageError."""
    for text in texts:
        try:
            parse(text)
        except ValueError as exc:
            raise UsageError(f"{flag}: {exc}") from None


def why_no_cuda(device: str | None = None) -> str:
    """Why a run that needs a CUDA GPU has none: torch sees none, or ``--device`` chose the CPU."""
    if not torch.cuda.is_available():
        return "torch sees none"
    return f"--device is {device}"


def triton_interpreted() -> bool:
    """Whether Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def nsa_config(flags: Mapping[str, str], **fields: Any) -> NSAConfig:
    """``NSAConfig(**fields)``, its refusal a :class:`UsageError` in the flags' words.

    ``flags`` maps a field to the flag that sets it, so "num_q_heads (6) must be a multiple of
    num_kv_heads (4)" reads "--heads (6) must be a multiple of --kv-heads (4)".
    """
    try:
        return NSAConfig(**fields)
    except (TypeError, ValueError) as exc:
        text = str(exc).replace("NSAConfig.", "")
        for field_name, flag in flags.items():
            # Backslashes doubled: the flag's text is taken as is, never as a group reference.
            text = re.sub(rf"\b{field_name}\b", flag.replace("\\", "\\\\"), text)
        raise UsageError(text) from None


# The NSAConfig fields that set the heads and head dims, by the flags most commands give them.
HEAD_FLAGS = {
    "num_q_heads": "--heads",
    "num_kv_heads": "--kv-heads",
    "head_dim_qk": "--dk",
    "head_dim_v": "--dv",
}
# The flags of add_layer_blocks_args and the NSAConfig fields they set.
BLOCK_FLAGS = {
    "cmp_block": "--cmp-block",
    "cmp_stride": "--cmp-stride",
    "sel_block": "--sel-block",
    "num_selected": "--num-selected",
    "window": "--window",
}


def head_config(
    args: argparse.Namespace, flags: Mapping[str, str] | None = None, **fields: Any
) -> NSAConfig:
    """The NSAConfig of ``--heads``, ``--kv-heads``, ``--dk`` and ``--dv`` and any other
    ``fields``, set by ``flags`` (:func:`nsa_config`); the rest keeps NSAConfig's defaults."""
    return nsa_config(
        {**HEAD_FLAGS, **(flags or {})},
        num_q_heads=args.heads,
        num_kv_heads=args.kv_heads,
        head_dim_qk=args.dk,
        head_dim_v=args.dv,
        **fields,
    )


# ---------------------------------------------------------------------------------------------
# Flag groups


def add_device_arg(parser: argparse.ArgumentParser, help_text: str | None = None) -> None:
    """``--device``: cuda when torch sees a GPU, else cpu."""
    parser.add_argument(
        "--device",
        type=device_name,
        default="cuda" if torch.cuda.is_available() else "cpu",
        help=help_text or "cpu, cuda or cuda:N (default: cuda where torch sees a GPU)",
    )


def add_seed_arg(parser: argparse.ArgumentParser) -> None:
    """``--seed``: where the command's random inputs (and weights, where it builds any) start."""
    parser.add_argument("--seed", type=seed, default=0)


def add_dtype_arg(parser: argparse.ArgumentParser) -> None:
    """``--dtype``: one of the :data:`~nsa_bench.cases.DTYPES` names, bf16 by default."""
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")


def add_batch_arg(parser: argparse.ArgumentParser) -> None:
    """``--batch``: B, the sequences of one call."""
    parser.add_argument("--batch", type=positive_int, default=1, help="batch B")


def add_layer_heads_args(parser: argparse.ArgumentParser) -> None:
    """``--batch`` and ``--heads`` (HQ/H) of the layer and cp benches."""
    add_batch_arg(parser)
    parser.add_argument("--heads", type=pair, default="64/4", help="HQ/H, query and kv heads")


def add_compression_args(parser: argparse.ArgumentParser) -> None:
    """``--cmp-block`` and ``--cmp-stride``: l and d, the compression block length and stride."""
    parser.add_argument(
        "--cmp-block", type=positive_int, default=32, help="compression block length l"
    )
    parser.add_argument("--cmp-stride", type=positive_int, default=16, help="compression stride d")


def add_selection_args(parser: argparse.ArgumentParser) -> None:
    """``--sel-block`` and ``--num-selected``: l' and n, the selection block length and the
    blocks each query selects."""
    parser.add_argument(
        "--sel-block", type=positive_int, default=64, help="selection block length l'"
    )
    parser.add_argument(
        "--num-selected", type=positive_int, default=16, help="selected blocks per query n"
    )


def add_layer_blocks_args(parser: argparse.ArgumentParser) -> None:
    """The NSA block geometry: l, d, l', n and w (the flags of :data:`BLOCK_FLAGS`)."""
    add_compression_args(parser)
    add_selection_args(parser)
    parser.add_argument("--window", type=positive_int, default=512, help="sliding window w")


# NSAConfig's block geometry, named as the flags of add_layer_blocks_args (and as the fields of
# the layer bench's LayerShape and the needle task's settings) name it.
BLOCK_GEOMETRY = tuple(BLOCK_FLAGS)


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
    parser.add_argument(
        "--seqlens", type=seqlens, default="8k,16k,32k,64k", help="lengths T (8192 or 8k)"
    )
    add_batch_arg(parser)
    parser.add_argument("--heads", type=positive_int, default=64, help="query heads HQ")
    parser.add_argument("--kv-heads", type=positive_int, default=4, help="kv heads H")
    parser.add_argument("--dk", type=positive_int, default=128, help="query/key head dim")


def add_do_bench_args(parser: argparse.ArgumentParser) -> None:
    """``--warmup-ms`` and ``--rep-ms``: how long do_bench warms a call up and times it."""
    parser.add_argument(
        "--warmup-ms", type=non_negative_float, default=25.0, help="do_bench warm-up (ms)"
    )
    parser.add_argument(
        "--rep-ms", type=positive_float, default=100.0, help="do_bench repetition (ms)"
    )


def add_kernel_timing_args(parser: argparse.ArgumentParser) -> None:
    """Timed and warm-up runs and the optional CSV of the kernel benches (cmp, score)."""
    parser.add_argument("--iters", type=positive_int, default=20, help="timed runs")
    parser.add_argument("--warmup", type=non_negative_int, default=5, help="warm-up runs")
    parser.add_argument("--csv", default="", help="write the rows to this CSV file")
