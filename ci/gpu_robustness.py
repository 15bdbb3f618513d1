#!/usr/bin/env python3
"""GPU robustness of the Triton kernels: compute-sanitizer, long sequences, randomized parity.

One command per part; ``ci/gpu_robustness.sh`` runs them on a GPU host with a timeout each and
prints the summary last. Each part writes ``<part>.json`` under ``--out`` (progress goes to
stderr); ``report`` merges them into ``report.json`` and ``report.md``::

    python ci/gpu_robustness.py sanitize          # memcheck + racecheck over the kernel sweep
    python ci/gpu_robustness.py sanitize-target   # the sweep itself (what the sanitizer runs)
    python ci/gpu_robustness.py long              # T = 128k, 256k: selected branch and the core
    python ci/gpu_robustness.py parity            # 200 random cases, every GPU backend
    python ci/gpu_robustness.py plan              # the parity cases of a seed (no GPU needed)
    python ci/gpu_robustness.py report            # merge the parts, print one line per part

What each part checks:

- ``sanitize``: a sweep of small shapes that launches every Triton kernel of nsa_kernels
  (block scoring, compressed and selected branches forward and backward, dense and varlen,
  G in {1, 3, 16}, lengths that end inside every block and tile, a varlen batch with a
  sequence of one token, the gated combine, the attention core, the fused decode step) runs
  plainly (checking results against the reference and failing on any kernel it never launched)
  and under ``compute-sanitizer --tool memcheck`` and ``--tool racecheck``: 0 errors each. Each
  run is split into ``--shards`` processes, all started together: Triton compiles on the CPU.
- ``long``: T = 128k and 256k, B = 1, HQ = 64, H = 4, d = 128, bf16, the paper's l=32, d=16,
  l'=64, n=16, w=512: the Triton selected branch forward and backward, then the whole attention
  core (``nsa_core.nsa_attention``) on its default routes; outputs and row gradients of 64 sampled
  rows (the last ones included) against a float32 recomputation of those rows with the reference
  ops (``q_start`` = the row), block indices under the index contract, every gradient finite.
- ``parity``: random shapes and configs from a fixed seed; every non-reference backend of every op
  that accepts a case, pinned through the toggles (``NSA_<STEP>_BACKEND`` as a ``Toggles`` value),
  against the reference in float32 (float64 for float32 inputs). The cases share a few
  geometries (each compiles its own kernels) and run in one worker process per geometry.
  ``--seed S --case N`` replays one case; case N of a seed is the same whatever ``--cases``.

Bounds are docs/spec.md's ("Tolerances"): relative error ||out - ref|| / ||ref|| at most 1e-5 for
float32 against float64, 1e-2 for bfloat16 and 5e-3 for float16 against float32, gradients twice
that; block scoring keeps the index contract (``nsa_kernels.scoring.contract``).

``--device cpu`` runs the same code on tiny shapes with the Triton backends called by name under
``TRITON_INTERPRET=1`` (the registry routes every CPU call to the reference), so the script can be
exercised without a GPU; bfloat16 and the sanitizer need the GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import inspect
import io
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import tokenize
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from nsa_core import NSAConfig
    from nsa_core.registry import OpContext
    from nsa_core.toggles import Toggles

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = "artifacts/gpu_robustness"
PARTS = ("sanitize", "long", "parity")
DEFAULT_SEED = 13
DEFAULT_CASES = 200
# Sequences shorter than this count as short (FlexAttention serves from 256 tokens on).
SHORT = 256

# docs/spec.md, "Tolerances": relative error of a kernel against the reference on the same
# inputs (float32 against float64; 16-bit against float32); gradients get GRAD_FACTOR times it.
BOUNDS = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 5e-3}
GRAD_FACTOR = 2.0

# compute-sanitizer's exit status when it found errors (the sweep's own failures exit 1).
SANITIZER_ERROR_EXIT = 86


def log(part: str, message: str) -> None:
    """A progress line on stderr (stdout carries the sweep's protocol lines)."""
    print(f"[{part}] {message}", file=sys.stderr, flush=True)


# ============================================================================ parity plan
# Pure Python (random.Random): the same seed gives the same cases on any machine.


@dataclass(frozen=True)
class Limits:
    """What the random cases may draw from.

    ``max_tokens``: the longest sequence (keys); ``max_q_heads``: HQ; ``groups``: G values, one
    per geometry in turn; ``head_dims``: (dk, dv) pairs, ``wide_head_dims`` a pair given to one
    geometry (dk = 192); ``strides``: d (l and l' are 1-4 times d); ``geometries``: how many
    distinct geometries (each compiles its own kernels) the cases share; ``lengths``: how many
    distinct sequence lengths they share.
    """

    max_tokens: int
    max_q_heads: int
    max_kv_heads: int
    groups: tuple[int, ...]
    head_dims: tuple[tuple[int, int], ...]
    wide_head_dims: tuple[int, int] | None
    strides: tuple[int, ...]
    dtypes: tuple[str, ...]
    geometries: int
    lengths: int
    max_batch: int = 2


GPU_LIMITS = Limits(
    max_tokens=3000,
    max_q_heads=64,
    max_kv_heads=4,
    groups=(1, 2, 3, 4, 8, 16),
    head_dims=tuple((dk, dv) for dk in (32, 64, 128) for dv in (32, 64, 128)),
    wide_head_dims=(192, 128),
    strides=(8, 16, 32),
    dtypes=("float16", "bfloat16", "float32"),
    geometries=6,
    lengths=8,
)

# The interpreter runs every program in numpy: a handful of tokens and heads.
CPU_LIMITS = Limits(
    max_tokens=40,
    max_q_heads=6,
    max_kv_heads=2,
    groups=(1, 2, 3),
    head_dims=((16, 16), (32, 16)),
    wide_head_dims=None,
    strides=(4, 8),
    dtypes=("float32",),
    geometries=2,
    lengths=3,
)


@dataclass(frozen=True)
class Geometry:
    """The compile-time side of a case: dtype, heads, head dims, l, d, l', n, w, gradients."""

    dtype: str
    num_kv_heads: int
    group: int
    head_dim_qk: int
    head_dim_v: int
    cmp_block: int
    cmp_stride: int
    sel_block: int
    num_selected: int
    window: int
    grad: bool

    @property
    def num_q_heads(self) -> int:
        return self.num_kv_heads * self.group

    def describe(self) -> str:
        return (
            f"{self.dtype} H={self.num_kv_heads} G={self.group} dk={self.head_dim_qk} "
            f"dv={self.head_dim_v} l={self.cmp_block} d={self.cmp_stride} l'={self.sel_block} "
            f"n={self.num_selected} w={self.window}{' +grad' if self.grad else ''}"
        )


def geometry_problems(geometry: Geometry) -> list[str]:
    """The NSAConfig rules (nsa_core/config.py, docs/spec.md "Symbols") a geometry breaks."""
    g = geometry
    problems = []
    # Every int field is a head count, a head dim or a length in tokens: all must be >= 1.
    for f in dataclasses.fields(g):
        if f.type == "int" and getattr(g, f.name) < 1:
            problems.append(f"{f.name} must be >= 1")
    if g.cmp_stride >= 1 and g.cmp_block % g.cmp_stride:
        problems.append("d must divide l")
    if g.cmp_stride >= 1 and g.sel_block % g.cmp_stride:
        problems.append("d must divide l'")
    if g.num_selected < 3:
        problems.append("n must be >= 3 (forced initial and two local blocks)")
    if g.head_dim_qk % 2:
        problems.append("dk must be even (rotary embedding)")
    if g.dtype not in BOUNDS:
        problems.append(f"dtype {g.dtype} has no bound in docs/spec.md")
    return problems


@dataclass(frozen=True)
class ParityCase:
    """One random case: a geometry of the plan, batch, length, where the queries start, varlen.

    ``seq_len`` is the keys of each sequence (dense) or the packed total (varlen); queries are
    the positions ``[q_start, seq_len)``. ``seqlens`` (varlen, B == 1, q_start == 0) may hold
    sequences of 0 and 1 tokens. ``data_seed`` seeds the inputs.
    """

    index: int
    geometry: int
    batch: int
    seq_len: int
    q_start: int
    seqlens: tuple[int, ...] | None
    data_seed: int

    @property
    def query_len(self) -> int:
        return self.seq_len - self.q_start

    def describe(self) -> str:
        if self.seqlens is not None:
            return f"varlen {list(self.seqlens)}"
        start = f" q_start={self.q_start}" if self.q_start else ""
        return f"B={self.batch} T={self.seq_len}{start}"


@dataclass(frozen=True)
class ParityPlan:
    seed: int
    limits: Limits
    geometries: tuple[Geometry, ...]
    lengths: tuple[int, ...]
    cases: tuple[ParityCase, ...]


def _draw_geometry(
    rng: random.Random, limits: Limits, index: int, order: dict[str, list[Any]]
) -> Geometry:
    """Geometry ``index``; ``order`` (shuffled once per plan) spreads groups and dtypes."""
    group = order["groups"][index % len(order["groups"])]
    dtype = order["dtypes"][index % len(order["dtypes"])]
    kv_cap = max(1, min(limits.max_kv_heads, limits.max_q_heads // group))
    kv_heads = rng.randint(1, kv_cap)
    dims = rng.choice(limits.head_dims)
    if index == 1 and limits.wide_head_dims is not None:
        dims = limits.wide_head_dims  # one geometry with dk = 192, dv = 128 (the paper's)
    stride = rng.choice(limits.strides)
    if index == 0:
        cmp_mult, sel_mult = 1, 1  # l = d = l': scores reduce to the compressed probabilities
    else:
        cmp_mult, sel_mult = rng.randint(1, 4), rng.randint(1, 4)
    # w = 1 (the token alone) and the paper's 512 one time in five each, else log-uniform
    spread = int(math.exp(rng.uniform(math.log(2), math.log(1024))))
    window = rng.choice((1, 512, spread, spread, spread))
    return Geometry(
        dtype=dtype,
        num_kv_heads=kv_heads,
        group=group,
        head_dim_qk=dims[0],
        head_dim_v=dims[1],
        cmp_block=stride * cmp_mult,
        cmp_stride=stride,
        sel_block=stride * sel_mult,
        num_selected=rng.randint(3, 16),
        window=min(window, 4 * limits.max_tokens),
        grad=index % 2 == 0,
    )


def _draw_lengths(rng: random.Random, limits: Limits) -> tuple[int, ...]:
    """The sequence lengths the cases share: 1, the longest, and as many short ones (log-uniform
    below SHORT: inside a block or a tile, under FlexAttention's cutoff) as long ones."""
    lengths = {1, limits.max_tokens}
    short = min(SHORT, limits.max_tokens // 2)
    while len(lengths) < min(limits.lengths, limits.max_tokens):
        if len(lengths) % 2 and short > 2:
            lengths.add(int(math.exp(rng.uniform(math.log(2), math.log(short)))))
        else:
            lengths.add(rng.randint(short, limits.max_tokens))
    return tuple(sorted(lengths))


def _partition(rng: random.Random, total: int) -> tuple[int, ...]:
    """Packed sequence lengths summing to ``total``: 1-5 pieces, often a 1 and sometimes a 0."""
    pieces = rng.randint(1, 5)
    cuts = sorted(rng.randint(0, total) for _ in range(pieces - 1))
    lengths = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
    if total >= 2 and rng.random() < 0.5:
        # a sequence of one token: it sees no compressed block and only itself
        at = rng.randrange(len(lengths))
        donor = max(range(len(lengths)), key=lambda i: lengths[i])
        lengths[donor] -= 1
        lengths.insert(at, 1)
    return tuple(lengths)


def _draw_case(
    rng: random.Random,
    index: int,
    seed: int,
    plan_geometries: int,
    lengths: Sequence[int],
    limits: Limits,
) -> ParityCase:
    geometry = rng.randrange(plan_geometries)
    seq_len = rng.choice(lengths)
    data_seed = zlib.crc32(f"{seed}:{index}".encode())
    if rng.random() < 0.3:
        return ParityCase(index, geometry, 1, seq_len, 0, _partition(rng, seq_len), data_seed)
    batch = rng.randint(1, limits.max_batch)
    q_start = rng.randint(1, seq_len - 1) if seq_len > 1 and rng.random() < 0.3 else 0
    return ParityCase(index, geometry, batch, seq_len, q_start, None, data_seed)


def make_plan(seed: int, num_cases: int, limits: Limits) -> ParityPlan:
    """The parity cases of ``seed``: case i depends only on the seed, not on ``num_cases``."""
    if num_cases < 0:
        raise ValueError(f"num_cases must be >= 0, got {num_cases}")
    rng = random.Random(seed)
    order: dict[str, list[Any]] = {
        "groups": rng.sample(list(limits.groups), len(limits.groups)),
        "dtypes": rng.sample(list(limits.dtypes), len(limits.dtypes)),
    }
    geometries = tuple(_draw_geometry(rng, limits, i, order) for i in range(limits.geometries))
    for g in geometries:
        problems = geometry_problems(g)
        if problems:
            raise AssertionError(f"drew an invalid geometry {g.describe()}: {problems}")
    lengths = _draw_lengths(rng, limits)
    cases = tuple(
        _draw_case(rng, i, seed, len(geometries), lengths, limits) for i in range(num_cases)
    )
    return ParityPlan(seed, limits, geometries, lengths, cases)


def describe_plan(plan: ParityPlan) -> str:
    lines = [f"seed {plan.seed}: {len(plan.cases)} cases, lengths {list(plan.lengths)}"]
    lines += [f"  geometry {i}: {g.describe()}" for i, g in enumerate(plan.geometries)]
    lines += [
        f"  case {c.index}: geometry {c.geometry}, {c.describe()}, data seed {c.data_seed}"
        for c in plan.cases
    ]
    return "\n".join(lines)


def parse_lengths(text: str) -> list[int]:
    """``"128k,256k,3000"`` -> [131072, 262144, 3000] (k = 1024)."""
    out = []
    for item in filter(None, (part.strip().lower() for part in text.split(","))):
        scale = 1024 if item.endswith("k") else 1
        digits = item[:-1] if item.endswith("k") else item
        if not digits.isdigit() or int(digits) < 1:
            raise ValueError(f"{item!r} is not a length like 4096 or 128k")
        out.append(int(digits) * scale)
    if not out:
        raise ValueError(f"no lengths in {text!r}")
    return out


def sample_rows(seq_len: int, count: int, *, last: int = 8) -> list[int]:
    """``count`` distinct rows of a sequence, ascending: row 0, the ``last`` final rows (where
    int32 offsets overflow first), and the rest evenly spread with a deterministic jitter."""
    count = min(count, seq_len)
    rows = set(range(max(0, seq_len - min(last, count)), seq_len))
    if count > len(rows):
        rows.add(0)
    rng = random.Random(seq_len)
    spread = count - len(rows)
    for i in range(spread):
        lo = (i * (seq_len - last)) // max(spread, 1)
        hi = ((i + 1) * (seq_len - last)) // max(spread, 1)
        rows.add(rng.randrange(lo, max(hi, lo + 1)))
    candidate = 1
    while len(rows) < count:  # collisions on short sequences: fill with the first free rows
        rows.add(candidate)
        candidate += 1
    return sorted(rows)[:count]


# ============================================================================ sanitizer output

_ERROR_SUMMARY = re.compile(r"ERROR SUMMARY:\s+(\d+)\s+errors?")
_RACECHECK_SUMMARY = re.compile(
    r"RACECHECK SUMMARY:\s+(\d+)\s+hazards?\s+displayed\s+\((\d+)\s+errors?,\s+(\d+)\s+warnings?\)"
)
_SANITIZER_LINE = re.compile(r"^=+ (\S.*)$")
_NOT_FINDINGS = ("COMPUTE-SANITIZER", "ERROR SUMMARY", "RACECHECK SUMMARY", "LEAK SUMMARY")
_FINDING_KERNEL = re.compile(r"\bat (.+?)\+0x[0-9a-fA-F]+")
_SWEEP_OK = re.compile(r"^SWEEP ok (\S+)")
_SWEEP_FAIL = re.compile(r"^SWEEP FAIL (\S+): (.*)$")
_SWEEP_KERNELS = re.compile(r"^SWEEP kernels (found|launched)=(\S*)$")


@dataclass(frozen=True)
class SweepSummary:
    """What one sweep process printed: cases passed and failed, and (when it ran the whole
    sweep or a shard of it) the kernels it found and those it launched, by qualified name."""

    ok: tuple[str, ...]
    failed: tuple[tuple[str, str], ...]
    found: frozenset[str] | None
    launched: frozenset[str]

    @staticmethod
    def merge(parts: Sequence[SweepSummary]) -> SweepSummary:
        """The summary of a sweep run as shards."""
        founds = [p.found for p in parts if p.found is not None]
        return SweepSummary(
            tuple(n for p in parts for n in p.ok),
            tuple(f for p in parts for f in p.failed),
            frozenset().union(*founds) if founds else None,
            frozenset().union(*(p.launched for p in parts)),
        )

    def missing(self, exempt: Sequence[str] = ()) -> list[str]:
        """Kernels found and never launched, except those whose function name is exempt."""
        if self.found is None:
            return []
        return sorted(k for k in self.found - self.launched if k.rsplit(".", 1)[-1] not in exempt)


def parse_sweep(text: str) -> SweepSummary:
    ok: list[str] = []
    failed: list[tuple[str, str]] = []
    kernels: dict[str, frozenset[str]] = {}
    for line in text.splitlines():
        if m := _SWEEP_OK.match(line):
            ok.append(m.group(1))
        elif m := _SWEEP_FAIL.match(line):
            failed.append((m.group(1), m.group(2)))
        elif m := _SWEEP_KERNELS.match(line):
            kernels[m.group(1)] = frozenset(filter(None, m.group(2).split(",")))
    return SweepSummary(
        tuple(ok), tuple(failed), kernels.get("found"), kernels.get("launched", frozenset())
    )


def parse_shard(text: str) -> tuple[int, int]:
    """``"2/6"`` -> (2, 6): shard 2 of 6 (0-based)."""
    index, sep, count = text.partition("/")
    if not (sep and index.isdigit() and count.isdigit()) or not 0 <= int(index) < int(count):
        raise ValueError(f"--shard wants I/N with 0 <= I < N, got {text!r}")
    return int(index), int(count)


def shard_of(items: Sequence[Any], index: int, count: int) -> list[Any]:
    """Every ``count``-th item from ``index`` on: the heavy families of the sweep (one case per
    G, each compiling its own kernels) spread evenly over the shards."""
    return list(items[index::count])


@dataclass(frozen=True)
class SanitizerSummary:
    """The verdict lines of one compute-sanitizer run.

    ``errors``: the sum of every "ERROR SUMMARY: N errors" line (one per process checked), else
    racecheck's summed "RACECHECK SUMMARY" errors, None when there is neither (the tool did not
    finish); ``race_errors``/``race_warnings``: racecheck's
    "RACECHECK SUMMARY" counts (None for other tools); ``first_finding``: the first report line.
    """

    errors: int | None
    race_errors: int | None
    race_warnings: int | None
    first_finding: str
    kernels: tuple[tuple[str, int], ...] = ()  # (kernel, errors reported in it), by name


def kernel_name(symbol: str) -> str:
    """``fmha_cutlassF_bf16(Params)`` / ``foo<int>`` / ``sel_fwd_kernel`` -> the bare name."""
    return re.split(r"[(<]", symbol, maxsplit=1)[0].strip()


def finding_kernels(text: str) -> Counter[str]:
    """Errors per kernel: each report block that starts with an error line (not a warning, not a
    summary) counts once for the kernel named by its first ``at NAME+0x..`` location."""
    found: Counter[str] = Counter()
    open_block = False
    for line in text.splitlines():
        if not line.startswith("="):
            continue
        if m := _SANITIZER_LINE.match(line):  # a block's first line (details are indented)
            open_block = not m.group(1).startswith((*_NOT_FINDINGS, "Warning"))
        if open_block and (k := _FINDING_KERNEL.search(line)):
            found[kernel_name(k.group(1))] += 1
            open_block = False
    return found


def parse_sanitizer(text: str) -> SanitizerSummary:
    errors = race_errors = race_warnings = None
    first = ""
    for line in text.splitlines():
        if m := _ERROR_SUMMARY.search(line):
            errors = (errors or 0) + int(m.group(1))
        elif m := _RACECHECK_SUMMARY.search(line):
            race_errors = (race_errors or 0) + int(m.group(2))
            race_warnings = (race_warnings or 0) + int(m.group(3))
        elif (
            not first
            and (m := _SANITIZER_LINE.match(line))
            and not m.group(1).startswith(_NOT_FINDINGS)
        ):
            first = m.group(1).strip()
    if errors is None and race_errors is not None:
        # racecheck may end on its own summary alone (it exits with the error code on hazards):
        # that summary is its verdict, and the run finished.
        errors = race_errors
    kernels = tuple(sorted(finding_kernels(text).items()))
    return SanitizerSummary(errors, race_errors, race_warnings, first, kernels)


# ============================================================================ report


@dataclass
class PartResult:
    """What one part writes to ``<part>.json``: PASS/FAIL, one headline, details, failures."""

    part: str
    status: str
    headline: str
    wall_s: float
    details: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PartResult:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def missing_part(part: str) -> PartResult:
    return PartResult(
        part,
        "FAIL",
        f"no result: the part did not finish (timed out or crashed); see {part}.log",
        0.0,
    )


def load_parts(out: Path, sections: Sequence[str]) -> list[PartResult]:
    results = []
    for part in sections:
        path = out / f"{part}.json"
        if not path.is_file():
            results.append(missing_part(part))
            continue
        try:
            results.append(PartResult.from_json(json.loads(path.read_text())))
        except (ValueError, TypeError) as exc:
            results.append(PartResult(part, "FAIL", f"unreadable {path.name}: {exc}", 0.0))
    return results


def summary_lines(results: Sequence[PartResult]) -> list[str]:
    """The table printed last: one line per part, then the verdict."""
    lines = [f"{'part':<9} {'result':<6} {'time':>7}  what"]
    for r in results:
        lines.append(f"{r.part:<9} {r.status:<6} {r.wall_s:>6.0f}s  {r.headline}")
        lines += [f"{'':<26}- {failure}" for failure in r.failures[:5]]
        if len(r.failures) > 5:
            lines.append(f"{'':<26}  ... {len(r.failures) - 5} more in {r.part}.json")
    failed = [r.part for r in results if r.status != "PASS"]
    lines.append(f"GPU robustness: {'FAIL (' + ', '.join(failed) + ')' if failed else 'PASS'}")
    return lines


def markdown_report(results: Sequence[PartResult]) -> str:
    env = next((r.env for r in results if r.env), {})
    lines = ["# GPU robustness", ""]
    if env:
        lines += [", ".join(f"{k} {v}" for k, v in env.items()), ""]
    lines += ["| part | result | time | what |", "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.part} | {r.status} | {r.wall_s:.0f} s | {r.headline} |")
    for r in results:
        lines += ["", f"## {r.part}: {r.status}", "", r.headline]
        if r.failures:
            lines += ["", "Failures:", ""] + [f"- {f}" for f in r.failures]
        for key, value in r.details.items():
            if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
                lines += ["", f"{key}:", "", "```", *value, "```"]
            elif isinstance(value, (str, int, float)):
                lines.append(f"- {key}: {value}")
    return "\n".join(lines) + "\n"


def write_part(out: Path, result: PartResult) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{result.part}.json").write_text(json.dumps(result.to_json(), indent=2) + "\n")


# ============================================================================ runtime (torch)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def is_fatal_cuda_error(exc: BaseException) -> bool:
    """An error after which the CUDA context is unusable (every later launch fails too)."""
    text = str(exc).lower()
    return any(
        s in text
        for s in (
            "illegal memory access",
            "illegal address",
            "misaligned address",
            "unspecified launch failure",
            "device-side assert",
            "illegal instruction",
        )
    )


@dataclass
class Runtime:
    """The device a part runs on and how ops reach the backend under test.

    On CUDA the public ops run (after checking the registry picks the expected backend); on a
    CPU under ``TRITON_INTERPRET=1`` the registry never picks a Triton backend, so the backend of
    that name is called directly with the process's toggles.
    """

    device: torch.device
    interpreter: bool

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def setup_runtime(device: str) -> Runtime:
    """Register nsa_kernels' backends (a checkout runs from PYTHONPATH, without its entry point)
    and check that the device and the Triton mode agree."""
    import torch

    from nsa_core import registry
    from nsa_kernels.registration import register

    register(registry.register_backend)
    interpreter = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(
                "no CUDA device is visible to torch; use --device cpu with TRITON_INTERPRET=1"
            )
        if interpreter:
            raise SystemExit("TRITON_INTERPRET=1 runs the kernels on the CPU; unset it on the GPU")
    elif device == "cpu":
        if not interpreter:
            raise SystemExit(
                "--device cpu runs the Triton kernels in the interpreter: set TRITON_INTERPRET=1"
            )
    else:
        raise SystemExit(f"--device must be cuda or cpu, got {device!r}")
    return Runtime(torch.device(device), interpreter)


def environment(rt: Runtime | None = None) -> dict[str, str]:
    env = {"python": sys.version.split()[0]}
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda"] = str(torch.version.cuda)
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
    except ImportError as exc:
        env["torch"] = f"not importable ({exc})"
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError as exc:
        env["triton"] = f"not importable ({exc})"
    if rt is not None and rt.interpreter:
        env["mode"] = "TRITON_INTERPRET=1 on CPU"
    return env


def torch_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype


def reference_dtype(dtype: torch.dtype) -> torch.dtype:
    """docs/spec.md: 16-bit kernels against float32, float32 kernels against float64."""
    import torch

    return torch.float64 if dtype == torch.float32 else torch.float32


def bound_for(dtype: torch.dtype) -> float:
    return BOUNDS[str(dtype).removeprefix("torch.")]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 on the device (||out - ref|| where ref is 0); inf
    when out holds a non-finite value (the inputs of every check here are finite)."""
    import torch

    o, r = out.detach().double(), ref.detach().double()
    if not bool(torch.isfinite(o).all()):
        return math.inf
    diff = float((o - r).norm())
    denom = float(r.norm())
    return diff / denom if denom > 0 else diff


def op_context_for(op: str, args: Sequence[Any], kwargs: dict[str, Any]) -> OpContext:
    """The OpContext ``nsa_core.ops`` builds for a call of ``op`` (same rules as ops.py)."""
    import torch

    from nsa_core.ops import op_context

    q_start = int(kwargs.get("q_start", 0))
    varlen = kwargs.get("cu_seqlens") is not None
    if op == "select_blocks":
        q, k_cmp = args[0].detach(), args[1].detach()
        return op_context(q, k_cmp, k_cmp, q_start + q.shape[1], varlen=varlen)
    if op == "compressed_attention":
        q, k, v = args[:3]
        return op_context(q, k, v, q_start + q.shape[1], varlen=varlen)
    if op in ("selected_attention", "sliding_attention"):
        q, k, v = args[:3]
        return op_context(q, k, v, k.shape[1], varlen=varlen)
    if op == "gated_combine":
        # As nsa_core.ops.gated_combine: no kv heads and one head dim, so H = HQ and dk = dv
        # (o_cmp stands for q, k and v); gradients reach all four inputs, the gates included.
        o = args[0]
        ctx = op_context(o, o, o, o.shape[1], varlen=False)
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in args[:4])
        return dataclasses.replace(ctx, requires_grad=grad)
    raise ValueError(f"no context rule for op {op!r}")


def call_op(rt: Runtime, op: str, expected: Sequence[str], *args: Any, **kwargs: Any) -> Any:
    """Run the public op ``op`` after checking the registry routes it to one of ``expected``.

    Where the default route is another GPU backend (FA-2 installed, say), ``expected[0]`` runs
    pinned (``NSA_<STEP>_BACKEND`` as a Toggles value), which fails if it declines the call:
    the point is to run that kernel. Under the interpreter (CPU, where the registry routes to
    the reference) ``expected[0]`` is called by name.
    """
    import nsa_core.ops
    from nsa_core import registry
    from nsa_core.toggles import get_toggles

    backend = {b.name: b for b in registry.backends(op)}[expected[0]]
    if rt.interpreter:
        return backend.fn(*args, toggles=get_toggles(), **kwargs)
    ctx = op_context_for(op, args, kwargs)
    chosen = registry.resolve(op, ctx, get_toggles()).backend.name
    if chosen in expected:
        return getattr(nsa_core.ops, op)(*args, **kwargs)
    if chosen == "reference":
        raise AssertionError(f"{op} is routed to the reference on CUDA, expected {list(expected)}")
    toggles = pinned_toggles(op, backend.name)
    picked = registry.resolve(op, ctx, toggles).backend  # raises with the reason if it declines
    return picked.fn(*args, toggles=toggles, **kwargs)


def randn(
    gen: torch.Generator, shape: Sequence[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    import torch

    return torch.randn(tuple(shape), generator=gen, device=device, dtype=torch.float32).to(dtype)


def make_cu_seqlens(seqlens: Sequence[int], device: torch.device) -> torch.Tensor:
    import torch

    offsets = [0]
    for n in seqlens:
        offsets.append(offsets[-1] + n)
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def leaves(tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Fresh leaf copies (optionally cast) that collect gradients."""
    return [t.detach().to(dtype or t.dtype).clone().requires_grad_() for t in tensors]


def grads(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    import torch

    return [t.grad if t.grad is not None else torch.zeros_like(t) for t in tensors]


def backprop(out: torch.Tensor, grad: torch.Tensor, *, retain_graph: bool = False) -> None:
    """out.backward(grad), typed."""
    import torch

    torch.autograd.backward(out, grad, retain_graph=retain_graph)


def check_pair(
    name: str,
    kernel: Callable[..., torch.Tensor],
    reference: Callable[..., torch.Tensor],
    inputs: Sequence[torch.Tensor],
    do: torch.Tensor,
    grad_names: Sequence[str],
) -> None:
    """kernel(*inputs) against reference(*inputs in the reference dtype), forward and backward
    (upstream gradient ``do``), within the bounds of the inputs' dtype; raises on a miss."""
    dtype = inputs[0].dtype
    bound, up = bound_for(dtype), reference_dtype(dtype)
    kern, ref = leaves(inputs), leaves(inputs, up)
    out, out_ref = kernel(*kern), reference(*ref)
    backprop(out, do)
    backprop(out_ref, do.to(up))
    _check_close(f"{name} o", out, out_ref, bound)
    for grad_name, a, b in zip(grad_names, grads(kern), grads(ref), strict=True):
        _check_close(f"{name} {grad_name}", a, b, GRAD_FACTOR * bound)


# ============================================================================ sanitize: sweep

# Kernels of nsa_kernels the sweep may leave unlaunched, by function name, with the reason
# (none today: every kernel there serves an op); any other kernel it never launches fails it.
KERNEL_EXEMPT: dict[str, str] = {}


def _is_triton_function(obj: object) -> bool:
    names = {cls.__name__ for cls in type(obj).__mro__}
    return bool(names & {"JITFunction", "InterpretedFunction"}) and hasattr(obj, "fn")


def _source(fn: Any) -> str:
    src = getattr(fn, "src", None)
    if isinstance(src, str):
        return src
    try:
        return inspect.getsource(fn.fn)
    except (OSError, TypeError):
        return ""


def _names_in(source: str) -> list[str]:
    """The identifiers of ``source`` (strings, docstrings and comments left out)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(textwrap.dedent(source)).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return re.findall(r"\w+", source)
    return [t.string for t in tokens if t.type == tokenize.NAME]


class LaunchRecorder:
    """Stands in for a Triton kernel in a launching module: records ``kernel[grid]`` launches."""

    def __init__(self, kernel: Any, key: str, launched: set[str]) -> None:
        self._kernel = kernel
        self._key = key
        self._launched = launched

    def __getitem__(self, grid: Any) -> Any:
        self._launched.add(self._key)
        return self._kernel[grid]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kernel, name)


@contextmanager
def kernel_launches() -> Iterator[tuple[dict[str, Any], set[str]]]:
    """Every Triton kernel of nsa_kernels (``*_kernel`` functions, by qualified name), and a set
    that fills with the ones launched inside the block.

    Each module that launches a kernel gets a recorder in its place until the block ends; a
    module whose own Triton functions use the name keeps the kernel (a recorder there would
    reach the compiler).
    """
    import importlib
    import pkgutil

    import nsa_kernels

    for info in pkgutil.walk_packages(nsa_kernels.__path__, "nsa_kernels."):
        importlib.import_module(info.name)
    modules = {n: m for n, m in list(sys.modules.items()) if n.split(".")[0] == "nsa_kernels" and m}
    kernels: dict[str, Any] = {}
    for module in modules.values():
        for attr, obj in vars(module).items():
            if attr.endswith("_kernel") and _is_triton_function(obj):
                kernels[f"{obj.fn.__module__}.{obj.fn.__name__}"] = obj
    launched: set[str] = set()
    by_id = {id(k): key for key, k in kernels.items()}
    replaced: list[tuple[Any, str, Any]] = []
    for name, module in modules.items():
        # Triton functions defined here resolve their globals in this module's namespace.
        own = [
            o for o in vars(module).values() if _is_triton_function(o) and o.fn.__module__ == name
        ]
        for attr, obj in list(vars(module).items()):
            key = by_id.get(id(obj))
            if key is None:
                continue
            # A kernel's own source names it once, in its ``def`` line; any other use in a Triton
            # function of this module would reach the compiler as a recorder: leave those alone.
            uses = sum(_names_in(_source(f)).count(attr) - (f is obj) for f in own)
            if uses > 0:
                continue
            replaced.append((module, attr, obj))
            setattr(module, attr, LaunchRecorder(obj, key, launched))
    try:
        yield kernels, launched
    finally:
        for module, attr, obj in replaced:
            setattr(module, attr, obj)


@dataclass(frozen=True)
class SweepShapes:
    """Small shapes for the sweep: every length ends inside a block and a tile."""

    dtype: torch.dtype
    head_dim: int
    tokens: int
    seqlens: tuple[int, ...]
    q_start: int
    cmp_block: int
    cmp_stride: int
    sel_block: int
    num_selected: int
    window: int
    kv_heads: int
    groups: tuple[int, ...]

    def config(self, group: int) -> NSAConfig:
        """The layer of the core and decode sweeps: G = ``group``, dk = dv = ``head_dim``."""
        from nsa_core import NSAConfig

        return NSAConfig(
            num_q_heads=self.kv_heads * group,
            num_kv_heads=self.kv_heads,
            head_dim_qk=self.head_dim,
            head_dim_v=self.head_dim,
            cmp_block=self.cmp_block,
            cmp_stride=self.cmp_stride,
            sel_block=self.sel_block,
            num_selected=self.num_selected,
            window=self.window,
        )


def sweep_shapes(rt: Runtime) -> SweepShapes:
    import torch

    if rt.interpreter:
        return SweepShapes(
            torch.float32, 16, 45, (1, 20, 0, 11, 13), 13, 8, 4, 16, 4, 24, 1, (1, 3, 16)
        )
    # 150 = 4*32 + 22 = 9*16 + 6: partial selection, compressed and kernel tiles everywhere.
    return SweepShapes(
        torch.bfloat16, 64, 150, (1, 70, 0, 33, 46), 37, 16, 8, 32, 4, 40, 2, (1, 3, 16)
    )


def _check_close(name: str, got: torch.Tensor, ref: torch.Tensor, bound: float) -> None:
    err = rel_err(got, ref)
    if not err <= bound:
        raise AssertionError(f"{name}: relative error {err:.3e} > {bound:.0e}")


def _check_contract(
    idx: torch.Tensor,
    counts: torch.Tensor,
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    s: SweepShapes,
    q_start: int,
    cu: torch.Tensor | None,
) -> None:
    from nsa_core.reference import select_blocks
    from nsa_kernels.scoring.contract import assert_index_contract, reference_scores, row_positions

    geo = (s.cmp_block, s.cmp_stride, s.sel_block)
    ref_idx, _ = select_blocks(q, k_cmp, *geo, s.num_selected, q_start=q_start, cu_seqlens=cu)
    scores = reference_scores(q, k_cmp, *geo, q_start=q_start, cu_seqlens=cu)
    positions = row_positions(q.shape[1], q_start, None if cu is None else cu.cpu())
    assert_index_contract(idx, counts, ref_idx, scores, positions, s.sel_block)


def _sweep_branches(
    rt: Runtime,
    s: SweepShapes,
    group: int,
    *,
    varlen: bool = False,
    q_start: int = 0,
    dtype: torch.dtype | None = None,
    dims: tuple[int, int] | None = None,
) -> None:
    """select_blocks, compressed and selected branches (forward and backward) through the ops."""
    import torch

    from nsa_core.reference import compress, compressed_attention, selected_attention

    dtype = dtype or s.dtype
    dk, dv = dims or (s.head_dim, s.head_dim)
    gen = torch.Generator(device=rt.device).manual_seed(group * 1000 + q_start + 7 * varlen)
    batch, h = (1 if varlen else 2), s.kv_heads
    tk = s.tokens
    cu = make_cu_seqlens(s.seqlens, rt.device) if varlen else None
    q = randn(gen, (batch, tk - q_start, h * group, dk), dtype, rt.device)
    k = randn(gen, (batch, tk, h, dk), dtype, rt.device)
    v = randn(gen, (batch, tk, h, dv), dtype, rt.device)
    k_cmp = compress(k, s.cmp_block, s.cmp_stride, cu_seqlens=cu)
    v_cmp = compress(v, s.cmp_block, s.cmp_stride, cu_seqlens=cu)
    geo = (s.cmp_block, s.cmp_stride, s.sel_block, s.num_selected)
    idx, counts = call_op(
        rt, "select_blocks", ["triton_score"], q, k_cmp, *geo, q_start=q_start, cu_seqlens=cu
    )
    _check_contract(idx, counts, q, k_cmp, s, q_start, cu)
    do = randn(gen, (*q.shape[:3], dv), dtype, rt.device)
    kw: dict[str, Any] = {"q_start": q_start, "cu_seqlens": cu}
    check_pair(
        "compressed",
        lambda q, k, v: call_op(
            rt, "compressed_attention", ["triton_cmp"], q, k, v, *geo[:2], **kw
        ),
        lambda q, k, v: compressed_attention(q, k, v, *geo[:2], **kw),
        (q, k_cmp, v_cmp),
        do,
        ("dq", "dk_cmp", "dv_cmp"),
    )
    check_pair(
        "selected",
        lambda q, k, v: call_op(
            rt, "selected_attention", ["triton_sel"], q, k, v, idx, s.sel_block, **kw
        ),
        lambda q, k, v: selected_attention(q, k, v, idx, s.sel_block, **kw),
        (q, k, v),
        do,
        ("dq", "dk", "dv"),
    )


def _sweep_scoring_with_lse(rt: Runtime, s: SweepShapes, group: int, varlen: bool) -> None:
    """Block scoring fed the compressed branch's lse (its normaliser pass skipped)."""
    import torch

    from nsa_core.reference import compress
    from nsa_kernels.compressed.triton_function import compressed_attention_triton_with_lse
    from nsa_kernels.scoring.function import select_blocks_triton

    gen = torch.Generator(device=rt.device).manual_seed(group + 11 * varlen)
    cu = make_cu_seqlens(s.seqlens, rt.device) if varlen else None
    batch = 1 if varlen else 2
    q_start = 0 if varlen else s.q_start
    q = randn(gen, (batch, s.tokens - q_start, s.kv_heads * group, s.head_dim), s.dtype, rt.device)
    k = randn(gen, (batch, s.tokens, s.kv_heads, s.head_dim), s.dtype, rt.device)
    k_cmp = compress(k, s.cmp_block, s.cmp_stride, cu_seqlens=cu)
    _, lse = compressed_attention_triton_with_lse(
        q, k_cmp, k_cmp, s.cmp_block, s.cmp_stride, q_start=q_start, cu_seqlens=cu
    )
    geo = (s.cmp_block, s.cmp_stride, s.sel_block, s.num_selected)
    idx, counts = select_blocks_triton(q, k_cmp, *geo, q_start=q_start, cu_seqlens=cu, lse=lse)
    _check_contract(idx, counts, q, k_cmp, s, q_start, cu)


def _sweep_split_backwards(rt: Runtime, s: SweepShapes) -> None:
    """Backwards split over query segments (their reduce kernels) and other tile choices."""
    import torch

    from nsa_core.reference import compress, compressed_attention, select_blocks, selected_attention
    from nsa_kernels.compressed.triton_function import CmpConfig, compressed_attention_triton
    from nsa_kernels.selected.function import SelConfig, selected_attention_triton

    gen = torch.Generator(device=rt.device).manual_seed(5)
    group, h, dk = 3, s.kv_heads, s.head_dim
    q = randn(gen, (1, s.tokens, h * group, dk), s.dtype, rt.device)
    k = randn(gen, (1, s.tokens, h, dk), s.dtype, rt.device)
    v = randn(gen, (1, s.tokens, h, dk), s.dtype, rt.device)
    do = randn(gen, q.shape, s.dtype, rt.device)
    geo = (s.cmp_block, s.cmp_stride)
    k_cmp, v_cmp = compress(k, *geo), compress(v, *geo)
    check_pair(
        "compressed dkv_segment=16",
        lambda q, k, v: compressed_attention_triton(
            q, k, v, *geo, config=CmpConfig(dkv_segment=16)
        ),
        lambda q, k, v: compressed_attention(q, k, v, *geo),
        (q, k_cmp, v_cmp),
        do,
        ("dq", "dk_cmp", "dv_cmp"),
    )
    idx, _ = select_blocks(q, k_cmp, *geo, s.sel_block, s.num_selected)
    configs = [
        SelConfig(heads_per_prog=1, segment_tokens=16, rows_per_prog=2, block_l=16),
        SelConfig(tma=2, block_dv=16, block_d=16),
    ]
    for config in configs:
        check_pair(
            f"selected {config.describe()}",
            lambda q, k, v, config=config: selected_attention_triton(
                q, k, v, idx, s.sel_block, config=config
            ),
            lambda q, k, v: selected_attention(q, k, v, idx, s.sel_block),
            (q, k, v),
            do,
            ("dq", "dk", "dv"),
        )


def _sweep_quick(rt: Runtime, s: SweepShapes) -> None:
    """The quick-sanity selection entry points, dense and varlen (an empty range included)."""
    import torch

    from nsa_kernels.selected.quick import sel_attn_fwd_dense, sel_attn_fwd_varlen

    gen = torch.Generator(device=rt.device).manual_seed(3)
    rows, heads, d, keys = 5, 3, s.head_dim, 37
    q = randn(gen, (rows, heads, d), s.dtype, rt.device)
    k = randn(gen, (rows, keys, d), s.dtype, rt.device)
    v = randn(gen, (rows, keys, d), s.dtype, rt.device)
    up = reference_dtype(s.dtype)
    probs = torch.softmax(torch.einsum("nhd,nld->nhl", q.to(up), k.to(up)) * d**-0.5, dim=-1)
    _check_close(
        "quick dense",
        sel_attn_fwd_dense(q, k, v),
        torch.einsum("nhl,nld->nhd", probs, v.to(up)),
        bound_for(s.dtype),
    )
    lengths = [9, 0, 30, 1, 7]
    cu = make_cu_seqlens(lengths, rt.device)
    kp = randn(gen, (sum(lengths), d), s.dtype, rt.device)
    vp = randn(gen, (sum(lengths), d), s.dtype, rt.device)
    want = []
    for r, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        if a == b:
            want.append(torch.zeros(heads, d, dtype=up, device=rt.device))
            continue
        p = torch.softmax(q[r].to(up) @ kp[a:b].to(up).T * d**-0.5, dim=-1)
        want.append(p @ vp[a:b].to(up))
    _check_close(
        "quick varlen", sel_attn_fwd_varlen(q, kp, vp, cu), torch.stack(want), bound_for(s.dtype)
    )


def _sweep_core(rt: Runtime, s: SweepShapes, group: int, varlen: bool) -> None:
    """The attention core, forward and backward, on its default routes (whatever kernels it
    uses now, a Triton combine included)."""
    import torch

    from nsa_core import nsa_attention

    gen = torch.Generator(device=rt.device).manual_seed(17 + group)
    cfg = s.config(group)
    batch = 1 if varlen else 2
    cu = make_cu_seqlens(s.seqlens, rt.device) if varlen else None
    shape_k = (batch, s.tokens, s.kv_heads, s.head_dim)
    q = randn(gen, (batch, s.tokens, cfg.num_q_heads, s.head_dim), s.dtype, rt.device)
    kv = [randn(gen, shape_k, s.dtype, rt.device) for _ in range(6)]
    gates = torch.sigmoid(randn(gen, (*q.shape[:3], 3), torch.float32, rt.device)).to(s.dtype)
    xs = leaves([q, *kv, gates])
    k = {"cmp": xs[1], "slc": xs[2], "win": xs[3]}
    v = {"cmp": xs[4], "slc": xs[5], "win": xs[6]}
    o = nsa_attention(xs[0], k, v, xs[7], cfg, cu_seqlens=cu)
    backprop(o, torch.ones_like(o))
    for name, t in zip(
        ("o", "dq", "dk_cmp", "dk_slc", "dk_win", "dv_cmp", "dv_slc", "dv_win", "dgates"),
        [o, *grads(xs)],
        strict=True,
    ):
        if not bool(torch.isfinite(t).all()):
            raise AssertionError(f"core {name} holds non-finite values")


def _sweep_decode(rt: Runtime, s: SweepShapes, group: int, thin: bool) -> None:
    """The fused decode step: ragged lengths (0, 1, partial blocks), a few tokens each."""
    import torch

    from nsa_kernels.decode import (
        DecodeKernelConfig,
        DecodePlan,
        DecodeState,
        StepInputs,
        decode_step,
    )

    gen = torch.Generator(device=rt.device).manual_seed(23 + group)
    cfg = s.config(group)
    lengths = [0, 1, s.tokens // 3, s.tokens - 5]
    steps = 4
    total = max(lengths) + steps
    h, hq, d = cfg.num_kv_heads, cfg.num_q_heads, s.head_dim
    branches = ("cmp", "slc", "win")
    k = {b: randn(gen, (len(lengths), total, h, d), s.dtype, rt.device) for b in branches}
    v = {b: randn(gen, (len(lengths), total, h, d), s.dtype, rt.device) for b in branches}
    q = randn(gen, (len(lengths), total, hq, d), s.dtype, rt.device)
    gates = torch.rand(len(lengths), total, hq, 3, generator=gen, device=rt.device).to(s.dtype)
    state = DecodeState.from_prefixes(cfg, k, v, lengths, total + 2)
    config = (
        DecodeKernelConfig(
            key_tile=16,
            cmp_chunk_tiles=1,
            window_chunk=16,
            sel_tile=16,
            sel_splits=4,
            score_chunk=16,
            combine_tile=2,
            combine_heads=1,
        )
        if thin
        else None
    )
    plan = DecodePlan(state, config)
    seq = torch.arange(len(lengths), device=rt.device)
    for step in range(steps):
        pos = torch.tensor([n + step for n in lengths], device=rt.device)
        inputs = StepInputs(
            q=q[seq, pos],
            k_cmp=k["cmp"][seq, pos],
            v_cmp=v["cmp"][seq, pos],
            k_slc=k["slc"][seq, pos],
            v_slc=v["slc"][seq, pos],
            k_win=k["win"][seq, pos],
            v_win=v["win"][seq, pos],
            gates=gates[seq, pos],
        )
        out = decode_step(state, inputs, plan=plan)
        if not bool(torch.isfinite(out.o).all()):
            raise AssertionError(f"decode step {step}: non-finite output")
    if state.lengths() != [n + steps for n in lengths]:
        raise AssertionError(f"decode lengths {state.lengths()} after {steps} steps from {lengths}")


def _sweep_combine(rt: Runtime, s: SweepShapes, expected: Sequence[str]) -> None:
    """The gated combine op on its GPU backend, forward and backward."""
    import torch

    from nsa_core.reference import gated_combine

    gen = torch.Generator(device=rt.device).manual_seed(29)
    shape = (2, s.tokens, 3 * s.kv_heads, s.head_dim + 8)  # dv off the power-of-two tiles
    outs = [randn(gen, shape, s.dtype, rt.device) for _ in range(3)]
    gates = torch.sigmoid(randn(gen, (*shape[:3], 3), torch.float32, rt.device)).to(s.dtype)
    do = randn(gen, shape, s.dtype, rt.device)
    check_pair(
        "combine",
        lambda *xs: call_op(rt, "gated_combine", expected, *xs),
        gated_combine,
        (*outs, gates),
        do,
        ("do_cmp", "do_slc", "do_win", "dgates"),
    )


def sweep_cases(rt: Runtime) -> list[tuple[str, Callable[[], None]]]:
    """The sanitizer sweep: (name, run) pairs, each a few small launches and their checks."""
    import torch

    s = sweep_shapes(rt)
    cases: list[tuple[str, Callable[[], None]]] = []
    for g in s.groups:
        cases.append((f"branches/g{g}/dense", partial(_sweep_branches, rt, s, g)))
        cases.append((f"branches/g{g}/varlen", partial(_sweep_branches, rt, s, g, varlen=True)))
    cases.append(("branches/g3/q_start", lambda: _sweep_branches(rt, s, 3, q_start=s.q_start)))
    wide = (48, 32) if rt.interpreter else (192, 128)
    cases.append(
        (f"branches/g16/dk{wide[0]}_dv{wide[1]}", lambda: _sweep_branches(rt, s, 16, dims=wide))
    )
    if not rt.interpreter:
        cases.append(
            (
                "branches/g3/float32_dk48_dv32",
                lambda: _sweep_branches(rt, s, 3, dtype=torch.float32, dims=(48, 32)),
            )
        )
        cases.append(
            (
                "branches/g16/float16_varlen",
                lambda: _sweep_branches(rt, s, 16, varlen=True, dtype=torch.float16),
            )
        )
    cases.append(("scoring/lse/g16/dense", lambda: _sweep_scoring_with_lse(rt, s, 16, False)))
    cases.append(("scoring/lse/g3/varlen", lambda: _sweep_scoring_with_lse(rt, s, 3, True)))
    cases.append(("split_backwards/g3", lambda: _sweep_split_backwards(rt, s)))
    cases.append(("quick/dense_varlen", lambda: _sweep_quick(rt, s)))
    from nsa_core import registry

    if "gated_combine" in registry.OPS:
        names = [b.name for b in registry.backends("gated_combine") if b.name.startswith("triton")]
        if names:
            cases.append(("combine/dense", lambda: _sweep_combine(rt, s, names)))
    cases.append(("core/g3/dense", lambda: _sweep_core(rt, s, 3, False)))
    cases.append(("core/g16/varlen", lambda: _sweep_core(rt, s, 16, True)))
    for g in s.groups:
        cases.append((f"decode/g{g}", partial(_sweep_decode, rt, s, g, thin=False)))
    cases.append(("decode/g3/thin_splits", lambda: _sweep_decode(rt, s, 3, thin=True)))
    return cases


def run_sweep(device: str, only: str | None, shard: tuple[int, int] = (0, 1)) -> int:
    """The sanitizer's target: run the sweep (or one shard of it), print one protocol line per
    case and the kernels found and launched on stdout; exit 1 if a case failed."""
    rt = setup_runtime(device)
    with kernel_launches() as (kernels, launched):
        cases = [(n, f) for n, f in sweep_cases(rt) if only is None or only in n]
        failed = _run_sweep_cases(rt, shard_of(cases, *shard))
    if failed < 0:
        return 1
    if only is None:  # coverage means something only for the whole sweep
        print(f"SWEEP kernels found={','.join(sorted(kernels))}", flush=True)
    print(f"SWEEP kernels launched={','.join(sorted(launched))}", flush=True)
    return 1 if failed else 0


def _run_sweep_cases(rt: Runtime, cases: Sequence[tuple[str, Callable[[], None]]]) -> int:
    """Run the cases, one protocol line each; the number that failed, -1 if the CUDA context
    was lost (nothing after it can run)."""
    failed = 0
    for name, run in cases:
        start = time.perf_counter()
        try:
            run()
            if rt.cuda:
                import torch

                torch.cuda.synchronize()
        except Exception as exc:  # one case's failure must not hide the others'
            failed += 1
            print(f"SWEEP FAIL {name}: {first_line(exc)}", flush=True)
            if is_fatal_cuda_error(exc):
                print(
                    "SWEEP FAIL context: the CUDA context is lost; later cases cannot run",
                    flush=True,
                )
                return -1
            continue
        print(f"SWEEP ok {name} ({time.perf_counter() - start:.1f} s)", flush=True)
    return failed


# ============================================================================ sanitize: driver


def find_sanitizer() -> str | None:
    """compute-sanitizer: $COMPUTE_SANITIZER, PATH, then the CUDA toolkit's usual homes."""
    candidates = [os.environ.get("COMPUTE_SANITIZER"), shutil.which("compute-sanitizer")]
    candidates.append("/usr/local/cuda/bin/compute-sanitizer")
    candidates += sorted(glob.glob("/usr/local/cuda-*/bin/compute-sanitizer"), reverse=True)
    for path in candidates:
        if path and os.access(path, os.X_OK):
            return path
    return None


@dataclass
class Child:
    name: str
    command: list[str]
    log_path: Path
    timeout_s: float
    process: subprocess.Popen[bytes] | None = None
    start: float = 0.0
    returncode: int | None = None
    timed_out: bool = False
    wall_s: float = 0.0


def visible_gpus(device: str, env: dict[str, str]) -> list[str]:
    """The CUDA device ids children may be pinned to (``CUDA_VISIBLE_DEVICES`` values); empty on
    CPU or with one GPU, where every child simply inherits ``env``."""
    if device != "cuda":
        return []
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        ids = [i.strip() for i in listed.split(",") if i.strip()]
    else:
        import torch

        ids = [str(i) for i in range(torch.cuda.device_count())]
    return ids if len(ids) > 1 else []


def run_children(
    children: Sequence[Child], env: dict[str, str], part: str, gpus: Sequence[str] = ()
) -> None:
    """Start ``children`` together, wait, kill a child past its timeout (its whole group).

    ``gpus``: device ids; child i runs on ``gpus[i % len(gpus)]`` alone, so a host with several
    GPUs runs the children side by side on all of them."""
    for i, child in enumerate(children):
        child.log_path.parent.mkdir(parents=True, exist_ok=True)
        handle = child.log_path.open("wb")
        child.start = time.perf_counter()
        gpu = gpus[i % len(gpus)] if gpus else None
        child_env = env if gpu is None else {**env, "CUDA_VISIBLE_DEVICES": gpu}
        child.process = subprocess.Popen(
            child.command,
            stdout=handle,
            stderr=subprocess.STDOUT,
            env=child_env,
            cwd=ROOT,
            start_new_session=True,
        )
        handle.close()
        on_gpu = "" if gpu is None else f" on GPU {gpu}"
        log(
            part,
            f"{child.name}: started{on_gpu} ({' '.join(child.command[:4])} ...), "
            f"log {child.log_path}",
        )
    last_note = time.perf_counter()
    while any(c.returncode is None for c in children):
        time.sleep(1.0)
        for child in children:
            if child.returncode is not None or child.process is None:
                continue
            elapsed = time.perf_counter() - child.start
            code = child.process.poll()
            if code is not None:
                child.returncode, child.wall_s = code, elapsed
                log(part, f"{child.name}: exit {code} after {elapsed:.0f} s")
            elif elapsed > child.timeout_s:
                os.killpg(child.process.pid, signal.SIGKILL)
                child.returncode, child.timed_out, child.wall_s = (
                    child.process.wait(),
                    True,
                    elapsed,
                )
                log(part, f"{child.name}: killed after {elapsed:.0f} s (timeout)")
        if time.perf_counter() - last_note > 30:
            last_note = time.perf_counter()
            running = [
                f"{c.name} {time.perf_counter() - c.start:.0f} s"
                for c in children
                if c.returncode is None
            ]
            if running:
                log(part, "running: " + ", ".join(running))


def sanitizer_command(sanitizer: str, tool: str, target: Sequence[str]) -> list[str]:
    """compute-sanitizer running ``target`` under ``tool``; exit SANITIZER_ERROR_EXIT on errors."""
    return [
        sanitizer,
        "--tool",
        tool,
        "--error-exitcode",
        str(SANITIZER_ERROR_EXIT),
        "--print-limit",
        "100",
        *target,
    ]


def _named_counts(counts: Counter[str]) -> str:
    """``name xN`` for each, the name cut to 60 characters."""
    return ", ".join(f"{name[:60]} x{n}" for name, n in counts.most_common())


def _tool_verdict(
    tool: str, runs: Sequence[Child], plain: SweepSummary
) -> tuple[str, dict[str, Any], list[str]]:
    """(summary line, details, failures) of one tool over its runs (one per shard)."""
    texts = [c.log_path.read_text(errors="replace") for c in runs]
    found = [parse_sanitizer(t) for t in texts]
    under = SweepSummary.merge([parse_sweep(t) for t in texts])
    finished = all(f.errors is not None for f in found) and not any(c.timed_out for c in runs)
    errors = sum(f.errors or 0 for f in found)
    # Errors inside kernels that are not this project's (torch's SDPA reached through the
    # sliding branch's SDPA route) are reported apart; an error in one of ours, or one the log
    # does not tie to a kernel, fails the part. Without the sweep's list of our kernels (a
    # --case run) every error counts.
    foreign: Counter[str] = Counter()
    if plain.found is not None:
        ours = {name.rsplit(".", 1)[-1] for name in plain.found}
        for f in found:
            for name, count in f.kernels:
                if name not in ours:
                    foreign[name] += count
    own = errors - min(errors, sum(foreign.values()))
    warnings = [f.race_warnings for f in found if f.race_warnings is not None]
    first = next((f.first_finding for f in found if f.first_finding), "")
    codes = sorted({c.returncode for c in runs}, key=lambda code: code == 0)
    wall = max(c.wall_s for c in runs)
    race = f" ({sum(warnings)} race warnings)" if warnings else ""
    ran = len(under.ok) + len(under.failed)
    elsewhere = (
        f" + {sum(foreign.values())} in kernels not ours ({_named_counts(foreign)})"
        if foreign
        else ""
    )
    line = (
        f"{tool} {own if finished else '?'} errors{elsewhere}{race}, exit {codes}, "
        f"sweep {len(under.ok)}/{ran} ok, {wall:.0f} s"
    )
    details = {
        "errors": own if finished else None,
        "errors_in_other_kernels": dict(foreign),
        "race_warnings": sum(warnings) if warnings else None,
        "first_finding": first,
        "exits": [c.returncode for c in runs],
        "timed_out": [c.name for c in runs if c.timed_out],
        "sweep_ok": len(under.ok),
        "sweep_failed": [f"{n}: {w}" for n, w in under.failed],
        "wall_s": round(wall, 1),
        "logs": [c.log_path.name for c in runs],
    }
    failures = []
    if not finished:
        unfinished = [c.log_path.name for c, f in zip(runs, found, strict=True) if f.errors is None]
        failures.append(f"{tool}: did not finish (no ERROR SUMMARY); see {', '.join(unfinished)}")
    # The tool exits with its error code on any error, ours or not: a non-zero exit fails the
    # part unless errors in other kernels account for it and every sweep case passed.
    exit_explained = bool(foreign) and not under.failed
    if own:
        failures.append(f"{tool}: {own} errors; first: {first}")
    elif finished and codes != [0] and not exit_explained:
        failed = [n for n, _ in under.failed]
        failures.append(f"{tool}: exit {codes}; sweep cases failed: {failed}")
    if finished and len(under.ok) != len(plain.ok):
        failures.append(
            f"{tool}: {len(under.ok)} sweep cases passed under the tool, {len(plain.ok)} without"
        )
    return line, details, failures


def run_sanitize(args: argparse.Namespace) -> PartResult:
    """The sweep without the sanitizer (results against the reference, kernel coverage) and
    under each tool, each split into ``--shards`` processes, all started together: Triton
    compiles on the CPU, so the shards compile their kernels side by side (each tool compiles
    the same kernels into the shared cache), and the wall time is about one compile pass of a
    shard plus the slowest tool's shard."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    env = dict(os.environ)
    # One cudaMalloc per tensor: inside the caching allocator's pooled blocks memcheck cannot
    # see an access past a tensor's end.
    env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    target = [sys.executable, str(Path(__file__).resolve()), "sanitize-target"]
    target += ["--device", args.device] + (["--case", args.case] if args.case else [])
    shards = [[*target, "--shard", f"{i}/{args.shards}"] for i in range(args.shards)]
    sanitizer = find_sanitizer()
    runs: dict[str, list[Child]] = {
        "plain": [
            Child(f"plain {i}", shard, out / f"sanitize_plain_{i}.log", args.plain_timeout)
            for i, shard in enumerate(shards)
        ]
    }
    for tool in args.tools if sanitizer is not None else []:
        assert sanitizer is not None
        runs[tool] = [
            Child(
                f"{tool} {i}",
                sanitizer_command(sanitizer, tool, shard),
                out / f"sanitize_{tool}_{i}.log",
                args.tool_timeout,
            )
            for i, shard in enumerate(shards)
        ]
    children = [c for tool_children in runs.values() for c in tool_children]
    run_children(children, env, "sanitize", visible_gpus(args.device, env))

    plain = runs.pop("plain")
    sweep = SweepSummary.merge([parse_sweep(c.log_path.read_text(errors="replace")) for c in plain])
    missing = sweep.missing(sorted(KERNEL_EXEMPT))
    total = "?" if sweep.found is None else len(sweep.found)
    details: dict[str, Any] = {
        "sweep_cases": len(sweep.ok) + len(sweep.failed),
        "kernels": f"{len(sweep.launched)} of {total} kernels launched",
        "shards": args.shards,
    }
    failures = [f"sweep {name}: {why}" for name, why in sweep.failed]
    if missing:
        failures.append(f"kernels the sweep never launched: {', '.join(missing)}")
    for child in plain:
        if child.timed_out or (child.returncode != 0 and not sweep.failed):
            timeout = " (timeout)" if child.timed_out else ""
            failures.append(
                f"{child.name}: exit {child.returncode}{timeout}; see {child.log_path.name}"
            )
    if sanitizer is None:
        failures.append("compute-sanitizer not found ($COMPUTE_SANITIZER, PATH, /usr/local/cuda*)")
    else:
        details["sanitizer"] = sanitizer
    lines = []
    for tool, children in runs.items():
        line, tool_details, tool_failures = _tool_verdict(tool, children, sweep)
        lines.append(line)
        details[tool] = tool_details
        failures += tool_failures
    details["tools"] = lines
    counts = "; ".join(line.split(", exit")[0] for line in lines) or "no sanitizer run"
    headline = (
        f"{counts}; sweep {len(sweep.ok)}/{details['sweep_cases']} cases ok, {details['kernels']}"
    )
    status = "FAIL" if failures else "PASS"
    wall = time.perf_counter() - start
    return PartResult("sanitize", status, headline, wall, details, failures, environment())


# ============================================================================ long sequences


@dataclass
class Measure:
    """One compared quantity: its error against the reference and its bound (or a failure)."""

    name: str
    error: float | None
    bound: float | None
    note: str = ""

    @property
    def passed(self) -> bool:
        return self.error is not None and self.bound is not None and self.error <= self.bound

    def line(self) -> str:
        if self.error is None:
            return f"{self.name}: {self.note}"
        verdict = "ok" if self.passed else "FAIL"
        extra = f" ({self.note})" if self.note else ""
        return f"{self.name}: {self.error:.3e} <= {self.bound:.0e} {verdict}{extra}"


@contextmanager
def timed(part: str, what: str) -> Iterator[None]:
    start = time.perf_counter()
    log(part, f"{what} ...")
    yield
    log(part, f"{what}: {time.perf_counter() - start:.1f} s")


def _sync(rt: Runtime) -> None:
    if rt.cuda:
        import torch

        torch.cuda.synchronize()


def _paper_config(hq: int, h: int, dk: int, dv: int) -> Any:
    from nsa_core import NSAConfig

    return NSAConfig(num_q_heads=hq, num_kv_heads=h, head_dim_qk=dk, head_dim_v=dv)


def _contract_on_rows(
    idx: torch.Tensor,
    counts: torch.Tensor,
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    cfg: Any,
    rows: Sequence[int],
) -> Measure:
    """The index contract on sampled rows, each against the reference at q_start = row."""
    import torch

    from nsa_core.reference import select_blocks
    from nsa_kernels.scoring.contract import check_index_contract, reference_scores

    geo = (cfg.cmp_block, cfg.cmp_stride, cfg.sel_block)
    broken = tolerance = 0
    first = ""
    for t in rows:
        qr = q[:, t : t + 1]
        ref_idx, _ = select_blocks(qr, k_cmp, *geo, cfg.num_selected, q_start=t)
        scores = reference_scores(qr, k_cmp, *geo, q_start=t)
        report = check_index_contract(
            idx[:, t : t + 1],
            counts[:, t : t + 1],
            ref_idx,
            scores,
            torch.tensor([t]),
            cfg.sel_block,
        )
        broken += report.broken_rows
        tolerance += report.tolerance_rows
        first = first or report.first_broken
    rows_checked = len(rows) * idx.shape[2]
    note = f"{tolerance} tolerance rows of {rows_checked}" + (
        f"; first broken: {first}" if first else ""
    )
    return Measure("select_blocks index contract (broken rows)", float(broken), 0.0, note)


def _long_selected(
    rt: Runtime, tokens: int, a: argparse.Namespace, gen: torch.Generator
) -> list[Measure]:
    """The selected branch (Triton) forward and backward at ``tokens`` tokens, checked on rows.

    Block indices come from the Triton block scoring (checked under the index contract on the
    sampled rows). A backward with a dense upstream gradient checks that every gradient is
    finite and gives dq of the sampled rows (dq of a row depends on its own upstream gradient
    only); a second backward with the upstream gradient of the sampled rows alone gives dk and
    dv that the reference recomputes exactly from those rows.
    """
    import torch

    from nsa_core.reference import compress, selected_attention

    cfg = _paper_config(a.hq, a.h, a.dim, a.dim)
    dtype = torch_dtype(a.dtype)
    bound = bound_for(dtype)
    rows = sample_rows(tokens, a.rows)
    # Leaves from the start: at 256k tokens q alone is 4 GiB in bf16, so no second copy.
    q = randn(gen, (1, tokens, a.hq, a.dim), dtype, rt.device).requires_grad_()
    k = randn(gen, (1, tokens, a.h, a.dim), dtype, rt.device).requires_grad_()
    v = randn(gen, (1, tokens, a.h, a.dim), dtype, rt.device).requires_grad_()
    with timed("long", f"T={tokens} selected: block scoring"), torch.no_grad():
        k_cmp = compress(k.detach(), cfg.cmp_block, cfg.cmp_stride)
        geo = (cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, cfg.num_selected)
        idx, counts = call_op(rt, "select_blocks", ["triton_score"], q.detach(), k_cmp, *geo)
        measures = [_contract_on_rows(idx, counts, q.detach(), k_cmp, cfg, rows)]
        del k_cmp
        _sync(rt)
    do = randn(gen, q.shape, dtype, rt.device)
    with timed("long", f"T={tokens} selected: forward and backward"):
        o = call_op(rt, "selected_attention", ["triton_sel"], q, k, v, idx, cfg.sel_block)
        backprop(o, do, retain_graph=True)
        _sync(rt)
    bad = [n for n, t in zip(("o", "dq", "dk", "dv"), [o, *grads([q, k, v])], strict=True)
           if not bool(torch.isfinite(t).all())]  # fmt: skip
    measures.append(
        Measure("selected outputs and gradients finite", float(len(bad)), 0.0, ", ".join(bad))
    )
    dq_rows = grads([q])[0][:, rows].clone()
    for leaf in (q, k, v):
        leaf.grad = None
    do_rows = torch.zeros_like(do)
    do_rows[:, rows] = do[:, rows]
    with timed("long", f"T={tokens} selected: backward of the sampled rows"):
        backprop(o, do_rows)
        _sync(rt)
    del do_rows
    o_rows = o.detach()[:, rows].clone()
    del o
    dk_rows, dv_rows = grads([k, v])
    kf, vf = leaves([k, v], torch.float32)
    ref_o, ref_dq = [], []
    with timed("long", f"T={tokens} selected: float32 reference on {len(rows)} rows"):
        for t in rows:
            qr = q.detach()[:, t : t + 1].float().requires_grad_()
            out = selected_attention(qr, kf, vf, idx[:, t : t + 1], cfg.sel_block, q_start=t)
            backprop(out, do[:, t : t + 1].float())
            assert qr.grad is not None
            ref_o.append(out.detach())
            ref_dq.append(qr.grad)
        _sync(rt)
    ref_dk, ref_dv = grads([kf, vf])
    grad_bound = GRAD_FACTOR * bound
    measures += [
        Measure("selected o (sampled rows)", rel_err(o_rows, torch.cat(ref_o, 1)), bound),
        Measure("selected dq (sampled rows)", rel_err(dq_rows, torch.cat(ref_dq, 1)), grad_bound),
        Measure("selected dk (loss of the sampled rows)", rel_err(dk_rows, ref_dk), grad_bound),
        Measure("selected dv (loss of the sampled rows)", rel_err(dv_rows, ref_dv), grad_bound),
    ]
    return measures


def _core_routes(rt: Runtime, tokens: int, q: torch.Tensor, k: torch.Tensor) -> list[str]:
    """The routing report of the core's calls; on CUDA no step may fall back to the reference."""
    from nsa_core import registry
    from nsa_core.ops import op_context
    from nsa_core.toggles import get_toggles

    ctx = op_context(q, k, k, tokens, varlen=False)
    routing = registry.routing_report(ctx, get_toggles()).splitlines()
    for line in routing:
        log("long", f"T={tokens} route {line}")
    if rt.cuda:
        for line in routing:
            op, chosen = line.split("->")[0].strip(), line.split("->")[1].split()[0]
            if chosen == "reference":
                raise AssertionError(f"the core routes {op} to the reference at T={tokens}")
    return routing


def _long_core(
    rt: Runtime, tokens: int, a: argparse.Namespace, gen: torch.Generator
) -> tuple[list[Measure], list[str]]:
    """The attention core (nsa_attention) forward and backward on its default routes.

    Its output rows, and dq and dgates of those rows (each depends on that row's upstream
    gradient only: selection carries no gradient), against the reference ops recomputing the
    rows in float32 with the block indices the core used; every gradient finite.
    """
    import torch

    from nsa_core import nsa_attention
    from nsa_core.attention import branch_outputs
    from nsa_core.reference import (
        compress,
        compressed_attention,
        gated_combine,
        selected_attention,
        sliding_attention,
    )

    cfg = _paper_config(a.hq, a.h, a.dim, a.dim)
    dtype = torch_dtype(a.dtype)
    bound = bound_for(dtype)
    rows = sample_rows(tokens, a.rows)
    branches = ("cmp", "slc", "win")
    q = randn(gen, (1, tokens, a.hq, a.dim), dtype, rt.device).requires_grad_()
    k = {
        b: randn(gen, (1, tokens, a.h, a.dim), dtype, rt.device).requires_grad_() for b in branches
    }
    v = {
        b: randn(gen, (1, tokens, a.h, a.dim), dtype, rt.device).requires_grad_() for b in branches
    }
    gates = torch.sigmoid(randn(gen, (1, tokens, a.hq, 3), torch.float32, rt.device))
    gates = gates.to(dtype).requires_grad_()
    routing = _core_routes(rt, tokens, q, k["slc"])
    inputs = [q, *(k[b] for b in branches), *(v[b] for b in branches), gates]
    do = randn(gen, q.shape, dtype, rt.device)
    with timed("long", f"T={tokens} core: forward and backward"):
        o = nsa_attention(q, k, v, gates, cfg)
        backprop(o, do)
        _sync(rt)
    names = ("o", "dq", "dk_cmp", "dk_slc", "dk_win", "dv_cmp", "dv_slc", "dv_win", "dgates")
    bad = [n for n, t in zip(names, [o, *grads(inputs)], strict=True)
           if not bool(torch.isfinite(t).all())]  # fmt: skip
    measures = [Measure("core outputs and gradients finite", float(len(bad)), 0.0, ", ".join(bad))]
    o_rows = o.detach()[:, rows].clone()
    dq_rows = grads([q])[0][:, rows].clone()
    dg_rows = grads([gates])[0][:, rows].clone()
    del o
    for leaf in inputs:
        leaf.grad = None
    q0, g0 = q.detach(), gates.detach()
    k0 = {b: x.detach() for b, x in k.items()}
    v0 = {b: x.detach() for b, x in v.items()}
    with timed("long", f"T={tokens} core: the block indices it used"), torch.no_grad():
        # branch_outputs is what nsa_attention runs (block scoring fed whatever the compressed
        # branch hands it): deterministic kernels give the very indices of the forward above.
        k_cmp = compress(k0["cmp"], cfg.cmp_block, cfg.cmp_stride)
        v_cmp = compress(v0["cmp"], cfg.cmp_block, cfg.cmp_stride)
        idx = branch_outputs(cfg, q0, k_cmp, v_cmp, k0["slc"], v0["slc"], k0["win"], v0["win"])[3]
        counts = (idx >= 0).sum(-1, dtype=torch.int32)
        measures.append(_contract_on_rows(idx, counts, q0, k_cmp, cfg, rows))
        del k_cmp, v_cmp
    f32 = {f"{kv}_{b}": x[b].float() for kv, x in (("k", k0), ("v", v0)) for b in branches}
    k_cmp_f = compress(f32["k_cmp"], cfg.cmp_block, cfg.cmp_stride)
    v_cmp_f = compress(f32["v_cmp"], cfg.cmp_block, cfg.cmp_stride)
    ref_o, ref_dq, ref_dg = [], [], []
    with timed("long", f"T={tokens} core: float32 reference on {len(rows)} rows"):
        for t in rows:
            qr = q0[:, t : t + 1].float().requires_grad_()
            gr = g0[:, t : t + 1].float().requires_grad_()
            row = idx[:, t : t + 1]
            o_cmp = compressed_attention(
                qr, k_cmp_f, v_cmp_f, cfg.cmp_block, cfg.cmp_stride, q_start=t
            )
            o_slc = selected_attention(
                qr, f32["k_slc"], f32["v_slc"], row, cfg.sel_block, q_start=t
            )
            o_win = sliding_attention(qr, f32["k_win"], f32["v_win"], cfg.window, q_start=t)
            out = gated_combine(o_cmp, o_slc, o_win, gr)
            backprop(out, do[:, t : t + 1].float())
            assert qr.grad is not None
            assert gr.grad is not None
            ref_o.append(out.detach())
            ref_dq.append(qr.grad)
            ref_dg.append(gr.grad)
        _sync(rt)
    grad_bound = GRAD_FACTOR * bound
    measures += [
        Measure("core o (sampled rows)", rel_err(o_rows, torch.cat(ref_o, 1)), bound),
        Measure("core dq (sampled rows)", rel_err(dq_rows, torch.cat(ref_dq, 1)), grad_bound),
        Measure("core dgates (sampled rows)", rel_err(dg_rows, torch.cat(ref_dg, 1)), grad_bound),
    ]
    return measures, routing


def run_long(args: argparse.Namespace) -> PartResult:
    import torch

    start = time.perf_counter()
    rt = setup_runtime(args.device)
    lengths = parse_lengths(args.lengths)
    details: dict[str, Any] = {
        "shape": f"B=1 HQ={args.hq} H={args.h} d={args.dim} {args.dtype}, rows {args.rows}"
    }
    failures: list[str] = []
    checked: list[str] = []
    for tokens in lengths:
        for piece in args.pieces:
            label = f"T={tokens} {piece}"
            gen = torch.Generator(device=rt.device).manual_seed(tokens + len(piece))
            if rt.cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            piece_start = time.perf_counter()
            try:
                if piece == "selected":
                    measures = _long_selected(rt, tokens, args, gen)
                else:
                    measures, routing = _long_core(rt, tokens, args, gen)
                    details[f"{label} routing"] = routing
            except Exception as exc:
                failures.append(f"{label}: {first_line(exc)}")
                log("long", f"{label}: FAILED {first_line(exc)}")
                if is_fatal_cuda_error(exc):
                    failures.append(
                        "the CUDA context is lost; the remaining long checks did not run"
                    )
                    return PartResult(
                        "long",
                        "FAIL",
                        f"{label}: {first_line(exc)}",
                        time.perf_counter() - start,
                        details,
                        failures,
                        environment(rt),
                    )
                continue
            peak = f", peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if rt.cuda else ""
            lines = [m.line() for m in measures]
            details[label] = [*lines, f"{time.perf_counter() - piece_start:.1f} s{peak}"]
            for m in measures:
                log("long", f"{label}: {m.line()}")
                if not m.passed:
                    failures.append(f"{label}: {m.line()}")
            checked.append(label)
    status = "FAIL" if failures else "PASS"
    head = (
        f"{len(checked)}/{len(lengths) * len(args.pieces)} runs within bounds "
        f"(T = {', '.join(map(str, lengths))}: {', '.join(args.pieces)})"
    )
    return PartResult(
        "long", status, head, time.perf_counter() - start, details, failures, environment(rt)
    )


# ============================================================================ randomized parity


@dataclass
class Check:
    """One backend on one case: pass/fail (with its errors), declined (why) or skipped (why)."""

    op: str
    backend: str
    status: str
    detail: str = ""


@dataclass
class CaseData:
    """The inputs of one case, on the device: q [B, Tq, HQ, dk], k [B, Tk, H, dk], v [B, Tk, H,
    dv], their compressed blocks, cu_seqlens, and the upstream gradients."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cmp: torch.Tensor
    v_cmp: torch.Tensor
    cu: torch.Tensor | None
    do: torch.Tensor


def case_data(rt: Runtime, g: Geometry, c: ParityCase) -> CaseData:
    import torch

    from nsa_core.reference import compress

    dtype = torch_dtype(g.dtype)
    gen = torch.Generator(device=rt.device).manual_seed(c.data_seed)
    q = randn(gen, (c.batch, c.query_len, g.num_q_heads, g.head_dim_qk), dtype, rt.device)
    k = randn(gen, (c.batch, c.seq_len, g.num_kv_heads, g.head_dim_qk), dtype, rt.device)
    v = randn(gen, (c.batch, c.seq_len, g.num_kv_heads, g.head_dim_v), dtype, rt.device)
    cu = make_cu_seqlens(c.seqlens, rt.device) if c.seqlens is not None else None
    k_cmp = compress(k, g.cmp_block, g.cmp_stride, cu_seqlens=cu)
    v_cmp = compress(v, g.cmp_block, g.cmp_stride, cu_seqlens=cu)
    do = randn(gen, (c.batch, c.query_len, g.num_q_heads, g.head_dim_v), dtype, rt.device)
    return CaseData(q, k, v, k_cmp, v_cmp, cu, do)


def pinned_toggles(op: str, backend: str) -> Toggles:
    """The process's toggles with ``NSA_<STEP>_BACKEND`` set to ``backend`` for ``op``."""
    from nsa_core.toggles import BACKEND_TOGGLE, get_toggles

    change: dict[str, Any] = {BACKEND_TOGGLE[op]: backend}
    return dataclasses.replace(get_toggles(), **change)


def backend_decision(
    rt: Runtime, op: str, backend: Any, ctx: OpContext
) -> tuple[Toggles, str | None]:
    """(pinned toggles, None) when ``backend`` serves ``ctx`` pinned, else (toggles, the reason).

    Under the interpreter the Triton backends serve CPU tensors by name (their ``supports`` asks
    for CUDA); on CUDA the registry's own decision for the pinned toggles is what counts.
    """
    from nsa_core import registry

    toggles = pinned_toggles(op, backend.name)
    reason = backend.supports(ctx, toggles)
    if reason is not None and rt.interpreter and backend.name.startswith("triton"):
        return toggles, None
    if reason is None:
        chosen = registry.resolve(op, ctx, toggles).backend.name
        if chosen != backend.name:
            return toggles, f"pinned, yet the registry chose {chosen}"
    return toggles, reason


@dataclass
class ParityOptions:
    flex_geometries: int
    include: tuple[str, ...] = ()


def _gpu_backends(op: str) -> list[Any]:
    from nsa_core import registry

    return [b for b in registry.backends(op) if b.name != "reference"]


def _skip_reason(
    backend: Any, geometry_index: int, plan: ParityPlan, opts: ParityOptions
) -> str | None:
    if backend.name == "flex":
        eligible = [i for i, g in enumerate(plan.geometries) if not g.group & (g.group - 1)]
        if geometry_index not in eligible[: opts.flex_geometries]:
            return (
                f"compile budget: compiled FlexAttention runs on {opts.flex_geometries} "
                "geometries (--flex-geometries)"
            )
    return None


def _check_select_blocks(
    rt: Runtime, plan: ParityPlan, c: ParityCase, d: CaseData, opts: ParityOptions
) -> list[Check]:
    """Every GPU backend of select_blocks under the index contract, without and with the
    compressed branch's lse (what the attention core hands it)."""
    from nsa_core.reference import select_blocks
    from nsa_kernels.compressed.triton_function import compressed_attention_fwd
    from nsa_kernels.scoring.contract import check_index_contract, reference_scores, row_positions

    g = plan.geometries[c.geometry]
    geo = (g.cmp_block, g.cmp_stride, g.sel_block)
    kw: dict[str, Any] = {"q_start": c.q_start, "cu_seqlens": d.cu}
    ref_idx, _ = select_blocks(d.q, d.k_cmp, *geo, g.num_selected, **kw)
    scores = reference_scores(d.q, d.k_cmp, *geo, **kw)
    positions = row_positions(c.query_len, c.q_start, None if d.cu is None else d.cu.cpu())
    ctx = op_context_for("select_blocks", (d.q, d.k_cmp), kw)
    _, lse = compressed_attention_fwd(d.q, d.k_cmp, d.v_cmp, g.cmp_block, g.cmp_stride, **kw)
    checks = []
    for backend in _gpu_backends("select_blocks"):
        toggles, reason = backend_decision(rt, "select_blocks", backend, ctx)
        skip = _skip_reason(backend, c.geometry, plan, opts)
        if reason is not None or skip is not None:
            status = "declined" if reason else "skipped"
            checks.append(Check("select_blocks", backend.name, status, reason or skip or ""))
            continue
        for label, extra in ((backend.name, {}), (f"{backend.name}+lse", {"lse": lse})):
            try:
                idx, counts = backend.fn(
                    d.q, d.k_cmp, *geo, g.num_selected, None, toggles=toggles, **kw, **extra
                )
                report = check_index_contract(idx, counts, ref_idx, scores, positions, g.sel_block)
                status = "fail" if report.broken_rows else "pass"
                detail = (
                    f"{report.broken_rows} broken, {report.tolerance_rows} tolerance rows of "
                    f"{report.rows}"
                    + (f"; first: {report.first_broken}" if report.broken_rows else "")
                )
            except Exception as exc:
                if is_fatal_cuda_error(exc):
                    raise
                status, detail = "fail", first_line(exc)
            checks.append(Check("select_blocks", label, status, detail))
    return checks


def _check_attention_op(
    rt: Runtime,
    plan: ParityPlan,
    c: ParityCase,
    op: str,
    inputs: Sequence[torch.Tensor],
    call: Callable[..., torch.Tensor],
    reference: Callable[..., torch.Tensor],
    kw: dict[str, Any],
    do: torch.Tensor,
    opts: ParityOptions,
    grad_names: Sequence[str] = ("dq", "dk", "dv"),
) -> list[Check]:
    """Every GPU backend of ``op`` against the reference on ``inputs`` (and their gradients,
    named ``grad_names``, when the geometry asks for them)."""
    g = plan.geometries[c.geometry]
    dtype = inputs[0].dtype
    bound, up = bound_for(dtype), reference_dtype(dtype)
    ref_leaves = leaves(inputs, up) if g.grad else [t.to(up) for t in inputs]
    ref = reference(*ref_leaves, **kw)
    if g.grad:
        backprop(ref, do.to(up))
    ref_grads = grads(ref_leaves) if g.grad else []
    ctx = dataclasses.replace(op_context_for(op, inputs, kw), requires_grad=g.grad)
    checks = []
    for backend in _gpu_backends(op):
        toggles, reason = backend_decision(rt, op, backend, ctx)
        skip = _skip_reason(backend, c.geometry, plan, opts)
        if reason is not None or skip is not None:
            checks.append(
                Check(op, backend.name, "declined" if reason else "skipped", reason or skip or "")
            )
            continue
        try:
            kern = leaves(inputs) if g.grad else list(inputs)
            out = call(backend.fn, *kern, toggles=toggles, **kw)
            errors = [("o", rel_err(out, ref), bound)]
            if g.grad and not out.requires_grad:
                # The reference stays connected (zero gradients where nothing is visible); a
                # detached output breaks backward() for a caller whose loss is this output.
                raise RuntimeError(
                    "the output is detached from q, k, v (no grad_fn), so backward cannot "
                    "reach them; the reference returns zero gradients here"
                )
            if g.grad:
                backprop(out, do)
                errors += [
                    (n, rel_err(a, b), GRAD_FACTOR * bound)
                    for n, a, b in zip(grad_names, grads(kern), ref_grads, strict=True)
                ]
            bad = [f"{n} {e:.3e} > {b:.0e}" for n, e, b in errors if not e <= b]
            detail = ", ".join(f"{n} {e:.2e}" for n, e, _ in errors)
            checks.append(
                Check(
                    op, backend.name, "fail" if bad else "pass", "; ".join(bad) if bad else detail
                )
            )
        except Exception as exc:
            if is_fatal_cuda_error(exc):
                raise
            checks.append(Check(op, backend.name, "fail", first_line(exc)))
    return checks


def run_parity_case(
    rt: Runtime, plan: ParityPlan, c: ParityCase, opts: ParityOptions
) -> list[Check]:
    import torch

    from nsa_core import registry
    from nsa_core.reference import (
        compressed_attention,
        gated_combine,
        select_blocks,
        selected_attention,
        sliding_attention,
    )

    g = plan.geometries[c.geometry]
    d = case_data(rt, g, c)
    kw: dict[str, Any] = {"q_start": c.q_start, "cu_seqlens": d.cu}
    checks = _check_select_blocks(rt, plan, c, d, opts)
    checks += _check_attention_op(
        rt, plan, c, "compressed_attention", (d.q, d.k_cmp, d.v_cmp),
        lambda fn, q, k, v, **kw: fn(q, k, v, g.cmp_block, g.cmp_stride, None, **kw),
        lambda q, k, v, **kw: compressed_attention(q, k, v, g.cmp_block, g.cmp_stride, **kw),
        kw, d.do, opts,
    )  # fmt: skip
    idx, _ = select_blocks(
        d.q, d.k_cmp, g.cmp_block, g.cmp_stride, g.sel_block, g.num_selected, **kw
    )
    checks += _check_attention_op(
        rt, plan, c, "selected_attention", (d.q, d.k, d.v),
        lambda fn, q, k, v, **kw: fn(q, k, v, idx, g.sel_block, None, **kw),
        lambda q, k, v, **kw: selected_attention(q, k, v, idx, g.sel_block, **kw),
        kw, d.do, opts,
    )  # fmt: skip
    checks += _check_attention_op(
        rt, plan, c, "sliding_attention", (d.q, d.k, d.v),
        lambda fn, q, k, v, **kw: fn(q, k, v, g.window, None, **kw),
        lambda q, k, v, **kw: sliding_attention(q, k, v, g.window, **kw),
        kw, d.do, opts,
    )  # fmt: skip
    if "gated_combine" in registry.OPS:
        gen = torch.Generator(device=rt.device).manual_seed(c.data_seed + 1)
        shape = d.do.shape
        branch_outs = [randn(gen, shape, d.q.dtype, rt.device) for _ in range(3)]
        gates = torch.sigmoid(randn(gen, (*shape[:3], 3), torch.float32, rt.device)).to(d.q.dtype)
        checks += _check_attention_op(
            rt, plan, c, "gated_combine", (*branch_outs, gates),
            lambda fn, o_cmp, o_slc, o_win, gates, **kw: fn(o_cmp, o_slc, o_win, gates, **kw),
            lambda o_cmp, o_slc, o_win, gates: gated_combine(o_cmp, o_slc, o_win, gates),
            {}, d.do, opts, grad_names=("do_cmp", "do_slc", "do_win", "dgates"),
        )  # fmt: skip
    covered = {"select_blocks", "compressed_attention", "selected_attention", "sliding_attention"}
    covered.add("gated_combine")
    for op in registry.OPS:
        if op not in covered:
            checks += [
                Check(op, b.name, "skipped", "op not covered by this script")
                for b in _gpu_backends(op)
            ]
    return checks


@dataclass
class BackendTally:
    passed: int = 0
    failed: int = 0
    declined: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)

    def line(self, name: str) -> str:
        parts = [f"{name}: {self.passed + self.failed} run, {self.failed} failed"]
        if self.declined:
            top = "; ".join(f"{n}x {r}" for r, n in self.declined.most_common(3))
            parts.append(f"declined {sum(self.declined.values())} ({top})")
        if self.skipped:
            top = "; ".join(f"{n}x {r}" for r, n in self.skipped.most_common(2))
            parts.append(f"skipped {sum(self.skipped.values())} ({top})")
        return ", ".join(parts)


def tally(checks_by_case: dict[int, list[Check]]) -> dict[str, BackendTally]:
    out: dict[str, BackendTally] = {}
    for checks in checks_by_case.values():
        for ch in checks:
            t = out.setdefault(f"{ch.op}/{ch.backend}", BackendTally())
            if ch.status == "pass":
                t.passed += 1
            elif ch.status == "fail":
                t.failed += 1
            elif ch.status == "declined":
                t.declined[ch.detail[:120]] += 1
            else:
                t.skipped[ch.detail[:120]] += 1
    return out


# Backends every parity run must have exercised on a GPU (and any other Triton backend it met):
# a run where they all declined (a toggle turned them off) would pass without testing them.
REQUIRED_BACKENDS = (
    "select_blocks/triton_score",
    "compressed_attention/triton_cmp",
    "selected_attention/triton_sel",
)


def _parity_plan(args: argparse.Namespace) -> tuple[ParityPlan, tuple[ParityCase, ...], str]:
    """The plan, the cases this call runs, and the command that replays one of them."""
    limits = CPU_LIMITS if args.device == "cpu" else GPU_LIMITS
    if args.dtype:
        limits = dataclasses.replace(limits, dtypes=tuple(args.dtype))
    count = args.cases if args.case is None else args.case + 1
    plan = make_plan(args.seed, count, limits)
    cases = plan.cases if args.case is None else (plan.cases[args.case],)
    # Everything that shapes the plan: case N of these arguments is the same for any --cases.
    replay = f"python ci/gpu_robustness.py parity --seed {args.seed}"
    replay += " --device cpu" if args.device == "cpu" else ""
    replay += f" --dtype {' '.join(args.dtype)}" if args.dtype else ""
    return plan, cases, replay + " --case N"


def _run_cases(
    args: argparse.Namespace, plan: ParityPlan, cases: Sequence[ParityCase], start: float
) -> tuple[dict[int, list[Check]], str]:
    """Run ``cases`` in this process: their checks by case index, and why it stopped early."""
    rt = setup_runtime(args.device)
    opts = ParityOptions(args.flex_geometries)
    results: dict[int, list[Check]] = {}
    failed = 0
    for n, c in enumerate(cases):
        elapsed = time.perf_counter() - start
        if args.time_limit and elapsed > args.time_limit:
            return results, (
                f"stopped by --time-limit {args.time_limit:.0f} s after {n} of {len(cases)} cases"
            )
        try:
            results[c.index] = run_parity_case(rt, plan, c, opts)
        except Exception as exc:
            results[c.index] = [Check("case", "-", "fail", first_line(exc))]
            if is_fatal_cuda_error(exc):
                return results, f"stopped after case {c.index}: the CUDA context is lost"
        failed += any(ch.status == "fail" for ch in results[c.index])
        if n % 10 == 0 or n == len(cases) - 1:
            log(
                "parity",
                f"case {c.index} ({n + 1}/{len(cases)}, {elapsed:.0f} s): geometry "
                f"{c.geometry}, {c.describe()}; {failed} failed cases so far",
            )
    return results, ""


def _run_workers(
    args: argparse.Namespace, plan: ParityPlan, out: Path
) -> tuple[dict[int, list[Check]], list[str], dict[str, str]]:
    """The cases in ``args.workers`` processes, each owning whole geometries (so each compiles
    only its own kernels, side by side with the others): merged results, stops, environment."""
    workers = min(args.workers, len(plan.geometries))
    command = [sys.executable, str(Path(__file__).resolve()), "parity", "--out", str(out)]
    command += ["--device", args.device, "--seed", str(args.seed), "--cases", str(args.cases)]
    command += ["--flex-geometries", str(args.flex_geometries)]
    command += ["--time-limit", str(args.time_limit)] + (
        ["--dtype", *args.dtype] if args.dtype else []
    )
    # Workers stop themselves between cases at --time-limit; a case in flight gets a margin.
    limit = args.time_limit + 30 if args.time_limit else 3600.0
    children = [
        Child(
            f"worker {i}", [*command, "--shard", f"{i}/{workers}"], out / f"parity_{i}.log", limit
        )
        for i in range(workers)
    ]
    for i in range(workers):
        (out / f"parity_shard_{i}.json").unlink(missing_ok=True)
    worker_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    run_children(children, worker_env, "parity", visible_gpus(args.device, worker_env))
    results: dict[int, list[Check]] = {}
    stops: list[str] = []
    env: dict[str, str] = {}
    for i, part in enumerate(load_parts(out, [f"parity_shard_{i}" for i in range(workers)])):
        if part.status != "PASS":
            stops.append(f"worker {i}: no result (it crashed or timed out); see parity_{i}.log")
            continue
        env = env or part.env
        for index, checks in part.details["results"].items():
            results[int(index)] = [Check(**ch) for ch in checks]
        if part.details["stopped"]:
            stops.append(f"worker {i}: {part.details['stopped']}")
    return results, stops, env


def run_parity(args: argparse.Namespace) -> PartResult:
    start = time.perf_counter()
    plan, cases, replay = _parity_plan(args)
    out = Path(args.out)
    if args.shard:  # one worker of a parallel run: its geometries, its results only
        index, count = parse_shard(args.shard)
        mine = [c for c in cases if c.geometry % count == index]
        log("parity", f"worker {index}: {len(mine)} cases of geometries {index}::{count}")
        results, stopped = _run_cases(args, plan, mine, start)
        raw = {i: [dataclasses.asdict(ch) for ch in checks] for i, checks in results.items()}
        return PartResult(
            f"parity_shard_{index}",
            "PASS",  # ran; the parent judges the checks
            f"{len(results)} of {len(mine)} cases run",
            time.perf_counter() - start,
            {"results": raw, "stopped": stopped},
            [],
            environment(),
        )
    setup_runtime(args.device)  # fail here, with the reason, rather than in every worker
    log(
        "parity",
        f"seed {args.seed}, {len(cases)} cases over {len(plan.geometries)} geometries; "
        f"replay one with `{replay}`",
    )
    for i, geometry in enumerate(plan.geometries):
        log("parity", f"geometry {i}: {geometry.describe()}")
    if args.workers > 1 and args.case is None:
        results, stops, env = _run_workers(args, plan, out)
    else:
        results, stopped = _run_cases(args, plan, cases, start)
        stops, env = [stopped] if stopped else [], environment()
    return _parity_verdict(args, plan, cases, results, stops, env, replay, start)


def _parity_verdict(
    args: argparse.Namespace,
    plan: ParityPlan,
    cases: Sequence[ParityCase],
    results: dict[int, list[Check]],
    stops: Sequence[str],
    env: dict[str, str],
    replay: str,
    start: float,
) -> PartResult:
    by_index = {c.index: c for c in cases}
    failures = []
    for index in sorted(results):
        c = by_index[index]
        for ch in results[index]:
            if ch.status == "fail":
                failures.append(
                    f"case {c.index} (seed {args.seed}; geometry {c.geometry}: "
                    f"{plan.geometries[c.geometry].describe()}; {c.describe()}): "
                    f"{ch.op}/{ch.backend}: {ch.detail}"
                )
    tallies = tally(results)
    if args.device == "cuda" and args.case is None:
        triton = {n for n in tallies if n.split("/")[1].startswith("triton")}
        for name in sorted(triton | set(REQUIRED_BACKENDS)):
            ran = tallies.get(name, BackendTally())
            if ran.passed + ran.failed == 0:
                failures.append(f"{name} never ran: {ran.line(name)}")
    failures += stops
    if len(results) < len(cases):
        failures.append(f"{len(cases) - len(results)} of {len(cases)} cases did not run")
    per_backend = [t.line(name) for name, t in sorted(tallies.items())]
    for line in per_backend:
        log("parity", line)
    checks_run = sum(t.passed + t.failed for t in tallies.values())
    failed_cases = sorted(
        i for i, checks in results.items() if any(c.status == "fail" for c in checks)
    )
    headline = (
        f"{len(results) - len(failed_cases)}/{len(cases)} cases pass (seed {args.seed}), "
        f"{checks_run} backend checks, {sum(t.failed for t in tallies.values())} failed"
    )
    details = {
        "seed": args.seed,
        "replay": replay,
        "geometries": [f"{i}: {g.describe()}" for i, g in enumerate(plan.geometries)],
        "backends": per_backend,
        "failed_cases": ", ".join(map(str, failed_cases)) or "none",
    }
    status = "FAIL" if failures else "PASS"
    wall = time.perf_counter() - start
    return PartResult("parity", status, headline, wall, details, failures, env)


# ============================================================================ command line


def _add_common(p: argparse.ArgumentParser, device: bool = True) -> None:
    p.add_argument(
        "--out", default=DEFAULT_OUT, help=f"folder for the JSON and logs (default {DEFAULT_OUT})"
    )
    if device:
        p.add_argument(
            "--device",
            default="cuda",
            choices=("cuda", "cpu"),
            help="cpu: tiny shapes under TRITON_INTERPRET=1",
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "sanitize", help="the kernel sweep under compute-sanitizer memcheck and racecheck"
    )
    _add_common(p)
    p.add_argument("--case", default=None, help="only the sweep cases whose name contains this")
    p.add_argument("--shards", type=int, default=3, help="processes per tool (and without one)")
    p.add_argument(
        "--tools",
        nargs="+",
        default=["memcheck", "racecheck"],
        choices=("memcheck", "racecheck", "synccheck", "initcheck"),
    )
    p.add_argument(
        "--plain-timeout",
        type=float,
        default=300.0,
        help="seconds for the sweep without the sanitizer",
    )
    p.add_argument(
        "--tool-timeout", type=float, default=420.0, help="seconds for each sanitizer run"
    )

    p = sub.add_parser("sanitize-target", help="the sweep itself (run by the sanitizer)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--shard", default="0/1", help="I/N: run the I-th of N slices of the sweep")
    p.add_argument("--case", default=None, help="run only the sweep cases whose name contains this")

    p = sub.add_parser("long", help="T = 128k, 256k: selected branch and attention core")
    _add_common(p)
    p.add_argument("--lengths", default="128k,256k", help="sequence lengths (k = 1024)")
    p.add_argument("--hq", type=int, default=64)
    p.add_argument("--h", type=int, default=4)
    p.add_argument("--dim", type=int, default=128, help="dk = dv")
    p.add_argument("--dtype", default="bfloat16", choices=tuple(BOUNDS))
    p.add_argument(
        "--rows", type=int, default=64, help="sampled rows checked against the reference"
    )
    p.add_argument(
        "--pieces", nargs="+", default=["selected", "core"], choices=("selected", "core")
    )

    p = sub.add_parser("parity", help="random cases, every GPU backend against the reference")
    _add_common(p)
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--cases", type=int, default=DEFAULT_CASES)
    p.add_argument("--case", type=int, default=None, help="replay only case N of the seed")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="processes, each owning whole geometries (default: one per geometry; 1 on cpu)",
    )
    p.add_argument("--shard", default=None, help=argparse.SUPPRESS)  # I/N: one worker's share
    p.add_argument(
        "--dtype", nargs="+", default=None, choices=tuple(BOUNDS), help="only these dtypes"
    )
    p.add_argument(
        "--flex-geometries",
        type=int,
        default=2,
        help="geometries on which compiled FlexAttention runs (each compiles)",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=0.0,
        help="stop (and fail) after this many seconds; 0: none",
    )

    p = sub.add_parser("plan", help="print the parity cases of a seed")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--cases", type=int, default=DEFAULT_CASES)
    p.add_argument(
        "--device", default="cuda", choices=("cuda", "cpu"), help="the limits of that device"
    )

    p = sub.add_parser("report", help="merge the parts' JSON into report.json and report.md")
    _add_common(p, device=False)
    p.add_argument("--sections", default=" ".join(PARTS), help="the parts that were asked for")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "plan":
        print(
            describe_plan(
                make_plan(args.seed, args.cases, CPU_LIMITS if args.device == "cpu" else GPU_LIMITS)
            )
        )
        return 0
    if args.command == "sanitize-target":
        return run_sweep(args.device, args.case, parse_shard(args.shard))
    if args.command == "report":
        out = Path(args.out)
        results = load_parts(out, args.sections.split())
        (out / "report.json").write_text(
            json.dumps([r.to_json() for r in results], indent=2) + "\n"
        )
        (out / "report.md").write_text(markdown_report(results))
        print("\n".join(summary_lines(results)))
        return 0 if all(r.status == "PASS" for r in results) else 1
    if args.command == "parity" and args.workers is None:
        args.workers = GPU_LIMITS.geometries if args.device == "cuda" else 1
    runners = {"sanitize": run_sanitize, "long": run_long, "parity": run_parity}
    result = runners[args.command](args)
    write_part(Path(args.out), result)
    if not result.part.startswith("parity_shard"):  # a worker's share has no verdict of its own
        print("\n".join(summary_lines([result])))
    return 0 if result.status == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
