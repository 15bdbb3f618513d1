"""nsa-core's own backends: the reference body of every op, registered with priority 0.

They accept every call, so resolution always ends somewhere correct: CPU, float64, and
``NSA_<STEP>_BACKEND=reference``. The attention core's reference composes the step ops
(:func:`nsa_core.core.attention_core_reference`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from nsa_core.core import attention_core_reference
from nsa_core.op_context import OpContext
from nsa_core.reference.combine import gated_combine_impl
from nsa_core.reference.compressed_attention import compressed_attention_impl
from nsa_core.reference.rope import apply_rope_impl
from nsa_core.reference.selected_attention import selected_attention_impl
from nsa_core.reference.selection import select_blocks_impl
from nsa_core.reference.sliding_attention import sliding_attention_impl
from nsa_core.registry import CORE_OP, Backend, register_backend
from nsa_core.toggles import Toggles


def _always(ctx: OpContext, toggles: Toggles) -> str | None:
    return None


def _without_toggles(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A reference body as a backend: the step references take no toggles."""

    @functools.wraps(fn)
    def call(*args: Any, toggles: Toggles, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return call


def register_reference_backends() -> None:
    """Register nsa-core's reference bodies (priority 0, accept every call).

    The select_blocks reference takes the keyword lse and does not read it: the spec defines the
    scores from the reference's own compressed softmax.
    """
    for op, fn in (
        ("apply_rope", apply_rope_impl),
        ("select_blocks", select_blocks_impl),
        ("compressed_attention", compressed_attention_impl),
        ("selected_attention", selected_attention_impl),
        ("sliding_attention", sliding_attention_impl),
        ("gated_combine", gated_combine_impl),
    ):
        register_backend(
            Backend(op=op, name="reference", fn=_without_toggles(fn), supports=_always, priority=0)
        )
    register_backend(
        Backend(CORE_OP, "reference", attention_core_reference, supports=_always, priority=0)
    )
