"""The one place that reads the ``NSA_*`` environment toggles.

Every toggle is named ``NSA_<STEP>_<KNOB>`` with STEP one of ROPE, SCORE, CMP, SEL, WIN, COMBINE,
DECODE, DEBUG, parsed here, typed, and documented; a malformed value raises ``ValueError`` naming
the toggle. Other modules call :func:`get_toggles` and never read ``os.environ``.

| toggle | type | default | meaning |
|---|---|---|---|
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

Old names keep working for one release, each with a ``DeprecationWarning`` (once per name) that
names its replacement; setting an old name and its new name to different values is an error:

| old name | new name |
|---|---|
| NSA_USE_TRITON_SEL | NSA_SEL_TRITON |
| NSA_TRITON_SEL_FORCE | NSA_SEL_TRITON_FORCE |
| NSA_SEL_TRITON_ALLOW_GRAD | NSA_SEL_TRITON_GRAD |
| NSA_SEL_TRITON_MIN_L | NSA_SEL_TRITON_MIN_LEN |
| NSA_SEL_TRITON_CHECK_INDICES | NSA_SEL_CHECK_INDICES |
| NSA_USE_CUDA_SEL | NSA_SEL_CUDA |
| NSA_USE_FA2 | NSA_CMP_FA2 and NSA_WIN_FA2 |
| NSA_FA2_MIN_LEN_CMP | NSA_CMP_FA2_MIN_LEN |
| NSA_FA2_MIN_LEN_WIN | NSA_WIN_FA2_MIN_LEN |
| NSA_LOG_LIMIT | NSA_DEBUG_LOG_LIMIT |
| NSA_FA2_FORCE_VARLEN | NSA_DEBUG_FA2_VARLEN |
| NSA_FA2_FORCE_DENSE | NSA_DEBUG_FA2_DENSE |

Kernel tiles are not toggles: pass ``SelConfig(block_l=...)`` as ``config=``. The old tile names
NSA_SEL_TRITON_BLOCK_L, NSA_SEL_TRITON_BLOCK_D and NSA_SEL_TRITON_BLOCK_DV still work for one
release: :func:`legacy_sel_tiles` reads
them once (with a ``DeprecationWarning``) and the Triton selection backend hands them to the
kernels as a config.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})

# Old toggle name -> the fields it sets (one release of grace, then removed).
DEPRECATED_NAMES: dict[str, tuple[str, ...]] = {
    "NSA_USE_TRITON_SEL": ("sel_triton",),
    "NSA_TRITON_SEL_FORCE": ("sel_triton_force",),
    "NSA_SEL_TRITON_ALLOW_GRAD": ("sel_triton_grad",),
    "NSA_SEL_TRITON_MIN_L": ("sel_triton_min_len",),
    "NSA_SEL_TRITON_CHECK_INDICES": ("sel_check_indices",),
    "NSA_USE_CUDA_SEL": ("sel_cuda",),
    "NSA_USE_FA2": ("cmp_fa2", "win_fa2"),
    "NSA_FA2_MIN_LEN_CMP": ("cmp_fa2_min_len",),
    "NSA_FA2_MIN_LEN_WIN": ("win_fa2_min_len",),
    "NSA_LOG_LIMIT": ("debug_log_limit",),
    "NSA_FA2_FORCE_VARLEN": ("debug_fa2_varlen",),
    "NSA_FA2_FORCE_DENSE": ("debug_fa2_dense",),
}

# Old tile toggle -> the SelConfig field it fills.
DEPRECATED_TILE_NAMES: dict[str, str] = {
    "NSA_SEL_TRITON_BLOCK_L": "block_l",
    "NSA_SEL_TRITON_BLOCK_D": "block_d",
    "NSA_SEL_TRITON_BLOCK_DV": "block_dv",
}

_warned: set[str] = set()


def _warn_deprecated(old: str, replacement: str) -> None:
    """One DeprecationWarning per old name per process."""
    if old in _warned:
        return
    _warned.add(old)
    warnings.warn(
        f"{old} is deprecated and will be removed in the next release; use {replacement}",
        DeprecationWarning,
        stacklevel=4,
    )


def _parse_bool(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def _parse_name(name: str, raw: str) -> str:
    value = raw.strip().lower()
    if not value or not value.replace("_", "").isalnum():
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
    """Parsed ``NSA_*`` toggles; field ``foo_bar`` is read from ``NSA_FOO_BAR``."""

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

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Toggles:
        """Parse the toggles from ``environ`` (default ``os.environ``); unset ones keep defaults.

        An old name (:data:`DEPRECATED_NAMES`) fills its new fields with a DeprecationWarning;
        an old name and its new name set to different values raise ``ValueError`` naming both.
        """
        env = os.environ if environ is None else environ
        kinds = {f.name: f.type for f in fields(cls)}

        def parse(field_name: str, name: str, raw: str) -> bool | int | str:
            if kinds[field_name] == "bool":
                return _parse_bool(name, raw)
            if kinds[field_name] == "str":
                return _parse_name(name, raw)
            return _parse_int(name, raw, minimum=0)

        values: dict[str, bool | int | str] = {}
        for field_name in kinds:
            raw = env.get(env_name(field_name))
            if raw is not None:
                values[field_name] = parse(field_name, env_name(field_name), raw)
        for old, targets in DEPRECATED_NAMES.items():
            raw = env.get(old)
            if raw is None:
                continue
            _warn_deprecated(old, " and ".join(env_name(t) for t in targets))
            for target in targets:
                value = parse(target, old, raw)
                if target in values and values[target] != value:
                    raise ValueError(
                        f"{old}={raw!r} and {env_name(target)}={env[env_name(target)]!r} "
                        f"disagree; set only {env_name(target)}"
                    )
                values[target] = value
        toggles = cls(**values)  # type: ignore[arg-type]
        if toggles.debug_fa2_varlen and toggles.debug_fa2_dense:
            raise ValueError("NSA_DEBUG_FA2_VARLEN and NSA_DEBUG_FA2_DENSE are both set; pick one")
        return toggles

    def env_names(self) -> dict[str, str]:
        """The toggles as ``{NSA_NAME: value}``, for reports."""
        return {env_name(f.name): str(getattr(self, f.name)) for f in fields(self)}

    @property
    def debug_hooks(self) -> bool:
        """Whether any per-call debug hook (shapes, timing, compare) is on."""
        return self.debug_shapes or self.debug_timing or self.debug_compare


def legacy_sel_tiles_from_env(environ: Mapping[str, str] | None = None) -> dict[str, int]:
    """``{SelConfig field: value}`` from the deprecated NSA_SEL_TRITON_BLOCK_* toggles (if set).

    Each name set warns once (DeprecationWarning) and must be 0 or a power of two.
    """
    env = os.environ if environ is None else environ
    tiles: dict[str, int] = {}
    for old, config_field in DEPRECATED_TILE_NAMES.items():
        raw = env.get(old)
        if raw is None:
            continue
        _warn_deprecated(old, f"SelConfig({config_field}=...) passed as config=")
        value = _parse_int(old, raw, minimum=0)
        if value & (value - 1):
            raise ValueError(f"{old}={value} must be 0 or a power of two")
        if value:
            tiles[config_field] = value
    return tiles


_cached: Toggles | None = None
_cached_tiles: dict[str, int] | None = None


def get_toggles() -> Toggles:
    """The process's toggles, parsed from the environment once."""
    global _cached
    if _cached is None:
        _cached = Toggles.from_env()
    return _cached


def legacy_sel_tiles() -> dict[str, int]:
    """The process's deprecated Triton selection tiles, read from the environment once."""
    global _cached_tiles
    if _cached_tiles is None:
        _cached_tiles = legacy_sel_tiles_from_env()
    return dict(_cached_tiles)


def reload_toggles() -> Toggles:
    """Re-read the environment (tests and long-lived tools that change ``os.environ``)."""
    global _cached, _cached_tiles
    _cached = Toggles.from_env()
    _cached_tiles = legacy_sel_tiles_from_env()
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
