"""The public signature of the attention ops, written once for their backends.

Every backend of an op has the reference op's signature (the registry calls them alike) and must
accept exactly what the op accepts. Here that signature, its argument checks
(:mod:`nsa_core.checks`, the same validators the public ops run) and its defaults (``scale =
dk ** -0.5``, the global toggles when none are handed over) are written once: a backend is an
``attend(q, k, v, call)`` function over validated arguments, wrapped as

    sliding_attention_sdpa = SlidingBackend(attend)

which is callable by name with the op's signature and its checks, as users and the tests call
it; the registry runs ``sliding_attention_sdpa.unchecked``, because the public op (or the
attention core) validated the call already. The
call records also give each query's visible key interval (:mod:`nsa_kernels.common.intervals`).
The selected branch's kernels validate in their own prologue (the Triton launch can skip the
index range check, a device sync), so :class:`SelectedBackend` hands its arguments on unchecked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from torch import Tensor

from nsa_core.blocks import cmp_cu_seqlens
from nsa_core.checks import check_compressed_attention, check_sliding_attention
from nsa_core.toggles import Toggles, get_toggles
from nsa_kernels.common.intervals import (
    compressed_intervals,
    compressed_intervals_varlen,
    sliding_intervals,
    sliding_intervals_varlen,
)
from nsa_kernels.common.row_runs import RowRuns


@dataclass(frozen=True)
class _WindowedCall:
    """What the sliding and compressed calls share: scale (resolved), q_start, cu_seqlens (int32
    [S+1] over tokens, B == 1, q_start == 0) or None, and the routing's toggles."""

    scale: float
    q_start: int
    cu_seqlens: torch.Tensor | None
    toggles: Toggles


@dataclass(frozen=True)
class SlidingCall(_WindowedCall):
    """The validated scalar arguments of one ``sliding_attention`` call (w = ``window``)."""

    window: int

    def intervals(self, tq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """lo, hi int64 [Tq]: query i sees keys [lo[i], hi[i]] (packed indices when varlen)."""
        if self.cu_seqlens is None:
            return sliding_intervals(tq, self.q_start, self.window, device)
        return sliding_intervals_varlen(self.cu_seqlens, self.window)


@dataclass(frozen=True)
class CompressedCall(_WindowedCall):
    """The validated scalar arguments of one ``compressed_attention`` call (l = ``cmp_block``,
    d = ``cmp_stride``; k_cmp is packed per ``nsa_core.blocks.cmp_cu_seqlens`` when varlen)."""

    cmp_block: int
    cmp_stride: int

    def intervals(self, tq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """lo, hi int64 [Tq]: query i sees compressed blocks [lo[i], hi[i]] (packed when varlen)."""
        block, stride = self.cmp_block, self.cmp_stride
        if self.cu_seqlens is None:
            return compressed_intervals(tq, self.q_start, block, stride, device)
        cmp_cu = cmp_cu_seqlens(self.cu_seqlens, block, stride)
        return compressed_intervals_varlen(self.cu_seqlens, cmp_cu, block, stride)


SlidingAttend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, SlidingCall], torch.Tensor]
# What a compressed backend's attend returns: o, or (o, lse) for a backend's ``fn_with_lse``,
# or (o as RowRuns, lse) for the fused core's runs of rows.
_Out = TypeVar(
    "_Out", torch.Tensor, tuple[torch.Tensor, torch.Tensor], tuple[RowRuns, torch.Tensor]
)


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return q.shape[3] ** -0.5 if scale is None else float(scale)


def _toggles(toggles: Toggles | None) -> Toggles:
    return get_toggles() if toggles is None else toggles


@dataclass(frozen=True)
class SlidingBackend:
    """A ``sliding_attention`` backend: the op's signature around ``attend``.

    ``attend(q, k, v, call)``: q [B, Tq, HQ, dk], k [B, Tk, H, dk], v [B, Tk, H, dv] ->
    o [B, Tq, HQ, dv], on arguments that passed ``check_sliding_attention``.
    """

    attend: SlidingAttend

    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, window: int, scale: float | None = None, *,
        q_start: int = 0, cu_seqlens: Tensor | None = None, toggles: Toggles | None = None,
    ) -> Tensor:  # fmt: skip
        """nsa_core ``sliding_attention``: query t sees keys [max(0, t - w + 1), t]."""
        check_sliding_attention(q, k, v, window, scale, q_start=q_start, cu_seqlens=cu_seqlens)
        return self.unchecked(
            q, k, v, window, scale, q_start=q_start, cu_seqlens=cu_seqlens, toggles=toggles
        )

    def unchecked(
        self, q: Tensor, k: Tensor, v: Tensor, window: int, scale: float | None = None, *,
        q_start: int = 0, cu_seqlens: Tensor | None = None, toggles: Toggles | None = None,
    ) -> Tensor:  # fmt: skip
        """The call on arguments nsa-core validated already: the registry's ``fn``."""
        call = SlidingCall(
            scale=_scale(q, scale), q_start=q_start, cu_seqlens=cu_seqlens,
            toggles=_toggles(toggles), window=window,
        )  # fmt: skip
        return self.attend(q, k, v, call)


