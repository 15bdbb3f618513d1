"""The FlashAttention-2 entry points this package calls, loaded lazily, and what they accept.

flash_attn is an optional dependency (``nsa-kernels[fa2]``): nothing here imports it at module
import time. :func:`unsupported_reason` answers, without running anything, whether FA-2 can serve
a call; :func:`fa2_dense` and :func:`fa2_varlen` call it.

FA-2 needs one head dim for q, k and v. NSA's branches may have dk != dv (paper: 192 and 128), so
the smaller side is zero-padded to the larger: padded q/k columns add 0 to every score (the scale is
passed explicitly, so it stays dk ** -0.5) and padded v columns give output columns that are cut.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

FA2_DTYPES = (torch.float16, torch.bfloat16)
FA2_MAX_HEAD_DIM = 256
FA2_MIN_CAPABILITY = (8, 0)

_module: ModuleType | None = None
_import_error: str | None = None


def flash_attn() -> ModuleType | None:
    """The ``flash_attn`` module, or None when it cannot be imported (the error is kept)."""
    global _module, _import_error
    if _module is None and _import_error is None:
        try:
            _module = importlib.import_module("flash_attn")
        except Exception as exc:  # a broken build raises more than ImportError
            _import_error = f"{type(exc).__name__}: {exc}"
    return _module


def missing_reason() -> str | None:
    """Why flash_attn cannot be used at all, or None when it imports."""
    if flash_attn() is None:
        return f"flash_attn is not importable ({_import_error})"
    return None


def unsupported_reason(
    device: torch.device, dtype: torch.dtype, head_dim_qk: int, head_dim_v: int
) -> str | None:
    """Why FA-2 cannot serve tensors of this device/dtype/head dims, or None when it can."""
    if device.type != "cuda":
        return f"FA-2 needs a CUDA device, got {device.type}"
    missing = missing_reason()
    if missing is not None:
        return missing
    capability = torch.cuda.get_device_capability(device)
    if capability < FA2_MIN_CAPABILITY:
        return f"FA-2 needs sm80 or newer, device is sm{capability[0]}{capability[1]}"
    if dtype not in FA2_DTYPES:
        return f"FA-2 needs float16 or bfloat16, got {dtype}"
    head_dim = common_head_dim(head_dim_qk, head_dim_v)
    if head_dim > FA2_MAX_HEAD_DIM:
        return (
            f"FA-2 needs head dims <= {FA2_MAX_HEAD_DIM} after padding to a common multiple of 8, "
            f"got dk={head_dim_qk}, dv={head_dim_v}"
        )
    return None


def common_head_dim(head_dim_qk: int, head_dim_v: int) -> int:
    """The head dim FA-2 runs at: max(dk, dv) rounded up to a multiple of 8."""
    return -(-max(head_dim_qk, head_dim_v) // 8) * 8


def _pad_last(x: torch.Tensor, size: int) -> torch.Tensor:
    return x if x.shape[-1] == size else F.pad(x, (0, size - x.shape[-1]))


def _window(window: int | None) -> tuple[int, int]:
    # (w - 1, 0) with causal=True: query t keeps keys [t - w + 1, t] (bottom-right aligned).
    return (-1, 0) if window is None else (window - 1, 0)


def _module_or_raise() -> Any:
    module = flash_attn()
    if module is None:
        raise RuntimeError(missing_reason())
    return module


def _run(
    entry: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    packing: tuple[Any, ...],
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """flash_attn's ``entry`` on q, k, v padded to one head dim, causal, ``packing`` (varlen's
    cu_seqlens and max lengths) between the tensors and the options; o cut back to v's head dim."""
    dv = v.shape[-1]
    head_dim = common_head_dim(q.shape[-1], dv)
    out: torch.Tensor = getattr(_module_or_raise(), entry)(
        _pad_last(q, head_dim),
        _pad_last(k, head_dim),
        _pad_last(v, head_dim),
        *packing,
        softmax_scale=scale,
        causal=True,
        window_size=_window(window),
    )
    return out[..., :dv]


def fa2_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    *,
    window: int | None = None,
) -> torch.Tensor:
    """Causal, bottom-right aligned FA-2: q [B, Sq, HQ', dk], k [B, Sk, H, dk], v [B, Sk, H, dv].

    Query row i keeps key j iff ``j <= i + Sk - Sq`` (and ``j >= i + Sk - Sq - window + 1`` when a
    window is given); a row that keeps nothing gives zeros. Returns o [B, Sq, HQ', dv].
    """
    return _run("flash_attn_func", q, k, v, (), scale, window)


def fa2_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    *,
    window: int | None = None,
) -> torch.Tensor:
    """:func:`fa2_dense` per packed sequence: q [Sq_total, HQ', dk], k/v [Sk_total, H, dk/dv].

    cu_seqlens_q / cu_seqlens_k: int32 [S+1]; sequence s pairs q rows
    ``[cu_seqlens_q[s], cu_seqlens_q[s+1])`` with k rows ``[cu_seqlens_k[s], cu_seqlens_k[s+1])``,
    bottom-right aligned as in :func:`fa2_dense`. Returns o [Sq_total, HQ', dv].
    """
    packing = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _run("flash_attn_varlen_func", q, k, v, packing, scale, window)


def fa2_dense_as_varlen(
    q: Tensor, k: Tensor, v: Tensor, scale: float, *, window: int | None = None
) -> Tensor:
    """:func:`fa2_dense` through the varlen entry point, one packed sequence per batch row (the
    debug path NSA_DEBUG_FA2_VARLEN): q [B, Sq, HQ', dk], k [B, Sk, H, dk], v [B, Sk, H, dv] ->
    o [B, Sq, HQ', dv]."""
    batch, sq, heads, _ = q.shape
    sk = k.shape[1]

    def offsets(length: int) -> torch.Tensor:
        return torch.arange(batch + 1, dtype=torch.int32, device=q.device) * length

    out = fa2_varlen(
        q.reshape(batch * sq, heads, q.shape[-1]),
        k.reshape(batch * sk, *k.shape[2:]),
        v.reshape(batch * sk, *v.shape[2:]),
        offsets(sq),
        offsets(sk),
        sq,
        sk,
        scale,
        window=window,
    )
    return out.view(batch, sq, heads, v.shape[-1])
