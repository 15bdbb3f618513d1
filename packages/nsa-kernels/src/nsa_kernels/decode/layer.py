"""The whole NSAAttention decode step on the GPU: projections, the fused step, the output.

:class:`LayerDecoder` runs one token per sequence of an ``NSAAttention`` layer on a
:class:`DecodeState`: the layer's own projections (q, per-branch K/V, gates, RoPE at each
sequence's position read from ``cache_seqlens`` on the device), :func:`decode_step`, and the
output projection. With ``graph=True`` all of it is captured once as a CUDA graph and every
:meth:`LayerDecoder.step` replays it for the next token (no host-side position anywhere).

The result equals ``NSAAttention.decode`` on the same cache within the spec's tolerances
(docs/spec.md, "Decode"); the fused step's index contract is that of step.py.

The projections that read x (q, the six branch K/V, the gate MLP's first layer) run as one
GEMM over their weights stacked at construction, and RoPE turns q and the three branch keys,
adjacent columns of that GEMM's output, in one Triton launch (nsa_kernels.rope) that reads
each sequence's angles from cos/sin tables over positions 0..capacity (the reference's
``rope_angles``, computed once per device, head dim, theta and capacity, and shared by the
decoders that ask for the same): at one token per sequence the step is latency-bound, and
every launch counts (the reference's RoPE is many small launches). The rotation equals
the reference's bit for bit. The stacked weights are a copy: build a new decoder after changing
the layer's weights.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from nsa_core import NSAAttention
from nsa_core.checks import check_int, check_rank, check_same_place, shape
from nsa_core.reference.rope import rope_angles
from nsa_kernels.common.entry_checks import check_bool
from nsa_kernels.decode.graph import capture_decode_step
from nsa_kernels.decode.state import BlockPhi, DecodeState, block_phi
from nsa_kernels.decode.step import (
    DecodeKernelConfig,
    DecodePlan,
    StepInputs,
    StepOutputs,
    check_state,
    decode_step,
)
from nsa_kernels.rope.function import rotate


class LayerDecoder:
    """Decode steps of one NSAAttention layer over ``state`` (B sequences, own lengths).

    Args:
        module: the layer (its config must equal the state's; same device and dtype).
        state: the caches, e.g. ``DecodeState.from_cache(module.prefill(x)[1], capacity)``.
        config: the fused step's tiles and splits.
        graph: capture projections + step + output projection as one CUDA graph (CUDA only).
        warmup: eager steps before capture, undone afterwards (the first launch compiles).
        tokens: the batch's total tokens, to size the split-K chunks (see ``DecodePlan``).
    """

    def __init__(
        self,
        module: NSAAttention,
        state: DecodeState,
        *,
        config: DecodeKernelConfig | None = None,
        graph: bool = False,
        warmup: int = 2,
        tokens: int | None = None,
    ) -> None:
        check_module(module)
        check_state(state)
        check_bool("graph", graph)
        check_int("warmup", warmup, 1)
        if module.config != state.config:
            raise ValueError("module.config differs from the state's config")
        weight = module.q_proj.weight
        if weight.device != state.device or weight.dtype != state.dtype:
            raise ValueError(
                f"module is {weight.dtype} on {weight.device} but the state is "
                f"{state.dtype} on {state.device}"
            )
        if graph and state.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA state, got {state.device}")
        self.module = module
        self.state = state
        self.plan = DecodePlan(state, config, tokens=tokens)
        self._phi_k: BlockPhi | None = None if module.phi_k is None else block_phi(module.phi_k)
        self._phi_v: BlockPhi | None = None if module.phi_v is None else block_phi(module.phi_v)
        self._w_in, self._b_in, self._splits = self._stack_input_projections(module)
        cfg = module.config
        self._cos, self._sin = rope_tables(
            state.device, cfg.head_dim_qk, cfg.rope_theta, state.capacity
        )
        self.x = torch.zeros(
            state.batch, module.hidden_size, device=state.device, dtype=state.dtype
        )
        self._graph: torch.cuda.CUDAGraph | None = None
        if graph:
            self._graph, (self._y, self._out) = capture_decode_step(state, self._run, warmup)

    @classmethod
    def prefill(
        cls,
        module: NSAAttention,
        x: torch.Tensor,
        capacity: int,
        *,
        config: DecodeKernelConfig | None = None,
        graph: bool = False,
    ) -> tuple[torch.Tensor, LayerDecoder]:
        """``module.prefill(x)`` (x [B, T, hidden]) and a decoder that continues from it."""
        check_module(module)
        check_int("capacity", capacity, 1)
        check_bool("graph", graph)
        with torch.no_grad():
            y, cache = module.prefill(x)
        state = DecodeState.from_cache(cache, capacity)
        return y, cls(module, state, config=config, graph=graph)

    @staticmethod
    def _stack_input_projections(
        module: NSAAttention,
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """W [q; k_cmp; k_sel; k_win; v_cmp; v_sel; v_win; gate_in] [rows, hidden], its bias
        (zeros where a projection has none) and the rows of each part."""
        layers: list[torch.nn.Linear] = [
            module.q_proj,
            *(_linear(module.k_proj[b]) for b in ("cmp", "sel", "win")),
            *(_linear(module.v_proj[b]) for b in ("cmp", "sel", "win")),
            _linear(module.gate[0]),
        ]
        with torch.no_grad():
            weight = torch.cat([layer.weight for layer in layers]).contiguous()
            bias = torch.cat(
                [
                    layer.bias
                    if layer.bias is not None
                    else layer.weight.new_zeros(layer.weight.shape[0])
                    for layer in layers
                ]
            )
        return weight, bias, [layer.weight.shape[0] for layer in layers]

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> StepInputs:
        """The step's inputs for x [B, hidden] at integer ``positions`` [B, 1] in [0, capacity]:
        NSAAttention's ``branch_inputs`` (same math, the rotation bit for bit) in one GEMM and
        one RoPE launch."""
        cfg = self.module.config
        batch, hq, h = x.shape[0], cfg.num_q_heads, cfg.num_kv_heads
        dk, dv = cfg.head_dim_qk, cfg.head_dim_v
        projected = F.linear(x, self._w_in, self._b_in)
        _, _, _, _, v_cmp, v_sel, v_win, gate_in = torch.split(projected, self._splits, dim=-1)
        # q and the three branch keys are the first columns: one view, no copy.
        keys = projected[:, : (hq + 3 * h) * dk].view(batch, 1, hq + 3 * h, dk)
        rows = positions.to(torch.int32).contiguous()  # no copy for the step's own lengths
        keys = rotate(keys, self._cos, self._sin, inverse=False, positions=rows)[:, 0]
        q_rot, k_cmp, k_sel, k_win = torch.split(keys, [hq, h, h, h], dim=1)
        gate = self.module.gate
        gates = torch.sigmoid(gate[2](gate[1](gate_in))).view(batch, hq, 3)
        return StepInputs(
            q=q_rot,
            k_cmp=k_cmp,
            v_cmp=v_cmp.reshape(batch, h, dv),
            k_sel=k_sel,
            v_sel=v_sel.reshape(batch, h, dv),
            k_win=k_win,
            v_win=v_win.reshape(batch, h, dv),
            gates=gates,
        )

    def _run(self) -> tuple[torch.Tensor, StepOutputs]:
        """y [B, hidden] and the step's outputs for the token in :attr:`x`."""
        module, state = self.module, self.state
        with torch.no_grad():
            positions = state.cache_seqlens[:, None]  # [B, 1], on the device
            step_inputs = self.project(self.x, positions)
            out = decode_step(
                state, step_inputs, phi_k=self._phi_k, phi_v=self._phi_v, plan=self.plan
            )
            y: torch.Tensor = module.o_proj(out.o.flatten(1))
        return y, out

    @property
    def graphed(self) -> bool:
        return self._graph is not None

    def step(self, x: torch.Tensor) -> tuple[torch.Tensor, StepOutputs]:
        """One token per sequence: x [B, hidden] -> y [B, hidden]; advances every sequence.

        With a graph the results live in the graph's memory and the next step overwrites them.
        """
        check_rank("x", x, 2, "[B, hidden]")
        if x.shape != self.x.shape:
            raise ValueError(f"x {shape(x)} must be [B, hidden] = {shape(self.x)}")
        check_same_place("x", x, "the state", self.x)
        self.x.copy_(x)
        return self.replay()

    def replay(self) -> tuple[torch.Tensor, StepOutputs]:
        """The step on the token already in :attr:`x` (graph replay, or eager without one)."""
        if self._graph is None:
            return self._run()
        self._graph.replay()
        return self._y, self._out


@functools.lru_cache(maxsize=8)
def rope_tables(
    device: torch.device, head_dim: int, theta: float, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [capacity + 1, head_dim / 2] float32: the reference's angles (``rope_angles``)
    of positions 0..capacity (a full sequence's step still turns its token at ``capacity``)."""
    positions = torch.arange(capacity + 1, device=device)
    cos, sin = rope_angles(positions, head_dim, theta, torch.float32)
    return cos.contiguous(), sin.contiguous()


def check_module(module: object) -> None:
    if not isinstance(module, NSAAttention):
        raise TypeError(f"module must be an NSAAttention, got {type(module).__name__}")


def _linear(module: torch.nn.Module) -> torch.nn.Linear:
    if not isinstance(module, torch.nn.Linear):
        raise TypeError(f"expected an nn.Linear projection, got {type(module).__name__}")
    return module
