"""The test tiers: which tests each runs, with what environment, on what hardware.

This table is the one definition. noxfile.py (``tests``, ``interp-*``, ``gpu_parity-*``), the
runner (ci/runner.py) and the GPU scripts (ci/gpu_*.sh, through the command line below) all read
it; none of them lists pytest markers or paths of its own.

The tiers split the suite by marker, so each test belongs to exactly one tier of each kind of
host: a test marked ``slow`` is in ``slow``; else ``cuda``; else ``fa2``; else ``gpu``; else
``triton`` (the ``interpreter`` tier on CPU, ``triton-gpu`` for the same tests compiled on a GPU);
else the CPU tier of its package. Markers are declared in the root pyproject.toml.

Command line (stdlib only, any Python >= 3.10)::

    python3 ci/tiers.py list                        # one line per tier
    python3 ci/tiers.py args gpu                    # the tier's pytest arguments, one per line
    python3 ci/tiers.py args gpu --under packages/nsa-kernels/tests/selected
    python3 ci/tiers.py env interpreter             # KEY=VALUE lines of the tier's environment
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Literal

CORE_TESTS = "packages/nsa-core/tests"
KERNEL_TESTS = "packages/nsa-kernels/tests"
BENCH_TESTS = "packages/nsa-bench/tests"
ALL_TESTS = (CORE_TESTS, KERNEL_TESTS, BENCH_TESTS)

# Tests with none of these markers are plain CPU tests of their package.
_MARKED = "triton or gpu or fa2 or cuda or slow"

# The smoke selections: one quick test of each Triton kernel family (the interpreter tier runs
# them on a CPU, the triton-gpu tier compiles the same tests on a GPU).
_KERNEL_TESTS = f"{KERNEL_TESTS}/"
TRITON_SMOKE = (
    _KERNEL_TESTS + "selected/test_sel_kernels.py::test_forward_and_lse_match_reference"
    "[forced_g16_empty_8]",
    _KERNEL_TESTS + "selected/test_sel_kernels.py::test_backward_matches_reference"
    "[forced_g16_empty_8]",
    _KERNEL_TESTS + "compressed/test_cmp_triton_kernels.py::test_forward_and_lse_match_reference"
    "[dk192_default_tiles]",
    _KERNEL_TESTS + "scoring/test_scoring_kernel.py::test_matches_reference[decode_row]",
    _KERNEL_TESTS + "sliding/test_sliding_triton_kernels.py::"
    "test_forward_and_gradients_match_reference[dk192_default_tiles]",
    _KERNEL_TESTS + "combine/test_combine_kernels.py::test_matches_reference",
    _KERNEL_TESTS + "rope/test_rope_triton.py::test_equals_reference_forward_and_gradient",
    _KERNEL_TESTS + "decode/test_decode_step.py::test_full_sequence_is_left_unchanged",
)

Hardware = Literal["cpu", "cuda"]


@dataclass(frozen=True)
class Tier:
    """One pytest invocation: ``pytest <paths> -m <markers> <extra_args>`` under ``env``.

    ``hardware``: ``cpu`` runs on any machine; ``cuda`` needs a CUDA GPU visible to torch (the
    tier fails, rather than skips, where there is none and it was asked for by name).
    ``parallel``: the tier may use pytest-xdist workers.
    ``records_launches``: the tier runs Triton kernels in the interpreter; a CPU session records
    its launches (``--record-triton-launches``) for ci/compile_triton.py.
    ``smoke``: a few of the tier's test files or test ids, chosen to touch each kind of check the
    tier makes within seconds; the runner's ``--quick`` runs these instead of the whole tier.
    """

    name: str
    title: str
    paths: tuple[str, ...]
    markers: str
    hardware: Hardware
    env: Mapping[str, str] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    parallel: bool = True
    records_launches: bool = False
    smoke: tuple[str, ...] = ()

    def pytest_args(self, under: str | Sequence[str] | None = None) -> list[str]:
        """Paths, ``-m`` expression and extra arguments; ``under`` narrows to those folders
        or files (each inside the tier's paths)."""
        if under is None:
            paths = list(self.paths)
        else:
            targets = [under] if isinstance(under, str) else list(under)
            paths = [path for target in targets for path in narrow(self.paths, target)]
        return [*paths, "-m", self.markers, *self.extra_args]

    def smoke_args(self) -> list[str]:
        """:meth:`pytest_args` narrowed to the tier's smoke selection."""
        return self.pytest_args(self.smoke or None)


def narrow(paths: Sequence[str], under: str) -> list[str]:
    """``under`` if it lies inside one of ``paths``; the ``paths`` inside ``under`` otherwise."""
    target = PurePosixPath(under.rstrip("/"))
    for path in paths:
        if target == PurePosixPath(path) or PurePosixPath(path) in target.parents:
            return [str(target)]
    inside = [p for p in paths if target in PurePosixPath(p).parents]
    if not inside:
        raise ValueError(f"{under} is not inside the tier's paths ({', '.join(paths)})")
    return inside


TIERS: tuple[Tier, ...] = (
    Tier(
        "reference",
        "Reference (CPU)",
        (CORE_TESTS,),
        f"not ({_MARKED})",
        "cpu",
        smoke=(
            f"{CORE_TESTS}/test_module_vs_brute.py::test_layer_forward_in_the_paper_block_geometry",
            f"{CORE_TESTS}/test_ops_vs_brute.py::"
            "test_selected_attention_is_one_softmax_over_the_union_of_blocks_up_to_t",
            f"{CORE_TESTS}/test_decode.py::test_decode_equals_forward_at_every_position"
            "[l8-d2-ls16-n3-w7-g1-avg]",
            f"{CORE_TESTS}/test_core_op.py",
        ),
    ),
    Tier(
        "interpreter",
        "Triton interpreter (CPU)",
        ALL_TESTS,
        "triton and not (gpu or fa2 or cuda or slow)",
        "cpu",
        env={"TRITON_INTERPRET": "1"},
        records_launches=True,
        smoke=TRITON_SMOKE,
    ),
    Tier(
        "kernels-cpu",
        "Kernel CPU logic",
        (KERNEL_TESTS,),
        f"not ({_MARKED})",
        "cpu",
        smoke=(f"{KERNEL_TESTS}/test_registration.py", f"{KERNEL_TESTS}/test_pairing.py"),
    ),
    Tier(
        "bench-cpu",
        "Bench and CI (CPU)",
        (BENCH_TESTS,),
        f"not ({_MARKED})",
        "cpu",
        smoke=(f"{BENCH_TESTS}/test_env.py", f"{BENCH_TESTS}/test_bench_gate.py"),
    ),
    Tier(
        "triton-gpu",
        "Triton kernels compiled (GPU)",
        ALL_TESTS,
        "triton and not (gpu or fa2 or cuda or slow)",
        "cuda",
        smoke=TRITON_SMOKE,
    ),
    Tier(
        "gpu",
        "GPU parity",
        ALL_TESTS,
        "gpu and not (fa2 or cuda or slow)",
        "cuda",
        smoke=(
            f"{KERNEL_TESTS}/selected/test_sel_gpu.py::test_varlen_bf16",
            f"{KERNEL_TESTS}/test_default_routes_gpu.py::"
            "test_the_core_at_16k_in_bfloat16_is_the_same_with_and_without_the_local_softmax",
        ),
    ),
    Tier(
        "fa2",
        "FlashAttention-2",
        ALL_TESTS,
        "fa2 and not (cuda or slow)",
        "cuda",
        parallel=False,
        smoke=(f"{KERNEL_TESTS}/fa2/test_fa2_gpu.py::test_fa2_gpu_routing_picks_fa2",),
    ),
    Tier(
        "cuda",
        "CUDA experiment",
        ALL_TESTS,
        "cuda and not slow",
        "cuda",
        parallel=False,
        smoke=(f"{KERNEL_TESTS}/selected/cuda/test_cuda_sel_gpu.py::test_cuda_sel_parity",),
    ),
    Tier(
        "slow",
        "Slow: compiles, grad and train smokes",
        ALL_TESTS,
        "slow",
        "cuda",
        extra_args=("--run-slow",),
        smoke=(
            f"{KERNEL_TESTS}/test_compile_gpu.py::"
            "test_the_layer_compiles_to_one_graph_without_a_break[64k]",
        ),
    ),
)

CPU_TIERS = tuple(t for t in TIERS if t.hardware == "cpu")
GPU_TIERS = tuple(t for t in TIERS if t.hardware == "cuda")


def tier(name: str) -> Tier:
    for t in TIERS:
        if t.name == name:
            return t
    raise KeyError(f"no tier {name!r} (tiers: {', '.join(t.name for t in TIERS)})")


def merged(name: str, title: str, parts: Sequence[Tier]) -> Tier:
    """One pytest run of ``parts``: their markers joined with ``or``.

    The parts must share paths, hardware, environment and extra arguments and all be parallel,
    so that the run selects exactly their tests under the conditions each was defined with.
    One run saves a collection per part and lets a single worker pool drain every test, where
    the tail of one part would otherwise leave workers idle before the next part starts.
    """
    first = parts[0]
    for part in parts[1:]:
        same = (part.paths, part.hardware, dict(part.env), part.extra_args) == (
            first.paths,
            first.hardware,
            dict(first.env),
            first.extra_args,
        )
        if not same:
            raise ValueError(f"tiers {first.name} and {part.name} differ beyond their markers")
    if not all(part.parallel for part in parts):
        raise ValueError("only parallel tiers merge into one run")
    return Tier(
        name,
        title,
        first.paths,
        " or ".join(f"({part.markers})" for part in parts),
        first.hardware,
        env=first.env,
        extra_args=first.extra_args,
        smoke=tuple(test for part in parts for test in part.smoke),
    )


# A pull request's GPU run: every GPU tier but ``slow``, whose tests each take tens of seconds
# (compiles, long training smokes) and run on a second label and on main. Its two parallel
# tiers run as one pytest run (see ``merged``).
GPU_QUICK_TIERS = tuple(t for t in GPU_TIERS if t.name != "slow")
GPU_QUICK_RUNS = (
    merged(
        "triton-gpu+gpu",
        "Triton kernels compiled and GPU parity (GPU)",
        [tier("triton-gpu"), tier("gpu")],
    ),
    *(t for t in GPU_QUICK_TIERS if t.name not in ("triton-gpu", "gpu")),
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Read the test tiers.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="one line per tier")
    p_args = sub.add_parser("args", help="pytest arguments of a tier, one per line")
    p_args.add_argument("name")
    p_args.add_argument(
        "--under", nargs="+", help="run only the tier's tests inside these folders or files"
    )
    p_env = sub.add_parser("env", help="KEY=VALUE lines of a tier's environment")
    p_env.add_argument("name")
    args = parser.parse_args(argv)

    try:
        if args.command == "list":
            for t in TIERS:
                env = " ".join(f"{k}={v}" for k, v in t.env.items())
                print(
                    f"{t.name:<12} {t.hardware:<5} {' '.join(t.pytest_args())}"
                    f"{'  ' + env if env else ''}"
                )
        elif args.command == "args":
            print("\n".join(tier(args.name).pytest_args(args.under)))
        else:
            for key, value in tier(args.name).env.items():
                print(f"{key}={value}")
    except (KeyError, ValueError) as err:
        print(f"tiers: {err.args[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
