"""What every Triton backend needs before it can serve a call (a CUDA device and triton), and the
``fn`` it registers."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nsa_core.registry import OpContext
from nsa_core.toggles import Toggles
from nsa_kernels.common.triton_inputs import BF16_DOT, InterpreterFault, interpreter_reason
from nsa_kernels.common.triton_inputs import MAX_HEAD_DIM as TRITON_MAX_HEAD_DIM
from nsa_kernels.common.triton_inputs import SUPPORTED_DTYPES as TRITON_DTYPES


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_decline_reason(
    ctx: OpContext,
    max_head_dim: int | None = TRITON_MAX_HEAD_DIM,
    fault: InterpreterFault | None = BF16_DOT,
) -> str | None:
    """Why a Triton kernel cannot serve ``ctx`` (device, triton, dtype, a dtype its ``fault``
    makes the interpreter compute wrongly where it runs, head dims up to ``max_head_dim``;
    None: any), or None."""
    if ctx.device.type != "cuda":
        return f"Triton kernels run on CUDA (device is {ctx.device.type})"
    if not triton_available():
        return "triton is not installed"
    if ctx.dtype not in TRITON_DTYPES:
        return f"needs float16, bfloat16 or float32, got {ctx.dtype} (float64 runs the reference)"
    interpreted = interpreter_reason(ctx.dtype, fault)
    if interpreted is not None:
        return interpreted
    if max_head_dim is not None and max(ctx.head_dim_qk, ctx.head_dim_v) > max_head_dim:
        return f"head dims dk={ctx.head_dim_qk}, dv={ctx.head_dim_v} exceed {max_head_dim}"
    return None


@dataclass(frozen=True)
class TritonFn:
    """A Triton backend's registered ``fn``: ``module.name`` called without the toggles, and
    with ``validated=True``: the registry hands it calls that nsa-core validated already, so the
    kernel entry checks nothing again (users who call the entry by name get its checks).

    ``module`` is imported at the call, not when the backend table is built: registering the
    backends (nsa-core's entry-point loader, on every machine) loads no Triton.
    """

    module: str
    name: str

    def __call__(self, *args: Any, toggles: Toggles, **kwargs: Any) -> Any:
        return self.target()(*args, validated=True, **kwargs)

    def target(self) -> Callable[..., Any]:
        """The function the backend runs (imports its module, and so triton)."""
        fn: Callable[..., Any] = getattr(importlib.import_module(self.module), self.name)
        return fn


def triton_fn(module: str, name: str) -> TritonFn:
    """The registered ``fn`` of a Triton backend that runs ``module.name``."""
    return TritonFn(module, name)
