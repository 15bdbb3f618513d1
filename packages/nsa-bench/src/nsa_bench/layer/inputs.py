"""The random inputs of one layer-bench case, and the zero-argument call that times a method on
them in a mode (the forward alone, or the forward and its backward)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from nsa_bench.layer.rows import LayerShape


@dataclass
class Inputs:
    """q [B, T, HQ, dk], k [B, T, H, dk], v [B, T, H, dv], gates [B, T, HQ, 3] in (0, 1),
    upstream gradient do [B, T, HQ, dv]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    gates: torch.Tensor
    do: torch.Tensor


def make_inputs(shape: LayerShape, device: torch.device, seed: int) -> Inputs:
    gen = torch.Generator(device=device).manual_seed(seed)
    b, t, hq, h = shape.batch, shape.seq_len, shape.num_q_heads, shape.num_kv_heads
    dk, dv = shape.head_dim_qk, shape.head_dim_v

    def randn(*size: int) -> torch.Tensor:
        drawn = torch.randn(*size, device=device, generator=gen, dtype=torch.float32)
        return drawn.to(shape.torch_dtype)

    return Inputs(
        q=randn(b, t, hq, dk),
        k=randn(b, t, h, dk),
        v=randn(b, t, h, dv),
        gates=torch.sigmoid(randn(b, t, hq, 3)),
        do=randn(b, t, hq, dv),
    )


def timed_call(
    forward: Callable[..., torch.Tensor],
    tensors: Sequence[torch.Tensor],
    upstream: torch.Tensor,
    mode: str,
    extra_leaves: Sequence[torch.Tensor] = (),
) -> tuple[Callable[[], object], list[torch.Tensor]]:
    """The zero-argument call of ``forward(*tensors)`` in ``mode`` and the tensors whose grads
    it fills (``fwdbwd``: copies of ``tensors`` as leaves, then ``extra_leaves``)."""
    if mode == "fwd":

        def call_fwd() -> object:
            with torch.no_grad():
                return forward(*tensors)

        return call_fwd, []
    leaves = [t.detach().clone().requires_grad_() for t in tensors]

    def call_fwdbwd() -> object:
        torch.autograd.backward(forward(*leaves), upstream)
        return None

    return call_fwdbwd, [*leaves, *extra_leaves]
