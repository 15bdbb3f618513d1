"""The seam between the reference ops and faster backends.

Each op of an NSA layer (``OPS``: the six steps and the attention core that runs them all) has
implementations ("backends") registered here. nsa-core registers the reference of every op
(:mod:`nsa_core.reference_backends`) with the lowest priority; it supports everything, so
resolution always ends somewhere correct. Other packages register faster backends through the
``nsa.backends`` entry-point group: each entry point names a callable that receives this
module's :func:`register_backend`. nsa-core never imports them.

A backend's ``supports(ctx, toggles)`` returns ``None`` when it can serve the call, or the reason
it cannot. :func:`resolve` walks the backends from the highest priority down and returns the first
that accepts, together with every rejection and its reason; each rejection of a backend that the
user asked for through a toggle is logged once. :func:`resolve_fn` returns the chosen backend's
callable, wrapped in the debug hooks of :mod:`nsa_core.debug_hooks` when a debug toggle is on.
:func:`routing_report` renders the decision for a given context, so the choice is observable.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Protocol, runtime_checkable

from nsa_core.debug_hooks import with_debug_hooks
from nsa_core.debug_log import debug_log, log_once, reset_log_state
from nsa_core.op_context import OpContext as OpContext  # re-exported: the registry API names it
from nsa_core.toggles import BACKEND_TOGGLE, Toggles, get_toggles, pinned_backend

STEP_OPS = (
    "apply_rope",
    "select_blocks",
    "compressed_attention",
    "selected_attention",
    "sliding_attention",
    "gated_combine",
)
CORE_OP = "attention_core"
OPS = (*STEP_OPS, CORE_OP)
ENTRY_POINT_GROUP = "nsa.backends"


Supports = Callable[[OpContext, Toggles], "str | None"]


@dataclass(frozen=True)
class Backend:
    """One implementation of ``op``.

    ``fn`` takes the op's arguments under the reference signature's names (positional or by
    keyword), already validated (:mod:`nsa_core.checks`: a backend never validates again), plus
    the keyword ``toggles``: the toggles the routing decision that chose it was made with (a
    backend never re-reads the environment).

    ``requested_by(toggles)``: whether the user asked for this backend through a toggle; a
    rejection of such a backend is logged once (a silent fallback is a defect).

    ``fn_with_lse`` (``compressed_attention`` only, optional) takes the same arguments and
    returns ``(o, lse)``: the output ``fn`` gives, bit for bit, and the natural-log normaliser
    of its softmax, float32 [B, Tq, HQ], ``log sum_i exp(scale * q . k_cmp[i])`` over the
    visible blocks, -inf on rows that see none: what ``select_blocks``'s public ``lse`` argument
    takes (docs/spec.md, "Block scoring on a GPU").
    """

    op: str
    name: str
    fn: Callable[..., Any]
    supports: Supports
    priority: int = 0
    requested_by: Callable[[Toggles], bool] = field(default=lambda toggles: False)
    fn_with_lse: Callable[..., Any] | None = None


@runtime_checkable
class StepsReport(Protocol):
    """An ``attention_core`` backend's ``fn`` that can say which step runs where for a context
    (one line per step), for :func:`routing_report`."""

    def steps(self, ctx: OpContext, toggles: Toggles) -> list[str]: ...


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


def state() -> tuple[bool, tuple[tuple[str, tuple[tuple[str, int], ...]], ...]]:
    """Whether entry points were loaded, and each op's backends as (name, priority) rows.

    Tests compare it before and after each test: a test that changes the registry and leaves it
    changed makes every later test depend on the order the tests ran in.
    """
    rows = tuple((op, tuple((b.name, b.priority) for b in _backends[op])) for op in OPS)
    return _entry_points_loaded, rows


@contextlib.contextmanager
def restored_on_exit() -> Iterator[None]:
    """The registry as it is now, put back on leaving the block (even after an exception)."""
    global _entry_points_loaded
    saved = {op: list(rows) for op, rows in _backends.items()}
    saved_loaded = _entry_points_loaded
    try:
        yield
    finally:
        _backends.clear()
        _backends.update(saved)
        _entry_points_loaded = saved_loaded


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
    return hooked_fn(resolve(op, ctx, toggles).backend, toggles)


def hooked_fn(backend: Backend, toggles: Toggles) -> Callable[..., Any]:
    """``backend.fn``, wrapped in the debug hooks where ``toggles`` turn one on."""
    if not toggles.debug_hooks:
        return backend.fn
    reference = {b.name: b for b in backends(backend.op)}["reference"]
    return with_debug_hooks(backend.op, backend.name, backend.fn, reference.fn, toggles)


def resolve_fn_with_lse(op: str, ctx: OpContext, toggles: Toggles) -> Callable[..., Any] | None:
    """The ``fn_with_lse`` of the backend :func:`resolve` picks, or None.

    None when that backend has none, and whenever a debug hook is on: the hooks observe ``fn``,
    so the caller then runs :func:`resolve_fn` and goes without the lse.
    """
    if toggles.debug_hooks:
        return None
    return resolve(op, ctx, toggles).backend.fn_with_lse


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

    The attention core comes first; where its backend can say how it runs the steps
    (:class:`StepsReport`), its lines follow, indented.
    """
    toggles = get_toggles() if toggles is None else toggles
    lines = []
    for op in (CORE_OP, *STEP_OPS):
        res = resolve(op, ctx, toggles)
        why = "; ".join(f"{name}: {reason}" for name, reason in res.rejected)
        lines.append(f"{op:22s} -> {res.backend.name}" + (f"   (passed over {why})" if why else ""))
        if op == CORE_OP and isinstance(res.backend.fn, StepsReport):
            lines.extend(f"    {line}" for line in res.backend.fn.steps(ctx, toggles))
    return "\n".join(lines)


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
    _backends.update({op: [b for b in rows if b.name == "reference"] for op, rows in saved.items()})
    _entry_points_loaded = True
    reset_log_state()
    try:
        yield
    finally:
        _backends.clear()
        _backends.update(saved)
        _entry_points_loaded = saved_loaded
        reset_log_state()


logging.getLogger("nsa").addHandler(logging.NullHandler())
