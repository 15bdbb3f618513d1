"""The sliding branch on Triton: the compressed branch's kernels with l = d = 1 and a window.

With l = d = 1 a compressed block is one token, and the compressed branch's rule (block i is
visible at t iff ``i*d + l - 1 <= t``) becomes causality; the kernels' windowed mode adds the
lower bound ``max(0, t - w + 1)`` (docs/spec.md, "Sliding branch"). The sliding branch so shares
the compressed kernels' tiling (the G query heads of a group x a few tokens per tile, each K/V
tile loaded once for the group), their deterministic backward (no atomics) and their NaN
containment.
"""

from __future__ import annotations

from torch import Tensor

from nsa_core.checks import check_int, check_sliding_attention
from nsa_kernels.common.forward_outputs import forward_outputs
from nsa_kernels.common.interval_launch import IntervalLaunch
from nsa_kernels.common.local_softmax import LocalSoftmax, check_holds_local_keys
from nsa_kernels.common.tile_config import check_config
from nsa_kernels.common.triton_inputs import (
    check_dtype,
    check_head_dims,
    check_triton_runs,
    max_shared_bytes,
)
from nsa_kernels.compressed.config import CmpConfig, resolve_config
from nsa_kernels.compressed.function import attend_with_lse


def sliding_attention_triton(
    q: Tensor, k: Tensor, v: Tensor, window: int, scale: float | None = None, *,
    q_start: int = 0, cu_seqlens: Tensor | None = None, config: CmpConfig | None = None,
    validated: bool = False,
) -> Tensor:  # fmt: skip
    """Sliding-window attention (docs/spec.md) on Triton; the reference op's contract.

    Query row r sits at position ``t = q_start + r`` (varlen: positions restart at 0 in every
    sequence) and attends to the keys ``max(0, t - w + 1) .. t`` of its sequence.

    Args:
        q: [B, Tq, HQ, dk]; k: [B, Tk, H, dk]; v: [B, Tk, H, dv]; float16, bfloat16 or float32,
            HQ a multiple of H, dk and dv <= 256.
        window: w >= 1.
        scale: softmax scale, default dk ** -0.5.
        q_start: position of q[:, 0] (dense only; Tk >= q_start + Tq).
        cu_seqlens: int32 [S+1] for packed sequences (B == 1, q_start == 0).
        config: the compressed kernels' tiles (:class:`CmpConfig`; default their
            :func:`resolve_config`).
        validated: nsa-core validated the call already (the registry's ``fn``, the fused
            core); nothing is checked again.

    Returns:
        o [B, Tq, HQ, dv] in q's dtype, differentiable in q, k and v.
    """
    info, cfg = _prepare(
        q, k, v, window, scale, q_start, cu_seqlens, config, local_block=0, validated=validated
    )
    o, _ = attend_with_lse(q, k, v, info, cfg)
    return o


def sliding_attention_triton_with_local(
    q: Tensor, k: Tensor, v: Tensor, window: int, scale: float | None = None, *, sel_block: int,
    q_start: int = 0, cu_seqlens: Tensor | None = None, config: CmpConfig | None = None,
    validated: bool = False,
) -> tuple[Tensor, LocalSoftmax]:  # fmt: skip
    """:func:`sliding_attention_triton` and, from the same walk, each row's softmax over its
    forced blocks' keys, ``[0, l')`` and ``[max(t // l' - 1, 0) * l', t]``
    (:class:`LocalSoftmax`, l' = ``sel_block``), which the selected
    branch starts from where it shares k and v.

    Arguments as :func:`sliding_attention_triton`, and sel_block (keyword): l', with w >= 2 l'
    (or a window no shorter than the keys), so that the window holds the local keys.

    Returns:
        o [B, Tq, HQ, dv] (differentiable as :func:`sliding_attention_triton`'s) and the local
        softmax (no gradient).
    """
    if not validated:
        _check(q, k, v, window, scale, q_start, cu_seqlens, config)
        check_int("sel_block", sel_block, 1)
        check_holds_local_keys(window, sel_block, k.shape[1])
        check_triton_runs("q", q)
    info, cfg = _prepare(
        q, k, v, window, scale, q_start, cu_seqlens, config, local_block=sel_block,
        validated=True,
    )  # fmt: skip
    local = forward_outputs(q, info.batch, info.tq, info.hq, info.dv)
    o, _ = attend_with_lse(q, k, v, info, cfg, local)
    return o, LocalSoftmax(o=local[0], lse=local[1], sel_block=sel_block)


def _prepare(
    q: Tensor, k: Tensor, v: Tensor, window: int, scale: float | None, q_start: int,
    cu_seqlens: Tensor | None, config: CmpConfig | None, *, local_block: int, validated: bool,
) -> tuple[IntervalLaunch, CmpConfig]:  # fmt: skip
    """Validate like the reference op, then the kernels' limits (unless nsa-core ``validated``
    the call and its routing chose these kernels): a CmpConfig or None, a dtype and device
    Triton runs (not bfloat16 under ``TRITON_INTERPRET=1``), head dims up to 256; the launch
    facts and tiles."""
    if not validated:
        _check(q, k, v, window, scale, q_start, cu_seqlens, config)
        check_triton_runs("q", q)
    dk, dv = q.shape[3], v.shape[3]
    # One block per token (the packed keys are the packed tokens); a window as long as the keys
    # bounds nothing, so the plain causal kernels serve it.
    info = IntervalLaunch.of_call(
        q, k, v, scale, q_start, cu_seqlens, cmp_block=1, cmp_stride=1, cmp_cu=cu_seqlens,
        window=int(window) if window < k.shape[1] else 0, local_block=local_block,
    )  # fmt: skip
    shared = max_shared_bytes(q.device)
    cfg = resolve_config(config, dk, dv, q.dtype, windowed=info.windowed, shared_bytes=shared)
    return info, cfg


def _check(
    q: Tensor, k: Tensor, v: Tensor, window: int, scale: float | None, q_start: int,
    cu_seqlens: Tensor | None, config: CmpConfig | None,
) -> None:  # fmt: skip
    """The reference op's rules, then the kernels' own."""
    check_sliding_attention(q, k, v, window, scale, q_start=q_start, cu_seqlens=cu_seqlens)
    check_config(config, CmpConfig)
    check_dtype(q.dtype, "sliding attention")
    check_head_dims(q.shape[3], v.shape[3])


__all__ = ["sliding_attention_triton", "sliding_attention_triton_with_local"]
