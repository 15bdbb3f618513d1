"""Any layer arguments, good or bad, either run or are refused before they cost memory.

Hypothesis draws NSAConfig fields (small valid values, the largest valid sizes, and bad ones:
zero, negative, past int32's 2^31 - 1 tokens, floats, bools, strings, d not dividing l or l',
scales and rope bases that are not finite in the compute dtype), the layer's hidden size and
dtype, and an input x (shape, dtype, packed sequences). Each step (NSAConfig, NSAAttention,
forward) must either succeed, the forward with a finite output of x's shape, or raise
TypeError or ValueError having allocated no more bytes than the inputs hold (docs/spec.md,
"Argument rules": arguments are checked before any work).

Allocation is measured with torch's CPU profiler (every allocation of the step, summed);
``test_the_measurement_sees_allocations`` shows that it sees one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.profiler import ProfilerActivity, profile

from nsa_core import NSAAttention, NSAConfig

MAX_TOKENS = 2**31 - 1  # docs/spec.md: int32 token positions

# Values that are never a valid size: not an int, or an int below 1 or past int32's tokens.
BAD_SIZES: list[Any] = [0, -1, -(2**31), 2**31, 2**40, 4.0, True, "4", None]

# Per field, values that break a rule of its own or of the geometry it belongs to (3 divides
# none of the valid l and l'; an odd dk cannot rotate; HQ = 3 is no multiple of H = 2; n = 2
# cannot hold the forced blocks); the numbers are not finite, not > 0, not numbers, or (1e39,
# 1e-39) not finite and > 0 in float32 although they are in float64.
BAD_VALUES: dict[str, list[Any]] = {
    "num_q_heads": [*BAD_SIZES, 3],
    "num_kv_heads": BAD_SIZES,
    "head_dim_qk": [*BAD_SIZES, 3],
    "head_dim_v": BAD_SIZES,
    "cmp_block": BAD_SIZES,
    "cmp_stride": [*BAD_SIZES, 3],
    "sel_block": BAD_SIZES,
    "num_selected": [*BAD_SIZES, 2],
    "window": BAD_SIZES,
    "phi": ["max", 1, None],
    "scale": [1e39, 1e-39, 0.0, -1.0, math.nan, math.inf, "0.5", True],
    "rope_theta": [1e39, 1e-39, 0.0, math.nan, True],
}


@st.composite
def config_arguments(draw: st.DrawFn) -> dict[str, Any]:
    """NSAConfig keyword arguments: a valid geometry with up to two fields replaced by bad
    values. Valid sizes reach the bound where a config of that size costs memory of the
    sequence only (l with d = 1, l' with d <= 2, w); the learned phi, whose parameters grow
    with l, comes with small l only."""
    kv_heads = draw(st.sampled_from([1, 2]))
    stride = draw(st.sampled_from([1, 2, 4]))
    huge_l = stride == 1 and draw(st.booleans())
    huge_sel = stride <= 2 and draw(st.booleans())
    sel_block = MAX_TOKENS // 3 if huge_sel else stride * draw(st.sampled_from([1, 2, 4]))
    args: dict[str, Any] = {
        "num_q_heads": kv_heads * draw(st.sampled_from([1, 2])),
        "num_kv_heads": kv_heads,
        "head_dim_qk": draw(st.sampled_from([2, 4, 8])),
        "head_dim_v": draw(st.sampled_from([1, 4, 6])),
        "cmp_block": MAX_TOKENS if huge_l else stride * draw(st.sampled_from([1, 2])),
        "cmp_stride": stride,
        "sel_block": sel_block,
        "num_selected": 3 if huge_sel else draw(st.sampled_from([3, 4, 16])),
        "window": draw(st.sampled_from([1, 3, 16, MAX_TOKENS])),
        "phi": "avg" if huge_l else draw(st.sampled_from(["avg", "mlp"])),
        "scale": draw(st.sampled_from([None, 0.5, 2.0])),
        "rope_theta": draw(st.sampled_from([10000.0, 500.0])),
    }
    bad_fields = draw(st.lists(st.sampled_from(sorted(BAD_VALUES)), max_size=2, unique=True))
    for name in bad_fields:
        args[name] = draw(st.sampled_from(BAD_VALUES[name]))
    return args


@dataclass(frozen=True)
class Inputs:
    """The layer's hidden size and dtype, x and the packed sequences' cu_seqlens (or None)."""

    hidden: Any
    layer_dtype: torch.dtype
    x: torch.Tensor
    cu_seqlens: torch.Tensor | None

    def nbytes(self) -> int:
        tensors = [self.x] if self.cu_seqlens is None else [self.x, self.cu_seqlens]
        return sum(t.numel() * t.element_size() for t in tensors)


@st.composite
def inputs(draw: st.DrawFn) -> Inputs:
    """x [B, T, hidden] of the layer's dtype and, for B = 1, sometimes cu_seqlens over T; now
    and then one of them is bad (hidden size, x's rank, width or dtype, cu_seqlens' dtype,
    order or batch)."""
    hidden = 8
    layer_dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    x_dtype, width = layer_dtype, hidden
    batch = draw(st.integers(1, 2))
    tokens = draw(st.integers(1, 24))
    packed = draw(st.booleans())
    cu_dtype, reversed_bounds, rank = torch.int32, False, 3
    defect = draw(st.sampled_from([None] * 6 + ["hidden", "rank", "width", "dtype", "cu"]))
    if defect == "hidden":
        hidden = draw(st.sampled_from([0, 2**40, 8.0, True]))
    elif defect == "rank":
        rank = 2
    elif defect == "width":
        width = hidden + 1
    elif defect == "dtype":
        x_dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.int64, torch.bool]))
    elif defect == "cu":
        packed = True
        batch = draw(st.sampled_from([1, 2]))
        cu_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
        reversed_bounds = True
    elif packed:
        batch = 1
    shape = (batch, tokens, width) if rank == 3 else (tokens, width)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(tokens)).to(x_dtype)
    cu_seqlens = None
    if packed:
        cuts = sorted(draw(st.lists(st.integers(0, tokens), max_size=3)))
        bounds = [0, *cuts, tokens]
        cu_seqlens = torch.tensor(bounds[::-1] if reversed_bounds else bounds, dtype=cu_dtype)
    return Inputs(hidden, layer_dtype, x, cu_seqlens)


@dataclass
class Step:
    """What one step returned or raised, and the bytes it allocated."""

    result: Any
    error: BaseException | None
    allocated: int


def measured(step: Callable[[], Any]) -> Step:
    """Run ``step`` under torch's CPU profiler and sum every allocation it made."""
    result, error = None, None
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        try:
            result = step()
        except Exception as err:
            error = err
    allocated = sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)
    return Step(result, error, allocated)


