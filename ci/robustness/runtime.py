"""What the GPU parts share: the device and Triton mode a part runs on, how an op reaches the
backend under test, inputs drawn from a generator, and the error measures against the reference.

torch and the nsa packages are imported inside the functions: the command line imports every
part, and ``plan`` and ``report`` must run where neither is installed.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ci.robustness.common import BOUNDS, GRAD_FACTOR

if TYPE_CHECKING:
    import torch

    from nsa_core.registry import OpContext
    from nsa_core.toggles import Toggles


# The attention core's output, then its inputs' gradients: q, k and v of each branch, the gates
# (the order the checks zip them with the tensors in).
CORE_TENSORS = ("o", "dq", "dk_cmp", "dk_sel", "dk_win", "dv_cmp", "dv_sel", "dv_win", "dgates")


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


def sync(rt: Runtime) -> None:
    """Wait for the device, so a kernel's error and its time land in the step that launched it."""
    if rt.cuda:
        import torch

        torch.cuda.synchronize()


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


def check_close(name: str, got: torch.Tensor, ref: torch.Tensor, bound: float) -> None:
    """Raise unless ``got`` is within ``bound`` of ``ref`` (relative error)."""
    err = rel_err(got, ref)
    if not err <= bound:
        raise AssertionError(f"{name}: relative error {err:.3e} > {bound:.0e}")


def non_finite(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of the tensors that hold a NaN or an infinity."""
    import torch

    return [name for name, t in named if not bool(torch.isfinite(t).all())]


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


def pinned_toggles(op: str, backend: str) -> Toggles:
    """The process's toggles with ``NSA_<STEP>_BACKEND`` set to ``backend`` for ``op``."""
    from nsa_core.toggles import BACKEND_TOGGLE, get_toggles

    change: dict[str, Any] = {BACKEND_TOGGLE[op]: backend}
    return dataclasses.replace(get_toggles(), **change)


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
    check_close(f"{name} o", out, out_ref, bound)
    for grad_name, a, b in zip(grad_names, grads(kern), grads(ref), strict=True):
        check_close(f"{name} {grad_name}", a, b, GRAD_FACTOR * bound)
