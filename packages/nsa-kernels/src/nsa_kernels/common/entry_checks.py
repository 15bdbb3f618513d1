"""Argument checks the kernels' public entry points share beyond nsa-core's op rules.

nsa-core's :mod:`nsa_core.checks` holds the rules of the ops (shapes, dtypes, devices, ranges);
these are the arguments only the kernels take: the toggles a routing decision was made with,
the halves of a forward and backward (o, lse, do), and the devices, dtypes, booleans and
callables of the decode step (tile configs: :func:`~nsa_kernels.common.tile_config.check_config`;
where Triton runs: :mod:`nsa_kernels.common.triton_inputs`). Each raises TypeError for a wrong
kind of value and ValueError for a wrong value, naming the argument and the rule (docs/spec.md,
"Argument rules").
"""

from __future__ import annotations

import torch

from nsa_core.checks import check_rank, check_same_place, shape
from nsa_core.toggles import Toggles


def check_toggles(toggles: object) -> None:
    """``toggles`` is None (the process's toggles) or a :class:`~nsa_core.toggles.Toggles`."""
    if toggles is not None and not isinstance(toggles, Toggles):
        raise TypeError(
            f"toggles must be an nsa_core.toggles.Toggles or None, got {type(toggles).__name__}"
        )


def check_bool(name: str, value: object) -> None:
    """``value`` is a bool (not 0 or 1, which read as a count or an index)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def check_lse_of(lse: torch.Tensor, q: torch.Tensor) -> None:
    """``lse`` is a forward's log-sum-exp: float32 [B, Tq, HQ] on q's device (a tensor: checked
    first, whatever the annotation says)."""
    check_rank("lse", lse, 3, "[B, Tq, HQ]")
    if lse.dtype != torch.float32:
        raise TypeError(f"lse must be float32, got {lse.dtype}")
    if tuple(lse.shape) != tuple(q.shape[:3]):
        raise ValueError(f"lse {shape(lse)} must be [B, Tq, HQ] = {list(q.shape[:3])} like q")
    if lse.device != q.device:
        raise ValueError(f"lse is on {lse.device} but q is on {q.device}")


def check_backward_args(
    do: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, v: torch.Tensor
) -> None:
    """A backward's upstream gradient ``do`` and the forward's ``o``, both [B, Tq, HQ, dv] in
    q's dtype on q's device (dv: v's last axis), and its ``lse`` (:func:`check_lse_of`)."""
    want = [*q.shape[:3], v.shape[3]]
    for name, t in (("do", do), ("o", o)):
        check_rank(name, t, 4, "[B, Tq, HQ, dv]")
        if list(t.shape) != want:
            raise ValueError(f"{name} {shape(t)} must be [B, Tq, HQ, dv] = {want}")
        check_same_place(name, t, "q", q)
    check_lse_of(lse, q)


def check_device(name: str, device: object) -> torch.device:
    """``device`` (a torch.device or a str such as ``"cuda:0"``) as a torch.device."""
    if not isinstance(device, (torch.device, str)):
        raise TypeError(f"{name} must be a torch.device or a str, got {type(device).__name__}")
    try:
        return torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"{name} {device!r} is not a device: {err}") from None


def check_float_dtype(name: str, dtype: object) -> torch.dtype:
    """``dtype`` is a floating-point torch.dtype."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point torch.dtype, got {dtype!r}")
    return dtype


def check_callable(name: str, fn: object, what: str) -> None:
    """``fn`` is None or callable (``what`` says what it maps, for the error)."""
    if fn is not None and not callable(fn):
        raise TypeError(f"{name} must be None or a callable ({what}), got {type(fn).__name__}")
