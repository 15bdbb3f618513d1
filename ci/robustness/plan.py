"""The parity cases of a seed: geometries, lengths and cases drawn with ``random.Random``, so the
same seed gives the same cases on any machine (pure Python: no GPU and no torch needed)."""

from __future__ import annotations

import dataclasses
import math
import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ci.robustness.common import BOUNDS

DEFAULT_SEED = 13
DEFAULT_CASES = 200
# Sequences shorter than this count as short (FlexAttention serves from 256 tokens on).
SHORT = 256


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


def limits_for(device: str) -> Limits:
    """What the cases of a run on ``device`` may draw from."""
    return CPU_LIMITS if device == "cpu" else GPU_LIMITS
