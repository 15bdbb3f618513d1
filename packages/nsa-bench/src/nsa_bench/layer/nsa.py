"""The layer bench's NSA methods: ``nsa_core`` (the functional layer on shared K/V) and
``nsa_module`` (NSAAttention with its projections), each also under torch.compile
(``*_compiled``), and the backends the registry routes their ops to, named in the rows."""

from __future__ import annotations

from typing import Any

import torch

import nsa_core
from nsa_bench.cases import failure_status, free_memory
from nsa_bench.layer.inputs import Inputs, timed_call
from nsa_bench.layer.measure import measure
from nsa_bench.layer.rows import LayerShape, Row
from nsa_bench.timing import Timer
from nsa_core.registry import OpContext


def routed_backend(op: str, ctx: OpContext) -> str:
    """The backend nsa_core's registry picks for ``op`` in ``ctx``, or why it cannot say."""
    from nsa_core import registry

    if op not in registry.OPS:
        return f"reference ({op} is not a registry op)"
    try:
        return registry.resolve(op, ctx).backend.name
    except Exception as exc:  # reported in the row, the timing still runs
        return f"unknown ({type(exc).__name__}: {exc})"


def op_context(shape: LayerShape, device: torch.device, requires_grad: bool) -> OpContext:
    """The registry's routing context of the core's calls at ``shape`` (dense, no varlen)."""
    return OpContext.for_config(
        shape.config(),
        device=device,
        dtype=shape.torch_dtype,
        seq_len=shape.seq_len,
        requires_grad=requires_grad,
    )


def core_routing(shape: LayerShape, device: torch.device, requires_grad: bool) -> str:
    """``op=backend`` for every op the registry routes, as the core's calls would be routed."""
    from nsa_core import registry

    try:
        ctx = op_context(shape, device, requires_grad)
    except Exception as exc:  # the row says so; timing goes on
        return f"unknown (OpContext: {type(exc).__name__}: {exc})"
    return ";".join(f"{op}={routed_backend(op, ctx)}" for op in registry.OPS)


COMPILED_NOTE = "; torch.compile(fullgraph=True), compiled before timing"


def bench_nsa_core(
    shape: LayerShape, inp: Inputs, mode: str, timer: Timer, device: torch.device,
    *, compiled: bool = False,
) -> Row:  # fmt: skip
    row = shape.row(
        "method",
        "nsa_core_compiled" if compiled else "nsa_core",
        mode,
        backend=core_routing(shape, device, mode == "fwdbwd"),
        note="one K/V shared by the three branches" + (COMPILED_NOTE if compiled else ""),
    )
    config = shape.config()

    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> Any:
        return nsa_core.nsa_attention(q, k, v, g, config)

    fn = torch.compile(forward, fullgraph=True) if compiled else forward
    call, leaves = timed_call(fn, (inp.q, inp.k, inp.v, inp.gates), inp.do, mode)
    return measure(row, call, leaves, timer, device)


def bench_nsa_module(
    shape: LayerShape, mode: str, hidden_size: int, timer: Timer, device: torch.device, seed: int,
    *, compiled: bool = False,
) -> Row:  # fmt: skip
    row = shape.row(
        "method",
        "nsa_module_compiled" if compiled else "nsa_module",
        mode,
        hidden_size=hidden_size,
        backend=core_routing(shape, device, mode == "fwdbwd"),
        note=(
            f"NSAAttention, hidden_size={hidden_size}: q/k/v projections per branch, RoPE, "
            "gate MLP and output projection included" + (COMPILED_NOTE if compiled else "")
        ),
    )
    try:
        torch.manual_seed(seed)  # the parameters' initialisation draws from the global generator
        layer = nsa_core.NSAAttention(shape.config(), hidden_size)
        layer = layer.to(device=device, dtype=shape.torch_dtype)
        gen = torch.Generator(device=device).manual_seed(seed)
        size = (shape.batch, shape.seq_len, hidden_size)
        x = torch.randn(*size, device=device, generator=gen).to(shape.torch_dtype)
        dy = torch.randn(*size, device=device, generator=gen).to(shape.torch_dtype)
    except Exception as exc:  # e.g. out of memory for the parameters or x
        row.status = failure_status(exc)
        free_memory(device)
        return row
    if mode == "fwdbwd":
        layer.train()
    else:
        layer.eval()
    fn = torch.compile(layer, fullgraph=True) if compiled else layer
    call, leaves = timed_call(fn, (x,), dy, mode, extra_leaves=list(layer.parameters()))
    measure(row, call, leaves, timer, device)
    del layer, x, dy, call, leaves
    return row
