"""The one place that reads the ``NSA_*`` environment toggles.

Every toggle is parsed here, typed, and documented; a malformed value raises ``ValueError``
naming the toggle. Other modules call :func:`get_toggles` and never read ``os.environ``.

| toggle | type | default | meaning |
|---|---|---|---|
| NSA_SCORE_BACKEND | str | auto | block scoring and top-n: ``auto`` or a backend name |
| NSA_CMP_BACKEND | str | auto | compressed branch: ``auto`` or a backend name |
| NSA_SEL_BACKEND | str | auto | selected branch: ``auto`` or a backend name |
| NSA_WIN_BACKEND | str | auto | sliding branch: ``auto`` or a backend name |
| NSA_USE_TRITON_SEL | bool | 1 | Triton selected attention where the device policy allows it |
| NSA_TRITON_SEL_FORCE | bool | 0 | Triton selection even where the device policy falls back |
| NSA_SEL_TRITON_ALLOW_GRAD | bool | 1 | allow the Triton backend when gradients are required |
| NSA_SEL_TRITON_MIN_L | int | 0 | shortest sequence (tokens) routed to Triton selection |
| NSA_SEL_TRITON_GROUP | bool | 1 | group-centric kernels (a program serves a kv head's G heads) |
| NSA_SEL_TRITON_BLOCK_D | int | 0 | Triton tile over dk; 0 = the kernel's own choice |
| NSA_SEL_TRITON_BLOCK_L | int | 0 | Triton tile over keys; 0 = the kernel's own choice |
| NSA_SEL_TRITON_BLOCK_DV | int | 0 | Triton tile over dv; 0 = the kernel's own choice |
| NSA_SEL_TRITON_CHECK_INDICES | bool | 0 | raise on indices outside [-1, blocks) (a sync) |
| NSA_USE_FA2 | bool | 1 | FlashAttention-2 for the sliding and compressed branches, if installed |
| NSA_FA2_MIN_LEN_WIN | int | 16 | shortest sequence routed to FA-2 for the sliding branch |
| NSA_FA2_MIN_LEN_CMP | int | 16 | shortest sequence routed to FA-2 for the compressed branch |
| NSA_FA2_FORCE_VARLEN | bool | 0 | always use FA-2's varlen entry point (debugging) |
| NSA_FA2_FORCE_DENSE | bool | 0 | always use FA-2's dense entry point (debugging) |
| NSA_USE_CUDA_SEL | bool | 0 | allow the experimental CUDA selected-attention kernel |
| NSA_DEBUG_LOG | bool | 0 | structured debug logs on the ``nsa`` logger |
| NSA_LOG_LIMIT | int | 10 | how many times one log tag is emitted before it goes quiet |
| NSA_DEBUG_TIMING | bool | 0 | per-bucket timings of kernel launches (synchronizes: slow) |
| NSA_DEBUG_SHAPES | bool | 0 | log shapes and strides at kernel entry |
| NSA_DEBUG_COMPARE | bool | 0 | compare kernel outputs with the reference and log the MAE (slow) |
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


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


@dataclass(frozen=True)
class Toggles:
    """Parsed ``NSA_*`` toggles; field ``foo_bar`` is read from ``NSA_FOO_BAR``."""

    score_backend: str = "auto"
    cmp_backend: str = "auto"
    sel_backend: str = "auto"
    win_backend: str = "auto"
    use_triton_sel: bool = True
    triton_sel_force: bool = False
    sel_triton_allow_grad: bool = True
    sel_triton_min_l: int = 0
    sel_triton_group: bool = True
    sel_triton_block_d: int = 0
    sel_triton_block_l: int = 0
    sel_triton_block_dv: int = 0
    sel_triton_check_indices: bool = False
    use_fa2: bool = True
    fa2_min_len_win: int = 16
    fa2_min_len_cmp: int = 16
    fa2_force_varlen: bool = False
    fa2_force_dense: bool = False
    use_cuda_sel: bool = False
    debug_log: bool = False
    log_limit: int = 10
    debug_timing: bool = False
    debug_shapes: bool = False
    debug_compare: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Toggles:
        """Parse the toggles from ``environ`` (default ``os.environ``); unset ones keep defaults."""
        env = os.environ if environ is None else environ
        values: dict[str, bool | int | str] = {}
        for f in fields(cls):
            name = "NSA_" + f.name.upper()
            raw = env.get(name)
            if raw is None:
                continue
            if f.type == "bool":
                values[f.name] = _parse_bool(name, raw)
            elif f.type == "str":
                values[f.name] = _parse_name(name, raw)
            else:
                values[f.name] = _parse_int(name, raw, minimum=0)
        toggles = cls(**values)  # type: ignore[arg-type]
        if toggles.fa2_force_varlen and toggles.fa2_force_dense:
            raise ValueError("NSA_FA2_FORCE_VARLEN and NSA_FA2_FORCE_DENSE are both set; pick one")
        for name in ("sel_triton_block_d", "sel_triton_block_l", "sel_triton_block_dv"):
            block = getattr(toggles, name)
            if block and block & (block - 1):
                raise ValueError(f"NSA_{name.upper()}={block} must be 0 or a power of two")
        return toggles

    def env_names(self) -> dict[str, str]:
        """The toggles as ``{NSA_NAME: value}``, for reports."""
        return {"NSA_" + f.name.upper(): str(getattr(self, f.name)) for f in fields(self)}


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


# The toggle that pins each op's backend (docs: NSA_<STEP>_BACKEND).
BACKEND_TOGGLE = {
    "select_blocks": "score_backend",
    "compressed_attention": "cmp_backend",
    "selected_attention": "sel_backend",
    "sliding_attention": "win_backend",
}


def pinned_backend(toggles: Toggles, op: str) -> str | None:
    """The backend name ``NSA_<STEP>_BACKEND`` pins for ``op``, or None for ``auto``."""
    field_name = BACKEND_TOGGLE.get(op)
    if field_name is None:
        return None
    value: str = getattr(toggles, field_name)
    return None if value == "auto" else value
