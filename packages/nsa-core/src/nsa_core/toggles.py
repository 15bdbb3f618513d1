"""The one place that reads the ``NSA_*`` environment toggles.

Every toggle is named ``NSA_<STEP>_<KNOB>`` with STEP one of CORE, ROPE, SCORE, CMP, SEL, WIN,
COMBINE, DEBUG, parsed here, typed, and documented; a malformed value raises ``ValueError`` naming
the toggle. Other modules call :func:`get_toggles` and never read ``os.environ``.

| toggle | type | default | meaning |
|---|---|---|---|
| NSA_CORE_BACKEND | str | auto | the attention core (steps after compression): ``auto`` or a name |
| NSA_ROPE_BACKEND | str | auto | rotary embedding of q and k: ``auto`` or a backend name |
| NSA_SCORE_BACKEND | str | auto | block scoring and top-n: ``auto`` or a backend name |
| NSA_CMP_BACKEND | str | auto | compressed branch: ``auto`` or a backend name |
| NSA_CMP_FA2 | bool | 1 | FlashAttention-2 for the compressed branch, if installed |
| NSA_CMP_FA2_MIN_LEN | int | 16 | shortest sequence routed to FA-2 for the compressed branch |
| NSA_CMP_CUDNN | bool | 1 | cuDNN's fused attention for the compressed branch where it wins |
| NSA_SEL_BACKEND | str | auto | selected branch: ``auto`` or a backend name |
| NSA_SEL_TRITON | bool | 1 | Triton selected attention where the device policy allows it |
| NSA_SEL_TRITON_FORCE | bool | 0 | Triton selection even where the device policy falls back |
| NSA_SEL_TRITON_GRAD | bool | 1 | allow the Triton backend when gradients are required |
| NSA_SEL_TRITON_MIN_LEN | int | 0 | shortest sequence (tokens) routed to Triton selection |
| NSA_SEL_TRITON_GROUP | bool | 1 | group-centric kernels (a program serves a kv head's G heads) |
| NSA_SEL_CHECK_INDICES | bool | 0 | raise on indices outside [-1, blocks) on CUDA (a sync) |
| NSA_SEL_CUDA | bool | 0 | allow the experimental CUDA selected-attention kernel |
| NSA_WIN_BACKEND | str | auto | sliding branch: ``auto`` or a backend name |
| NSA_WIN_FA2 | bool | 1 | FlashAttention-2 for the sliding branch, if installed |
| NSA_WIN_FA2_MIN_LEN | int | 16 | shortest sequence routed to FA-2 for the sliding branch |
| NSA_COMBINE_BACKEND | str | auto | gated combine of the branches: ``auto`` or a backend name |
| NSA_COMBINE_GRAD_SUM | bool | 1 | sum the branches' gradients of q in one pass (more memory) |
| NSA_DEBUG_LOG | bool | 0 | structured debug logs on the ``nsa`` logger |
| NSA_DEBUG_LOG_LIMIT | int | 10 | how many times one log tag is emitted before it goes quiet |
| NSA_DEBUG_TIMING | bool | 0 | time every op call (``debug.timing``; synchronizes on CUDA: slow) |
| NSA_DEBUG_SHAPES | bool | 0 | log shapes, strides and dtypes at every op call (``debug.shapes``) |
| NSA_DEBUG_COMPARE | bool | 0 | every op's error against the reference (``debug.compare``; slow) |
| NSA_DEBUG_FA2_VARLEN | bool | 0 | always use FA-2's varlen entry point |
| NSA_DEBUG_FA2_DENSE | bool | 0 | always use FA-2's dense entry point |

Kernel tiles are not toggles: pass ``SelConfig(block_l=...)`` as ``config=``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


def _parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def _is_backend_name(value: str) -> bool:
    # The registry takes any name; these are the characters the registered ones use.
    return bool(value) and value.replace("_", "").replace("-", "").isalnum()


def _parse_name(name: str, raw: str) -> str:
    value = raw.strip().lower()
    if not _is_backend_name(value):
        raise ValueError(f"{name}={raw!r} must be 'auto' or a backend name such as 'reference'")
    return value


def _parse_int(name: str, raw: str, minimum: int) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={raw!r} must be >= {minimum}")
    return value


def env_name(field_name: str) -> str:
    """The toggle that sets field ``field_name``: ``sel_triton`` -> ``NSA_SEL_TRITON``."""
    return "NSA_" + field_name.upper()


@dataclass(frozen=True)
class Toggles:
    """Parsed ``NSA_*`` toggles; field ``foo_bar`` is read from ``NSA_FOO_BAR``.

    Made directly (or by ``dataclasses.replace``), every field is checked as the environment's
    value would be: a bool for the bool fields, an int >= 0 for the ints, ``auto`` or a backend
    name (lower case) for the names.
    """

    core_backend: str = "auto"
    rope_backend: str = "auto"
    score_backend: str = "auto"
    cmp_backend: str = "auto"
    cmp_fa2: bool = True
    cmp_fa2_min_len: int = 16
    cmp_cudnn: bool = True
    sel_backend: str = "auto"
    sel_triton: bool = True
    sel_triton_force: bool = False
    sel_triton_grad: bool = True
    sel_triton_min_len: int = 0
    sel_triton_group: bool = True
    sel_check_indices: bool = False
    sel_cuda: bool = False
    win_backend: str = "auto"
    win_fa2: bool = True
    win_fa2_min_len: int = 16
    combine_backend: str = "auto"
    combine_grad_sum: bool = True
    debug_log: bool = False
    debug_log_limit: int = 10
    debug_timing: bool = False
    debug_shapes: bool = False
    debug_compare: bool = False
    debug_fa2_varlen: bool = False
    debug_fa2_dense: bool = False

    def __post_init__(self) -> None:
        # Checked here, not in nsa_core.checks: that module reads the toggles.
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "bool" and not isinstance(value, bool):
                raise TypeError(f"Toggles.{f.name} must be a bool, got {value!r}")
            if f.type == "int":
                if isinstance(value, bool) or not isinstance(value, int):
                    raise TypeError(f"Toggles.{f.name} must be an int, got {value!r}")
                if value < 0:
                    raise ValueError(f"Toggles.{f.name} must be >= 0, got {value}")
            if f.type == "str":
                if not isinstance(value, str):
                    raise TypeError(f"Toggles.{f.name} must be a str, got {value!r}")
                if not _is_backend_name(value) or value != value.lower():
                    raise ValueError(
                        f"Toggles.{f.name} must be 'auto' or a backend name such as "
                        f"'reference' (lower case), got {value!r}"
                    )
        if self.debug_fa2_varlen and self.debug_fa2_dense:
            raise ValueError("NSA_DEBUG_FA2_VARLEN and NSA_DEBUG_FA2_DENSE are both set; pick one")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Toggles:
        """Parse the toggles from ``environ`` (default ``os.environ``); unset ones keep defaults.

        ``environ`` is a mapping of str to str (or None).
        """
        if environ is not None and not isinstance(environ, Mapping):
            raise TypeError(f"environ must be a mapping or None, got {type(environ).__name__}")
        env = os.environ if environ is None else environ
        kinds = {f.name: f.type for f in fields(cls)}
        values: dict[str, bool | int | str] = {}
        for field_name, kind in kinds.items():
            name = env_name(field_name)
            raw = env.get(name)
            if raw is None:
                continue
            if not isinstance(raw, str):
                raise TypeError(f"environ[{name!r}] must be a str, got {type(raw).__name__}")
            if kind == "bool":
                values[field_name] = _parse_bool(name, raw)
            elif kind == "str":
                values[field_name] = _parse_name(name, raw)
            else:
                values[field_name] = _parse_int(name, raw, minimum=0)
        return cls(**values)  # type: ignore[arg-type]

    def env_names(self) -> dict[str, str]:
        """The toggles as ``{NSA_NAME: value}``, for reports."""
        return {env_name(f.name): str(getattr(self, f.name)) for f in fields(self)}

    @property
    def debug_hooks(self) -> bool:
        """Whether any per-call debug hook (shapes, timing, compare) is on."""
        return self.debug_shapes or self.debug_timing or self.debug_compare


_cached: Toggles | None = None


def get_toggles() -> Toggles:
    """The process's toggles, parsed from the environment once."""
    global _cached
    if _cached is None:
        _cached = Toggles.from_env()
    return _cached


