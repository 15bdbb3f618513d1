"""One decode step captured as a CUDA graph and replayed token after token.

The step keeps positions and lengths on the device and its launches do not change between
tokens (step.py), so the graph captured once serves every following token: the caller writes
the next token's inputs into :attr:`DecodeGraph.inputs` (or passes them to :meth:`step`) and
replays. Outputs live in the graph's memory and are overwritten by the next replay.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from nsa_core.checks import check_int
from nsa_kernels.decode.state import BlockPhi, DecodeState, check_phi
from nsa_kernels.decode.step import (
    DecodeKernelConfig,
    DecodePlan,
    StepInputs,
    StepOutputs,
    check_state,
    decode_step,
)

Captured = TypeVar("Captured")


def capture_decode_step(
    state: DecodeState, run: Callable[[], Captured], warmup: int
) -> tuple[torch.cuda.CUDAGraph, Captured]:
    """A CUDA graph of one ``run()`` (a decode step over ``state``) and that run's outputs.

    ``run`` first runs ``warmup`` times eagerly on a side stream, which compiles its kernels;
    each of those steps is undone (the state's counters restored, see
    :meth:`DecodeState.snapshot_counters`). Capturing runs nothing, so the state is left as it
    was given. The returned outputs live in the graph's memory: every replay overwrites them.
    """
    saved = state.snapshot_counters()
    side = torch.cuda.Stream(state.device)  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream(state.device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            run()
            state.restore_counters(saved)
    torch.cuda.current_stream(state.device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = run()
    return graph, outputs


class DecodeGraph:
    """A captured decode step over ``state`` (CUDA only).

    Construction compiles the kernels with ``warmup`` eager steps that are undone (the state's
    counters restored, see :meth:`DecodeState.snapshot_counters`), then captures one step;
    capturing runs nothing, so the state is as it was given. Each :meth:`replay` then advances
    every sequence by one token.

    Args:
        state: the caches the graph reads and writes; do not replace its tensors afterwards.
        phi_k, phi_v: the learned phi for ``config.phi == "mlp"`` (captured with the step).
        config: tiles and splits (see :class:`DecodeKernelConfig`).
        warmup: eager steps before capture (at least 1: the first launch compiles).
        tokens: the batch's total tokens, to size the split-K chunks (see :class:`DecodePlan`).
    """

    def __init__(
        self,
        state: DecodeState,
        *,
        phi_k: BlockPhi | None = None,
        phi_v: BlockPhi | None = None,
        config: DecodeKernelConfig | None = None,
        warmup: int = 2,
        tokens: int | None = None,
    ) -> None:
        check_state(state)
        check_phi(state.config, phi_k, phi_v)
        check_int("warmup", warmup, 1)
        if state.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA state, got {state.device}")
        self.state = state
        self.plan = DecodePlan(state, config, tokens=tokens)
        self.inputs = StepInputs.zeros(state)
        self._phi_k, self._phi_v = phi_k, phi_v
        self.graph, self.outputs = capture_decode_step(state, self._run, warmup)

    def _run(self) -> StepOutputs:
        return decode_step(
            self.state, self.inputs, phi_k=self._phi_k, phi_v=self._phi_v, plan=self.plan
        )

    def replay(self) -> StepOutputs:
        """Run the captured step on the current :attr:`inputs`; advances the state."""
        self.graph.replay()
        return self.outputs

    def step(self, inputs: StepInputs) -> StepOutputs:
        """Copy ``inputs`` into the static buffers and replay."""
        self.inputs.copy_(inputs)
        return self.replay()