@dataclass(frozen=True)
class CompressedBackend(Generic[_Out]):
    """A ``compressed_attention`` backend: the op's signature around ``attend``.

    ``attend(q, k_cmp, v_cmp, call)``: q [B, Tq, HQ, dk], k_cmp [B, N, H, dk],
    v_cmp [B, N, H, dv] -> o [B, Tq, HQ, dv] (zero for rows that see no block), on arguments that
    passed ``check_compressed_attention``; or (o, lse [B, Tq, HQ] float32), a backend's
    ``fn_with_lse``.
    """

    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, CompressedCall], _Out]

    def __call__(
        self, q: Tensor, k_cmp: Tensor, v_cmp: Tensor, cmp_block: int, cmp_stride: int,
        scale: float | None = None, *, q_start: int = 0, cu_seqlens: Tensor | None = None,
        toggles: Toggles | None = None,
    ) -> _Out:  # fmt: skip
        """nsa_core ``compressed_attention``: query t sees blocks i with i*d + l - 1 <= t."""
        check_compressed_attention(
            q, k_cmp, v_cmp, cmp_block, cmp_stride, scale, q_start=q_start, cu_seqlens=cu_seqlens
        )
        return self.unchecked(
            q, k_cmp, v_cmp, cmp_block, cmp_stride, scale, q_start=q_start,
            cu_seqlens=cu_seqlens, toggles=toggles,
        )  # fmt: skip

    def unchecked(
        self, q: Tensor, k_cmp: Tensor, v_cmp: Tensor, cmp_block: int, cmp_stride: int,
        scale: float | None = None, *, q_start: int = 0, cu_seqlens: Tensor | None = None,
        toggles: Toggles | None = None,
    ) -> _Out:  # fmt: skip
        """The call on arguments nsa-core validated already: the registry's ``fn``."""
        call = CompressedCall(
            scale=_scale(q, scale), q_start=q_start, cu_seqlens=cu_seqlens,
            toggles=_toggles(toggles), cmp_block=cmp_block, cmp_stride=cmp_stride,
        )  # fmt: skip
        return self.attend(q, k_cmp, v_cmp, call)


@dataclass(frozen=True)
class SelectedCall:
    """The scalar arguments of one ``selected_attention`` call, as given.

    sel_block: l'; scale: the softmax scale, None for dk ** -0.5 (the kernels resolve it as they
    validate); q_start, cu_seqlens (B == 1, q_start == 0, Tk == Tq) and toggles as in
    :class:`SlidingCall`; ``validated``: nsa-core validated the call, ``attend`` checks nothing.
    """

    sel_block: int
    scale: float | None
    q_start: int
    cu_seqlens: torch.Tensor | None
    toggles: Toggles
    validated: bool = False


SelectedAttend = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, SelectedCall], torch.Tensor
]


@dataclass(frozen=True)
class SelectedBackend:
    """A ``selected_attention`` backend: the op's signature around ``attend``.

    ``attend(q, k, v, block_indices, call)``: q [B, Tq, HQ, dk], k [B, Tk, H, dk],
    v [B, Tk, H, dv], block_indices [B, Tq, H, n] -> o [B, Tq, HQ, dv]; it validates them itself.
    """

    attend: SelectedAttend

    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, sel_block: int,
        scale: float | None = None, *,
        q_start: int = 0, cu_seqlens: Tensor | None = None, toggles: Toggles | None = None,
    ) -> Tensor:  # fmt: skip
        """nsa_core ``selected_attention``: each query over the tokens p <= t of its blocks."""
        call = SelectedCall(sel_block, scale, q_start, cu_seqlens, _toggles(toggles))
        return self.attend(q, k, v, block_indices, call)

    def unchecked(
        self, q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, sel_block: int,
        scale: float | None = None, *,
        q_start: int = 0, cu_seqlens: Tensor | None = None, toggles: Toggles | None = None,
    ) -> Tensor:  # fmt: skip
        """The call on arguments nsa-core validated already (the registry's ``fn``): ``attend``
        skips its own checks."""
        call = SelectedCall(
            sel_block, scale, q_start, cu_seqlens, _toggles(toggles), validated=True
        )
        return self.attend(q, k, v, block_indices, call)
