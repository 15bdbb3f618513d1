"""Per-call debug hooks, the same for every backend of every op.

When NSA_DEBUG_SHAPES, NSA_DEBUG_TIMING or NSA_DEBUG_COMPARE is on,
:func:`nsa_core.registry.resolve_fn` wraps the backend it resolved with :func:`with_debug_hooks`.
The records go through the debug log (NSA_DEBUG_LOG must be on too; NSA_DEBUG_LOG_LIMIT per tag):

| tag | toggle | fields |
|---|---|---|
| ``debug.shapes`` | NSA_DEBUG_SHAPES | op, backend, per tensor ``[shape]/[strides]/dtype`` |
| ``debug.timing`` | NSA_DEBUG_TIMING | op, backend, shape bucket, ms of the call |
| ``debug.compare`` | NSA_DEBUG_COMPARE | op, backend, bucket, error against the reference |

Timing on CUDA records events around the call and waits for the second one (a sync per call);
elsewhere it reads the wall clock. Compare runs the reference backend on detached copies of the
same arguments under ``torch.no_grad``: floating outputs report ``mae`` and ``max_abs``, integer
outputs (block indices, counts) the number of entries that differ (``mismatches``), one field set
per output (suffix ``_<i>`` when the backend returns several). The reference itself is not
compared with itself.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from typing import Any

import torch

from nsa_core.debug_log import debug_log
from nsa_core.toggles import Toggles


def _dims(dims: tuple[int, ...]) -> str:
    # No spaces, so a record stays one ``key=value`` token per tensor.
    return "[" + ",".join(str(d) for d in dims) + "]"


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def named_arguments(
    signature_of: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The call's arguments by parameter name (``arg<i>`` where the signature cannot name them).

    The ``toggles`` keyword every backend takes is left out: it is not an argument of the op.
    """
    kwargs = {k: v for k, v in kwargs.items() if k != "toggles"}
    try:
        bound = inspect.signature(signature_of).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return {**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs}
    return dict(bound.arguments)


def shape_bucket(arguments: dict[str, Any]) -> str:
    """Shape class of a call: first tensor [B, T, HQ, d] and second tensor's tokens rounded up
    to a power of two (the key count), then the dtype."""
    tensors = [a for a in arguments.values() if isinstance(a, torch.Tensor)]
    if not tensors:
        return "none"
    first = tensors[0]
    parts = ["x".join(str(s) for s in first.shape)]
    if len(tensors) > 1 and tensors[1].dim() >= 2:
        keys = tensors[1].shape[1]
        parts.append(f"L{1 << max(0, (keys - 1).bit_length())}")
    parts.append(_dtype(first))
    return "/".join(parts)


def _describe_tensors(arguments: dict[str, Any]) -> dict[str, object]:
    fields: dict[str, object] = {}
    for name, value in arguments.items():
        if isinstance(value, torch.Tensor):
            fields[name] = f"{_dims(tuple(value.shape))}/{_dims(value.stride())}/{_dtype(value)}"
    return fields


def _outputs(out: Any) -> tuple[torch.Tensor, ...]:
    if isinstance(out, torch.Tensor):
        return (out,)
    return tuple(o for o in out if isinstance(o, torch.Tensor))


def compare_fields(out: Any, ref: Any) -> dict[str, str]:
    """Error of each output against the reference's: ``mae``/``max_abs`` or ``mismatches``."""
    outs, refs = _outputs(out), _outputs(ref)
    if len(outs) != len(refs):
        return {"error": f"{len(outs)} outputs vs the reference's {len(refs)}"}
    fields: dict[str, str] = {}
    for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
        suffix = "" if len(outs) == 1 else f"_{i}"
        if o.shape != r.shape:
            fields["shape" + suffix] = f"{_dims(tuple(o.shape))}!={_dims(tuple(r.shape))}"
        elif o.is_floating_point() or r.is_floating_point():
            err = (o.detach().double() - r.detach().double()).abs()
            empty = err.numel() == 0
            fields["mae" + suffix] = f"{0.0 if empty else float(err.mean()):.3e}"
            fields["max_abs" + suffix] = f"{0.0 if empty else float(err.max()):.3e}"
        else:
            fields["mismatches" + suffix] = f"{int((o != r).sum())}/{o.numel()}"
    return fields


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def with_debug_hooks(
    op: str,
    backend_name: str,
    fn: Callable[..., Any],
    reference: Callable[..., Any],
    toggles: Toggles,
) -> Callable[..., Any]:
    """``fn`` with the hooks ``toggles`` turn on (``fn`` itself when none is on).

    ``fn`` and ``reference`` are backend callables of ``op`` (the op's arguments plus the
    keyword ``toggles``); ``reference`` names the arguments in the records and serves the compare.
    """
    if not toggles.debug_hooks:
        return fn
    compare = toggles.debug_compare and backend_name != "reference"

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        arguments = named_arguments(reference, args, kwargs)
        if toggles.debug_shapes:
            debug_log("debug.shapes", op=op, backend=backend_name, **_describe_tensors(arguments))
        tensors = [a for a in arguments.values() if isinstance(a, torch.Tensor)]
        on_cuda = bool(tensors) and tensors[0].device.type == "cuda"
        if toggles.debug_timing and on_cuda:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            stop = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
        began = time.perf_counter()
        out = fn(*args, **kwargs)
        if toggles.debug_timing:
            if on_cuda:
                stop.record()
                stop.synchronize()
                ms = float(start.elapsed_time(stop))
            else:
                ms = (time.perf_counter() - began) * 1e3
            debug_log(
                "debug.timing",
                op=op,
                backend=backend_name,
                bucket=shape_bucket(arguments),
                ms=f"{ms:.4f}",
            )
        if compare:
            with torch.no_grad():
                ref = reference(
                    *(_detached(a) for a in args), **{k: _detached(v) for k, v in kwargs.items()}
                )
            debug_log(
                "debug.compare",
                op=op,
                backend=backend_name,
                bucket=shape_bucket(arguments),
                **compare_fields(out, ref),
            )
        return out

    return call
