"""The core step by step: each step of the NSA forward timed alone through its public nsa_core
op, with the backend the registry routes it to (or one pinned for the run) named in its row."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import nsa_core
from nsa_bench.cases import failure_status
from nsa_bench.layer.inputs import Inputs
from nsa_bench.layer.measure import measure
from nsa_bench.layer.nsa import op_context, routed_backend
from nsa_bench.layer.rows import LayerShape, Row
from nsa_bench.timing import Timer
from nsa_core.toggles import BACKEND_TOGGLE, toggles_overridden

# Step of the core forward -> the public nsa_core function and the registry op that routes it.
STEPS: tuple[tuple[str, str], ...] = (
    ("compress", "compress"),
    ("compressed", "compressed_attention"),
    ("select_blocks", "select_blocks"),
    ("selected", "selected_attention"),
    ("sliding", "sliding_attention"),
    ("combine", "gated_combine"),
)

# What each step of the core forward reads from the steps before it.
STEP_NEEDS: dict[str, tuple[str, ...]] = {
    "compress": (),
    "select_blocks": ("compress", "compressed"),
    "compressed": ("compress",),
    "selected": ("select_blocks",),
    "sliding": (),
    "combine": ("compressed", "selected", "sliding"),
}


@dataclass(frozen=True)
class StepCall:
    """One step as a function of its tensor inputs: ``fn(*inputs)`` -> its output(s).

    ``grad_outputs``: how many leading outputs carry a gradient in ``fwdbwd`` (0: the step
    takes none, as block scoring, and is timed forward only).
    """

    fn: Callable[..., Any]
    inputs: tuple[torch.Tensor, ...]
    grad_outputs: int


def _as_tuple(out: Any) -> tuple[Any, ...]:
    return out if isinstance(out, tuple) else (out,)


def step_timed_call(
    step: StepCall, mode: str, seed: int
) -> tuple[Callable[[], object], list[torch.Tensor]]:
    """The zero-argument call that times ``step`` in ``mode`` and the leaves whose grads it fills.

    ``fwdbwd``: the step's inputs become leaves and its differentiable outputs get random
    upstream gradients (drawn once, from ``seed``), as the layer's backward hands them down.
    """
    if mode == "fwd" or step.grad_outputs == 0:

        def call_fwd() -> object:
            with torch.no_grad():
                return step.fn(*step.inputs)

        return call_fwd, []
    leaves = [
        t.detach().clone().requires_grad_() if t.is_floating_point() else t for t in step.inputs
    ]
    with torch.no_grad():
        outs = _as_tuple(step.fn(*step.inputs))[: step.grad_outputs]
    gen = torch.Generator(device=outs[0].device).manual_seed(seed)
    upstream = [torch.randn(o.shape, generator=gen, device=o.device).to(o.dtype) for o in outs]

    def call_fwdbwd() -> object:
        outs = _as_tuple(step.fn(*leaves))[: step.grad_outputs]
        torch.autograd.backward(list(outs), upstream)
        return None

    return call_fwdbwd, [t for t in leaves if t.requires_grad]


def parse_step_backends(text: str) -> list[tuple[str, str]]:
    """``sliding=triton_win,selected=reference`` -> [(step, backend)], steps checked."""
    pairs = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        step, sep, backend = item.partition("=")
        if not sep or not backend or step not in dict(STEPS):
            raise argparse.ArgumentTypeError(
                f"takes STEP=BACKEND pairs with STEP one of "
                f"{', '.join(s for s, _ in STEPS)}; got {item!r}"
            )
        if dict(STEPS)[step] not in BACKEND_TOGGLE:
            raise argparse.ArgumentTypeError(f"step {step!r} has one backend, nothing to pin")
        pairs.append((step, backend))
    return pairs


def bench_steps(
    shape: LayerShape,
    inp: Inputs,
    timer: Timer,
    device: torch.device,
    modes: Sequence[str] = ("fwd",),
    pins: Sequence[tuple[str, str]] = (),
    seed: int = 0,
) -> list[Row]:
    """The core step by step, each through its public nsa_core op, routed backends named.

    For every mode, each step is timed alone: ``fwd``, or ``fwdbwd`` (its forward and its
    backward from random upstream gradients; ``select_blocks`` takes no gradient and is timed
    forward). Each step runs once more untimed to hand its outputs to the steps after it; a step
    whose input step failed is reported as skipped, with the reason. ``pins`` (step, backend)
    add rows named ``step@backend``, timed with that backend pinned (``NSA_<STEP>_BACKEND``).
    """
    cmp_block, cmp_stride, sel_block = shape.cmp_block, shape.cmp_stride, shape.sel_block
    num_selected, window, scale = shape.num_selected, shape.window, shape.scale
    done: dict[str, Any] = {}

    # Looked up on nsa_core at call time: the public, routed ops. As the core runs them: the
    # compressed branch first, its lse (where its backend yields one) handed to block scoring.
    def step_call(step: str) -> StepCall:
        if step == "compress":
            return StepCall(
                lambda k, v: (
                    nsa_core.compress(k, cmp_block, cmp_stride),
                    nsa_core.compress(v, cmp_block, cmp_stride),
                ),
                (inp.k, inp.v),
                2,
            )
        if step == "compressed":
            return StepCall(
                lambda q, k_cmp, v_cmp: nsa_core.compressed_attention_with_lse(
                    q, k_cmp, v_cmp, cmp_block, cmp_stride, scale
                ),
                (inp.q, *done["compress"]),
                1,
            )
        if step == "select_blocks":
            return StepCall(
                lambda q, k_cmp, lse: nsa_core.select_blocks(
                    q, k_cmp, cmp_block, cmp_stride, sel_block, num_selected, scale, lse=lse
                )[0],
                (inp.q, done["compress"][0], done["compressed"][1]),
                0,
            )
        if step == "selected":
            indices = done["select_blocks"]
            return StepCall(
                lambda q, k, v: nsa_core.selected_attention(q, k, v, indices, sel_block, scale),
                (inp.q, inp.k, inp.v),
                1,
            )
        if step == "sliding":
            return StepCall(
                lambda q, k, v: nsa_core.sliding_attention(q, k, v, window, scale),
                (inp.q, inp.k, inp.v),
                1,
            )
        return StepCall(
            nsa_core.gated_combine,
            (done["compressed"][0], done["selected"], done["sliding"], inp.gates),
            1,
        )

    def routed(op: str, requires_grad: bool) -> str:
        try:
            return routed_backend(op, op_context(shape, device, requires_grad))
        except Exception as exc:  # said in the row; the timing still runs
            return f"unknown (OpContext: {type(exc).__name__}: {exc})"

    rows: list[Row] = []
    plan = [(step, op, "") for step, op in STEPS]
    plan += [(step, dict(STEPS)[step], backend) for step, backend in pins]
    for mode in modes:
        for step, op, pinned in plan:
            name = f"{step}@{pinned}" if pinned else step
            row = shape.row("step", "nsa_core", mode, step=name)
            rows.append(row)
            missing = [s for s in STEP_NEEDS[step] if s not in done]
            if missing:
                row.status = f"skipped: needs the output of {', '.join(missing)}, which failed"
                continue
            pin = {BACKEND_TOGGLE[op]: pinned} if pinned else {}
            with toggles_overridden(**pin):
                row.backend = routed(op, mode == "fwdbwd")
                try:
                    call = step_call(step)
                    timed, leaves = step_timed_call(call, mode, seed)
                except Exception as exc:  # e.g. an OOM drawing the upstream gradients
                    row.status = failure_status(exc)
                    continue
                measure(row, timed, leaves, timer, device)
                if row.status == "ok" and step not in done and not pinned:
                    with torch.no_grad():
                        done[step] = call.fn(*call.inputs)
            del timed, leaves
    return rows
