"""The public ops of one NSA layer: validate once, ask the registry, run the chosen backend.

Each op has the signature, shapes and docstring of its reference body in :mod:`nsa_core.reference`
(``q [B, T, HQ, dk]``, ``k [B, T, H, dk]``, ``v [B, T, H, dv]``, ``block_indices [B, T, H, n]``;
docs/spec.md). A call checks every argument with the op's validator in :mod:`nsa_core.checks`,
which returns the call's :class:`~nsa_core.op_context.OpContext`; the registry resolves the
backend for it (:func:`nsa_core.registry.resolve_fn`, the same decision that ``routing_report``
shows, wrapped in the debug hooks when NSA_DEBUG_SHAPES/TIMING/COMPARE is on), which receives the
call's arguments as given and the toggles the decision was made with. On a CPU, in float64, or
with ``NSA_<STEP>_BACKEND=reference`` the backend is the reference body, which stays callable by
name (with its own checks) everywhere.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

from nsa_core import reference
from nsa_core.checks import (
    check_apply_rope,
    check_compressed_attention,
    check_gated_combine,
    check_select_blocks,
    check_selected_attention,
    check_sliding_attention,
)
from nsa_core.core import attention_core
from nsa_core.op_context import OpContext, op_context
from nsa_core.registry import resolve_fn, resolve_fn_with_lse
from nsa_core.toggles import get_toggles

P = ParamSpec("P")
R = TypeVar("R")

__all__ = [
    "apply_rope",
    "attention_core",
    "compressed_attention",
    "compressed_attention_with_lse",
    "gated_combine",
    "op_context",
    "select_blocks",
    "selected_attention",
    "sliding_attention",
]

_ROUTED = """

    Public op (:mod:`nsa_core.ops`): validated once, then run by the backend the registry picks
    for the call (``routing_report``); the reference body is :func:`nsa_core.reference.{name}`.
"""


def public_op(op: str, body: Callable[P, R], check: Callable[..., OpContext]) -> Callable[P, R]:
    """The public ``op``: ``check`` the arguments, resolve the backend, call it.

    ``body`` (the reference op) lends its name, signature and docstring; ``check`` takes the
    same arguments and returns the routing context.
    """

    @functools.wraps(body)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        ctx = check(*args, **kwargs)
        toggles = get_toggles()
        out: R = resolve_fn(op, ctx, toggles)(*args, **kwargs, toggles=toggles)
        return out

    call.__doc__ = (body.__doc__ or "").rstrip() + _ROUTED.format(name=body.__name__)
    return call


def public_op_with_lse(
    op: str, body: Callable[P, torch.Tensor], check: Callable[..., OpContext]
) -> Callable[P, tuple[torch.Tensor, torch.Tensor | None]]:
    """The public ``op`` that also returns its backend's log-sum-exp, where it has one.

    The call returns ``(o, lse)``: ``o`` exactly as the plain public op gives it, and the chosen
    backend's ``fn_with_lse`` normaliser, detached, or None when that backend has none (or a
    debug hook is on: the hooks observe ``fn``).
    """

    @functools.wraps(body)
    def call(*args: P.args, **kwargs: P.kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        ctx = check(*args, **kwargs)
        toggles = get_toggles()
        fn_with_lse = resolve_fn_with_lse(op, ctx, toggles)
        if fn_with_lse is None:
            o: torch.Tensor = resolve_fn(op, ctx, toggles)(*args, **kwargs, toggles=toggles)
            return o, None
        o, lse = fn_with_lse(*args, **kwargs, toggles=toggles)
        return o, None if lse is None else lse.detach()

    call.__name__ = call.__qualname__ = f"{body.__name__}_with_lse"
    return call


apply_rope = public_op("apply_rope", reference.apply_rope.body, check_apply_rope)
compressed_attention = public_op(
    "compressed_attention", reference.compressed_attention.body, check_compressed_attention
)
selected_attention = public_op(
    "selected_attention", reference.selected_attention.body, check_selected_attention
)
sliding_attention = public_op(
    "sliding_attention", reference.sliding_attention.body, check_sliding_attention
)
selected_attention.__doc__ = (selected_attention.__doc__ or "") + (
    "    On CUDA the public op does not read the index range back (a device sync) unless\n"
    "    NSA_SEL_CHECK_INDICES is set: kernels treat out-of-range entries as -1.\n"
)
select_blocks = public_op("select_blocks", reference.select_blocks.body, check_select_blocks)
gated_combine = public_op("gated_combine", reference.gated_combine.body, check_gated_combine)

compressed_attention_with_lse = public_op_with_lse(
    "compressed_attention", reference.compressed_attention.body, check_compressed_attention
)
compressed_attention_with_lse.__doc__ = """:func:`compressed_attention` and, where its backend
    produces one, its log-sum-exp.

    Same arguments as :func:`compressed_attention`.

    Returns:
        o_cmp [B, Tq, HQ, dv], exactly what :func:`compressed_attention` returns, and lse
        [B, Tq, HQ] float32 (natural log of the softmax normaliser over the visible blocks,
        ``log sum_i exp(scale * q . k_cmp[i])``, -inf on rows that see none), detached; or
        None when the chosen backend has no ``fn_with_lse`` (or a debug hook is on). Meant for
        :func:`select_blocks`'s ``lse``, with the same q, k_cmp, scale, q_start and cu_seqlens.
    """