def reload_toggles() -> Toggles:
    """Re-read the environment (tests and long-lived tools that change ``os.environ``)."""
    global _cached
    _cached = Toggles.from_env()
    return _cached


@contextmanager
def toggles_overridden(**changes: Any) -> Iterator[Toggles]:
    """The process's toggles with ``changes`` (field names) applied inside the block.

    For benches and tests that time one backend against another in one process, e.g.
    ``toggles_overridden(win_backend="triton_win")``; an unknown field raises ``TypeError``.
    The toggles the block started with come back on exit, even after an exception.
    """
    global _cached
    saved = get_toggles()
    _cached = dataclasses.replace(saved, **changes)
    try:
        yield _cached
    finally:
        _cached = saved


# The toggle that pins each op's backend (docs: NSA_<STEP>_BACKEND).
BACKEND_TOGGLE = {
    "attention_core": "core_backend",
    "apply_rope": "rope_backend",
    "select_blocks": "score_backend",
    "compressed_attention": "cmp_backend",
    "selected_attention": "sel_backend",
    "sliding_attention": "win_backend",
    "gated_combine": "combine_backend",
}


def pinned_backend(toggles: Toggles, op: str) -> str | None:
    """The backend name ``NSA_<STEP>_BACKEND`` pins for ``op``, or None for ``auto``."""
    field_name = BACKEND_TOGGLE.get(op)
    if field_name is None:
        return None
    value: str = getattr(toggles, field_name)
    return None if value == "auto" else value
