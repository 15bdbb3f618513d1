"""The seam between the reference ops and faster backends.

Each op of an NSA layer (``OPS``) has implementations ("backends") registered here. The reference
implementation of every op is registered by nsa-core itself with the lowest priority and supports
everything, so resolution always ends somewhere correct. Other packages register faster backends
through the ``nsa.backends`` entry-point group: each entry point names a callable that receives
this module's :func:`register_backend`. nsa-core never imports them.

A backend's ``supports(ctx, toggles)`` returns ``None`` when it can serve the call, or the reason
it cannot. :func:`resolve` walks the backends from the highest priority down and returns the first
that accepts, together with every rejection and its reason; each rejection of a backend that the
user asked for through a toggle is logged once. :func:`resolve_fn` returns the chosen backend's
callable, wrapped in the debug hooks of :mod:`nsa_core.debug_hooks` when a debug toggle is on.
:func:`routing_report` renders the decision for a
given context, so the choice is observable.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

from nsa_core.debug_hooks import with_debug_hooks
from nsa_core.debug_log import debug_log, log_once, reset_log_state
from nsa_core.op_context import OpContext as OpContext  # re-exported: the registry API names it
from nsa_core.reference.combine import gated_combine_impl
from nsa_core.reference.compressed_attention import compressed_attention_impl
from nsa_core.reference.rope import apply_rope_impl
from nsa_core.reference.selected_attention import selected_attention_impl
from nsa_core.reference.selection import select_blocks_impl
from nsa_core.reference.sliding_attention import sliding_attention_impl
from nsa_core.toggles import BACKEND_TOGGLE, Toggles, get_toggles, pinned_backend

OPS = (
    "apply_rope",
    "select_blocks",
    "compressed_attention",
    "selected_attention",
    "sliding_attention",
    "gated_combine",
)
ENTRY_POINT_GROUP = "nsa.backends"


Supports = Callable[[OpContext, Toggles], "str | None"]


@dataclass(frozen=True)
class Backend:
    """One implementation of ``op``.

    ``fn`` takes the public op's arguments as the caller gave them (positional or by keyword,
    under the reference signature's names), already validated by the op's ``check_<op>`` in
    :mod:`nsa_core.checks`, plus the keyword ``toggles``: the toggles the routing decision that
    chose it was made with (a backend never re-reads the environment).

    ``fn_with_lse`` (``compressed_attention`` only, optional) takes the same arguments and
    returns ``(o, lse)``: the output ``fn`` gives, bit for bit, and the natural-log normaliser
    of its softmax, float32 [B, Tq, HQ], ``log sum_i exp(scale * q . k_cmp[i])`` over the
    visible blocks, -inf on rows that see none. The attention core hands that lse to
    ``select_blocks``, which then skips its own normaliser pass (docs/spec.md, "Block scoring on
    a GPU"). ``select_blocks`` backends take the keyword ``lse`` (None or that tensor) and may
    ignore it; selection takes no gradient, so they read q, k_cmp and lse detached.

    ``fn_runs_with_lse`` (``compressed_attention`` only, optional) takes the same arguments and
    returns ``(o, lse)`` as ``fn_with_lse`` does, with o as a :class:`nsa_core.row_runs.RowRuns`:
    its rows where the backend computed them, not copied into one tensor.

    ``fn_gated`` (``selected_attention`` only, optional) takes the same arguments plus the
    keywords ``o_cmp``, ``o_win`` and ``gates`` and returns the gated combine of the three
    branches, ``g_cmp * o_cmp + g_slc * fn(...) + g_win * o_win`` (docs/spec.md, "Gated
    combine"), computed with the selected branch so that the combine's own pass is saved. The
    attention core calls it where no gradient is needed, and where one is if ``gated_grad``:
    then ``fn_gated`` is differentiable in q, k, v, o_cmp, o_win and gates. ``gated_runs``: it
    takes o_cmp as a :class:`nsa_core.row_runs.RowRuns` as well, with a gradient too (then
    differentiable in each run).

    ``fn_with_local`` (``sliding_attention`` only, optional) takes the same arguments plus
    ``sel_block`` (l', keyword) and returns ``(o, local)``: the output ``fn`` gives, and each
    row's softmax over its forced blocks' keys, ``[0, l')`` and ``[max(t // l' - 1, 0) * l', t]``,
    as a :class:`nsa_core.local_softmax.LocalSoftmax` (the window must hold the second: w >= 2 l').
    ``gated_local`` (``selected_attention`` only, optional): ``fn_gated`` takes the keyword
    ``local`` (None or such a softmax over the same keys and values, where every index row holds
    its blocks 0 and ``max(jt - 1, 0) .. jt``) and starts from it, the output ``fn_gated``'s
    without it up to rounding; called with the selected call's context, it says whether the
    core should compute one for that call (where it pays).

    ``fn_sum3`` (``gated_combine`` only, optional) takes three tensors of one shape and dtype
    and the keyword ``toggles`` and returns ``a + b + c`` (float32 sums, one rounding, a new
    tensor): the combine sums the three branches forward, and its backend sums their three
    gradients of q backward (:func:`nsa_core.ops.fan_out`) in one pass where autograd would
    add them two at a time.
    """

    op: str
    name: str
    fn: Callable[..., Any]
    supports: Supports
    priority: int = 0
    requested_by: Callable[[Toggles], bool] = field(default=lambda toggles: False)
    fn_with_lse: Callable[..., Any] | None = None
    fn_gated: Callable[..., Any] | None = None
    gated_grad: bool = False
    fn_sum3: Callable[..., Any] | None = None
    # Added after the fields above, so that a backend built with them in order keeps its meaning.
    gated_runs: bool = False
    fn_runs_with_lse: Callable[..., Any] | None = None
    fn_with_local: Callable[..., Any] | None = None
    gated_local: Callable[[OpContext], bool] | None = None


@dataclass(frozen=True)
class Resolution:
    """The backend chosen for one context, and why each preferred backend was passed over."""

    op: str
    backend: Backend
    rejected: tuple[tuple[str, str], ...]


_backends: dict[str, list[Backend]] = {op: [] for op in OPS}
_entry_points_loaded = False


def register_backend(backend: Backend) -> None:
    """Add ``backend``; a backend of the same op and name replaces the earlier one."""
    if backend.op not in _backends:
        raise ValueError(f"unknown op {backend.op!r}; known ops: {', '.join(OPS)}")
    rows = [b for b in _backends[backend.op] if b.name != backend.name]
    rows.append(backend)
    rows.sort(key=lambda b: -b.priority)
    _backends[backend.op] = rows


def load_entry_points() -> None:
    """Import the backends other installed packages declare (once per process)."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        register = ep.load()
        register(register_backend)
        debug_log("registry.entry_point", name=ep.name, value=ep.value)


def backends(op: str) -> list[Backend]:
    """The backends of ``op``, highest priority first (entry points loaded)."""
    load_entry_points()
    if op not in _backends:
        raise ValueError(f"unknown op {op!r}; known ops: {', '.join(OPS)}")
    return list(_backends[op])


def resolve(op: str, ctx: OpContext, toggles: Toggles | None = None) -> Resolution:
    """Pick the highest-priority backend of ``op`` that accepts ``ctx``."""
    toggles = get_toggles() if toggles is None else toggles
    rejected: list[tuple[str, str]] = []
    pinned = pinned_backend(toggles, op)
    if pinned is not None:
        return _resolve_pinned(op, pinned, ctx, toggles)
    for backend in backends(op):
        reason = backend.supports(ctx, toggles)
        if reason is None:
            debug_log("registry.resolve", op=op, backend=backend.name, rejected=len(rejected))
            return Resolution(op=op, backend=backend, rejected=tuple(rejected))
        rejected.append((backend.name, reason))
        if backend.requested_by(toggles):
            log_once(
                f"fallback:{op}:{backend.name}:{reason}",
                "registry.fallback",
                op=op,
                backend=backend.name,
                reason=repr(reason),
            )
    raise RuntimeError(f"no backend accepts op {op!r} for {ctx}; rejections: {rejected}")


def resolve_fn(op: str, ctx: OpContext, toggles: Toggles) -> Callable[..., Any]:
    """The ``fn`` of the backend :func:`resolve` picks, with the debug hooks ``toggles`` turn on.

    The hooks (NSA_DEBUG_SHAPES, NSA_DEBUG_TIMING, NSA_DEBUG_COMPARE; :mod:`nsa_core.debug_hooks`)
    wrap whichever backend serves, so every backend is observed the same way.
    """
    backend = resolve(op, ctx, toggles).backend
    if not toggles.debug_hooks:
        return backend.fn
    reference = {b.name: b for b in backends(op)}["reference"]
    return with_debug_hooks(op, backend.name, backend.fn, reference.fn, toggles)


def resolve_fn_with_lse(op: str, ctx: OpContext, toggles: Toggles) -> Callable[..., Any] | None:
    """The ``fn_with_lse`` of the backend :func:`resolve` picks, or None.

    None when that backend has none, and whenever a debug hook is on: the hooks observe ``fn``,
    so the caller then runs :func:`resolve_fn` and goes without the lse.
    """
    if toggles.debug_hooks:
        return None
    return resolve(op, ctx, toggles).backend.fn_with_lse


def resolve_gated(sel_ctx: OpContext, combine_ctx: OpContext, toggles: Toggles) -> Backend | None:
    """The ``selected_attention`` backend :func:`resolve` picks, where its ``fn_gated`` serves
    the one-step gated sum; else None.

    The one rule for that sum: None where a debug hook is on (the hooks observe ``fn``),
    ``gated_combine`` resolves to the reference (a pinned reference combine is honoured), the
    selected backend has no ``fn_gated``, or either call needs a gradient and the backend's
    ``fn_gated`` gives none (``gated_grad``); the caller then runs the selected branch and the
    combine apart. The backend's ``gated_runs`` says whether it takes o_cmp as runs of rows.
    """
    if toggles.debug_hooks:
        return None
    if resolve("gated_combine", combine_ctx, toggles).backend.name == "reference":
        return None
    backend = resolve("selected_attention", sel_ctx, toggles).backend
    if backend.fn_gated is None:
        return None
    if (sel_ctx.requires_grad or combine_ctx.requires_grad) and not backend.gated_grad:
        return None
    return backend


def resolve_fn_sum3(combine_ctx: OpContext, toggles: Toggles) -> Callable[..., Any] | None:
    """The ``fn_sum3`` of the ``gated_combine`` backend :func:`resolve` picks, or None (the
    reference combine has none: autograd adds the gradients)."""
    return resolve("gated_combine", combine_ctx, toggles).backend.fn_sum3


def _resolve_pinned(op: str, name: str, ctx: OpContext, toggles: Toggles) -> Resolution:
    """The backend NSA_<STEP>_BACKEND names: it serves, or the call fails with its reason."""
    toggle = "NSA_" + BACKEND_TOGGLE[op].upper()
    rows = {b.name: b for b in backends(op)}
    if name not in rows:
        raise ValueError(f"{toggle}={name!r}: op {op!r} has no such backend; known: {sorted(rows)}")
    backend = rows[name]
    reason = backend.supports(ctx, toggles)
    if reason is not None:
        raise RuntimeError(f"{toggle}={name!r} pins a backend that declines this call: {reason}")
    return Resolution(op=op, backend=backend, rejected=())


def routing_report(ctx: OpContext, toggles: Toggles | None = None) -> str:
    """One line per op: the chosen backend and the reasons the preferred ones were passed over.

    Where the attention core would sum the gated combine inside the selected branch's launch
    (:func:`resolve_gated` gives a backend for this context), the ``gated_combine`` line
    says so; where it would hand the compressed output to that launch as runs of rows
    (``fn_runs_with_lse`` and ``gated_runs``), the ``compressed_attention`` line does; where
    the sliding backend would hand that launch each row's softmax over its forced blocks
    (``fn_with_local`` and ``gated_local``), the ``sliding_attention`` line does.
    """
    toggles = get_toggles() if toggles is None else toggles
    lines = []
    for op in OPS:
        res = resolve(op, ctx, toggles)
        why = "; ".join(f"{name}: {reason}" for name, reason in res.rejected)
        line = f"{op:22s} -> {res.backend.name}" + (f"   (passed over {why})" if why else "")
        if op == "gated_combine" and resolve_gated(ctx, ctx, toggles) is not None:
            need = "with grad" if ctx.requires_grad else "no grad"
            line += f"   ({need}: summed inside selected_attention's launch)"
        if op == "compressed_attention" and _runs_in_place(res.backend, ctx, toggles):
            need = "with grad" if ctx.requires_grad else "no grad"
            line += f"   ({need}: its output reaches selected_attention's launch as runs of rows)"
        if op == "sliding_attention" and _hands_local(res.backend, ctx, toggles):
            line += (
                "   (where the branches share k and v and w >= 2 l': it hands "
                "selected_attention's launch each row's softmax over its forced blocks)"
            )
        lines.append(line)
    return "\n".join(lines)


def _runs_in_place(compressed: Backend, ctx: OpContext, toggles: Toggles) -> bool:
    """Whether the attention core hands this compressed backend's output to the selected
    step's one-launch sum as runs of rows, read in place: no debug hook, the backend has
    ``fn_runs_with_lse`` and the selected backend's ``fn_gated`` serves (with a gradient where
    one is needed) and takes runs (whether the backend then splits its output is its own call)."""
    if compressed.fn_runs_with_lse is None:
        return False
    gated = resolve_gated(ctx, ctx, toggles)
    return gated is not None and gated.gated_runs


def _hands_local(sliding: Backend, ctx: OpContext, toggles: Toggles) -> bool:
    """Whether the attention core has this sliding backend hand the selected step's one-launch
    sum each row's softmax over its forced blocks (:mod:`nsa_core.local_softmax`): no debug
    hook, the backend has ``fn_with_local``, and the selected backend of that sum has a
    ``gated_local`` that wants one for this context. Whether a call's branches share k and v
    and its window holds the local keys is the call's to say, not the context's."""
    if toggles.debug_hooks or sliding.fn_with_local is None:
        return False
    gated = resolve_gated(ctx, ctx, toggles)
    return gated is not None and gated.gated_local is not None and gated.gated_local(ctx)


def _always(ctx: OpContext, toggles: Toggles) -> str | None:
    return None


def _without_toggles(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A reference body as a backend: the reference takes no toggles."""

    @functools.wraps(fn)
    def call(*args: Any, toggles: Toggles, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return call


# The reference select_blocks backend's body: it takes the keyword lse and does not read it (the
# spec defines the scores from the reference's own compressed softmax).
select_blocks_reference = select_blocks_impl


def register_reference_backends() -> None:
    """Register nsa-core's reference bodies (priority 0, accept every call)."""
    for op, fn in (
        ("apply_rope", apply_rope_impl),
        ("select_blocks", select_blocks_reference),
        ("compressed_attention", compressed_attention_impl),
        ("selected_attention", selected_attention_impl),
        ("sliding_attention", sliding_attention_impl),
        ("gated_combine", gated_combine_impl),
    ):
        register_backend(
            Backend(op=op, name="reference", fn=_without_toggles(fn), supports=_always, priority=0)
        )


@contextlib.contextmanager
def isolated_registry() -> Iterator[None]:
    """A registry of nsa-core's reference backends alone for the duration of the block.

    Entry points count as loaded (no installed package adds its backends), so what the block
    registers competes with the references only; the once-only log state starts empty. On exit
    the backends, the entry-point state and the log state are what they were before: a test that
    registers a backend of its own leaves no trace for the next one.
    """
    global _entry_points_loaded
    saved = {op: list(rows) for op, rows in _backends.items()}
    saved_loaded = _entry_points_loaded
    _backends.clear()
    _backends.update({op: [] for op in OPS})
    _entry_points_loaded = True
    register_reference_backends()
    reset_log_state()
    try:
        yield
    finally:
        _backends.clear()
        _backends.update(saved)
        _entry_points_loaded = saved_loaded
        reset_log_state()


logging.getLogger("nsa").addHandler(logging.NullHandler())