def refused_cheaply(step: Step, budget: int) -> bool:
    """The step raised TypeError or ValueError and allocated at most ``budget`` bytes; any
    other exception fails the test where it was raised."""
    if step.error is None:
        return False
    if not isinstance(step.error, (TypeError, ValueError)):
        raise step.error
    assert step.allocated <= budget, f"{step.error!r} after allocating {step.allocated} bytes"
    return True


def test_the_measurement_sees_allocations() -> None:
    """The profiler sums what a step allocates, also when the step raises afterwards."""
    assert measured(lambda: None).allocated == 0

    def allocate_then_raise() -> None:
        torch.zeros(2**20)
        raise ValueError("after the allocation")

    assert measured(lambda: torch.empty(2**20)).allocated >= 4 * 2**20
    step = measured(allocate_then_raise)
    assert isinstance(step.error, ValueError)
    assert step.allocated >= 4 * 2**20
    with pytest.raises(AssertionError, match="after allocating"):
        refused_cheaply(step, budget=2**20)


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(config_args=config_arguments(), given_inputs=inputs())
def test_any_arguments_run_or_are_refused_before_costing_memory(
    config_args: dict[str, Any], given_inputs: Inputs
) -> None:
    budget = given_inputs.nbytes()
    made = measured(lambda: NSAConfig(**config_args))
    if refused_cheaply(made, budget):
        return
    torch.manual_seed(0)
    built = measured(lambda: NSAAttention(made.result, given_inputs.hidden))
    if refused_cheaply(built, budget):
        return
    layer = built.result.to(given_inputs.layer_dtype)
    x = given_inputs.x
    ran = measured(lambda: layer(x, cu_seqlens=given_inputs.cu_seqlens))
    if refused_cheaply(ran, budget):
        return
    y = ran.result
    assert y.shape == x.shape
    assert y.dtype == x.dtype
    assert bool(torch.isfinite(y).all())


@pytest.mark.parametrize(
    "geometry",
    [
        {"cmp_block": MAX_TOKENS, "cmp_stride": 1, "sel_block": 4},
        {"cmp_block": 4, "cmp_stride": 2, "sel_block": MAX_TOKENS // 3, "num_selected": 3},
        {"cmp_block": 4, "cmp_stride": 2, "sel_block": 4, "window": MAX_TOKENS},
    ],
    ids=["l", "l'", "w"],
)
def test_the_largest_valid_sizes_cost_the_sequence_not_the_size(geometry: dict[str, int]) -> None:
    """A 20-token forward with l, l' or w near 2^31 allocates what the tokens need: its buffers
    follow the sequence, never the block or window size."""
    cfg = NSAConfig(num_q_heads=2, num_kv_heads=1, head_dim_qk=4, head_dim_v=4, **geometry)
    layer = NSAAttention(cfg, 8)
    x = torch.randn(1, 20, 8)
    ran = measured(lambda: layer(x))
    assert ran.error is None, ran.error
    assert bool(torch.isfinite(ran.result).all())
    assert ran.allocated < 2**24  # 16 MiB; a buffer sized by l, l' or w would take gigabytes
