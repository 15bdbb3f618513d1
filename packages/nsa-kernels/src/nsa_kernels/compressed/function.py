"""Compressed attention on Triton: the public entry points and the autograd Function.

The pieces: :mod:`~nsa_kernels.compressed.config` (tiles and launch parameters),
:mod:`~nsa_kernels.common.interval_launch` (the facts of a call),
:mod:`~nsa_kernels.compressed.tiles` (tile tables), :mod:`~nsa_kernels.compressed.launch` (the
launches) and the kernels, :mod:`~nsa_kernels.compressed.triton_fwd` and
:mod:`~nsa_kernels.compressed.triton_bwd` on :mod:`~nsa_kernels.compressed.triton_tiles`.

:func:`compressed_attention_triton` has the reference op's signature and semantics
(docs/spec.md, "Compressed branch"): query t sees compressed block i iff ``i*d + l - 1 <= t``,
softmax over the visible blocks, rows that see none give 0 and no gradient.
:func:`compressed_attention_triton_with_lse` also returns the log-sum-exp the block-scoring
kernel takes to skip its own normaliser pass. The sliding branch runs the same kernels through
:func:`attend_with_lse` (nsa_kernels.sliding.triton_function).

Requirements beyond the reference: CUDA tensors (or CPU under ``TRITON_INTERPRET=1``), dtype
float16, bfloat16 or float32 (not bfloat16 under the interpreter, whose bfloat16 ``tl.dot`` is
wrong), dk and dv <= 256 (tiles are padded to powers of two and masked).
float32 runs every ``tl.dot`` with ``input_precision="ieee"`` (no TF32) to meet the float32 bound
of docs/spec.md; float16/bfloat16 multiply on tensor cores with float32 accumulation.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, ParamSpec

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from nsa_core.blocks import cmp_cu_seqlens, num_cmp_blocks
from nsa_core.checks import check_compressed_attention
from nsa_kernels.common.entry_checks import check_backward_args
from nsa_kernels.common.finite_flag import all_finite_flag
from nsa_kernels.common.interval_launch import IntervalLaunch
from nsa_kernels.common.tile_config import check_config
from nsa_kernels.common.triton_inputs import (
    check_dtype,
    check_head_dims,
    check_triton_runs,
    max_shared_bytes,
)
from nsa_kernels.compressed.config import CmpConfig, parse_config, resolve_config
from nsa_kernels.compressed.launch import backward, forward

_P = ParamSpec("_P")
# The local softmax's buffers (o_loc, lse_loc) the sliding forward writes (launch.forward's local).
LocalBuffers = tuple[Tensor, Tensor]


class CompressedAttentionFunction(torch.autograd.Function):
    """(o, lse) of the interval kernels for the launch facts ``info`` (either branch that runs
    them: compressed, or sliding with l = d = 1 and a window); o is differentiable in q and the
    keys and values, lse is not."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, info: IntervalLaunch, cfg: CmpConfig,
        local: LocalBuffers | None = None,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        o, lse = forward(q, k, v, info, cfg, local=local)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.info = info
        ctx.cfg = cfg
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, do: Tensor, _dlse: Tensor | None) -> tuple[Tensor | None, ...]:
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = backward(do, q, k, v, o, lse, ctx.info, ctx.cfg)
        return dq, dk, dv, None, None, None


def attend_with_lse(
    q: Tensor, k: Tensor, v: Tensor, info: IntervalLaunch, cfg: CmpConfig,
    local: LocalBuffers | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(o, lse) through :class:`CompressedAttentionFunction` where a gradient is wanted, else
    the forward kernel alone. q [B, Tq, HQ, dk], k [B, N, H, dk], v [B, N, H, dv]; ``local``
    as :func:`nsa_kernels.compressed.launch.forward` takes it (written, no gradient)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        o, lse = CompressedAttentionFunction.apply(q, k, v, info, cfg, local)  # type: ignore[no-untyped-call]
        assert isinstance(o, Tensor)
        assert isinstance(lse, Tensor)
        return o, lse
    return forward(q.contiguous(), k.contiguous(), v.contiguous(), info, cfg, local=local)


def _prepare(
    q: Tensor, k_cmp: Tensor, v_cmp: Tensor, cmp_block: int, cmp_stride: int,
    scale: float | None, q_start: int, cu_seqlens: Tensor | None, config: CmpConfig | None,
    validated: bool,
) -> tuple[IntervalLaunch, CmpConfig]:  # fmt: skip
    """Validate like the reference op, then the kernels' own limits (unless nsa-core
    ``validated`` the call and its routing chose these kernels): a CmpConfig or None, a dtype
    and device Triton runs (not bfloat16 under ``TRITON_INTERPRET=1``), head dims up to 256;
    collect the launch facts and fill the zeros of ``config`` for them
    (:func:`resolve_config`)."""
    if not validated:
        _check(q, k_cmp, v_cmp, cmp_block, cmp_stride, scale, q_start, cu_seqlens, config)
        check_triton_runs("q", q)
    dk, dv = q.shape[3], v_cmp.shape[3]
    cmp_cu = None
    if cu_seqlens is not None:
        cmp_cu = cmp_cu_seqlens(cu_seqlens, cmp_block, cmp_stride).to(torch.int32)
    info = IntervalLaunch.of_call(
        q, k_cmp, v_cmp, scale, q_start, cu_seqlens,
        cmp_block=cmp_block, cmp_stride=cmp_stride, cmp_cu=cmp_cu,
    )  # fmt: skip
    return info, resolve_config(config, dk, dv, q.dtype, shared_bytes=max_shared_bytes(q.device))


def _check(
    q: Tensor, k_cmp: Tensor, v_cmp: Tensor, cmp_block: int, cmp_stride: int,
    scale: float | None, q_start: int, cu_seqlens: Tensor | None, config: CmpConfig | None,
) -> None:  # fmt: skip
    """The rules of a call's own arguments: the reference op's, then the kernels' (but whether
    Triton runs here, ``check_triton_runs``, which a caller checks after its other arguments)."""
    check_compressed_attention(
        q, k_cmp, v_cmp, cmp_block, cmp_stride, scale, q_start=q_start, cu_seqlens=cu_seqlens
    )
    check_config(config, CmpConfig)
    check_dtype(q.dtype, "compressed attention")
    check_head_dims(q.shape[3], v_cmp.shape[3])


def compressed_attention_triton_with_lse(
    q: Tensor, k_cmp: Tensor, v_cmp: Tensor, cmp_block: int, cmp_stride: int,
    scale: float | None = None, *, q_start: int = 0, cu_seqlens: Tensor | None = None,
    config: CmpConfig | None = None, validated: bool = False,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Compressed attention (docs/spec.md) on Triton and its log-sum-exp; the reference op's
    contract.

    Query row r sits at position ``t = q_start + r`` (varlen: positions restart at 0 in every
    sequence); head h (kv head ``h // G``) attends in one softmax to the compressed blocks i with
    ``i*d + l - 1 <= t``. A row that sees no block gives 0 and passes no gradient.

    Args:
        q: [B, Tq, HQ, dk]; k_cmp: [B, N, H, dk]; v_cmp: [B, N, H, dv]; float16, bfloat16 or
            float32, HQ a multiple of H, dk and dv <= 256.
        cmp_block, cmp_stride: l and d (d divides l).
        scale: softmax scale, default dk ** -0.5.
        q_start: position of q[:, 0] (dense only).
        cu_seqlens: int32 [S+1] over tokens for packed sequences (B == 1, q_start == 0); k_cmp
            and v_cmp packed per sequence as ``nsa_core.blocks.cmp_cu_seqlens`` says.
        config: tiles and launch parameters (default: :func:`resolve_config`).
        validated: nsa-core validated the call already (the registry's ``fn``); nothing is
            checked again.

    Returns:
        o [B, Tq, HQ, dv] in q's dtype (differentiable in q, k_cmp, v_cmp) and lse [B, Tq, HQ]
        float32: ``log sum_i exp(scale * q . k_cmp[i])`` over the visible blocks, -inf for rows
        that see none (no gradient flows through lse).
    """
    info, cfg = _prepare(
        q, k_cmp, v_cmp, cmp_block, cmp_stride, scale, q_start, cu_seqlens, config, validated
    )
    return attend_with_lse(q, k_cmp, v_cmp, info, cfg)


def _output_only(
    with_lse: Callable[_P, tuple[Tensor, Tensor]], name: str, doc: str
) -> Callable[_P, Tensor]:
    """``with_lse`` without its log-sum-exp: the same arguments, o alone."""

    def attend(*args: _P.args, **kwargs: _P.kwargs) -> Tensor:
        return with_lse(*args, **kwargs)[0]

    attend.__name__ = attend.__qualname__ = name
    attend.__doc__ = doc
    # help() and inspect show the arguments of with_lse, and o alone as the result.
    signature = inspect.signature(with_lse).replace(return_annotation="Tensor")
    attend.__signature__ = signature  # type: ignore[attr-defined]
    return attend


compressed_attention_triton = _output_only(
    compressed_attention_triton_with_lse,
    "compressed_attention_triton",
    """Compressed attention (docs/spec.md) on Triton; the reference op's contract.

    Arguments as :func:`compressed_attention_triton_with_lse`, whose o it returns:
    o [B, Tq, HQ, dv] in q's dtype, differentiable in q, k_cmp and v_cmp.
    """,
)


def compressed_attention_fwd(
    q: Tensor, k_cmp: Tensor, v_cmp: Tensor, cmp_block: int, cmp_stride: int,
    scale: float | None = None, *, q_start: int = 0, cu_seqlens: Tensor | None = None,
    config: CmpConfig | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Forward only: o [B, Tq, HQ, dv] in q's dtype, lse [B, Tq, HQ] float32 (natural log).

    Arguments as :func:`compressed_attention_triton_with_lse`; lse is -inf on rows that see no
    block.
    """
    info, cfg = _prepare(
        q, k_cmp, v_cmp, cmp_block, cmp_stride, scale, q_start, cu_seqlens, config, False
    )
    return forward(q.contiguous(), k_cmp.contiguous(), v_cmp.contiguous(), info, cfg)


def compressed_attention_bwd(
    do: Tensor, q: Tensor, k_cmp: Tensor, v_cmp: Tensor, o: Tensor, lse: Tensor,
    cmp_block: int, cmp_stride: int, scale: float | None = None, *, q_start: int = 0,
    cu_seqlens: Tensor | None = None, config: CmpConfig | None = None, validated: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """dq, dk_cmp, dv_cmp for the upstream gradient ``do [B, Tq, HQ, dv]`` (o [B, Tq, HQ, dv]
    and lse [B, Tq, HQ] float32 from :func:`compressed_attention_fwd` of the same arguments);
    ``validated``: the forward's arguments were validated already, nothing is checked again."""
    if not validated:
        _check(q, k_cmp, v_cmp, cmp_block, cmp_stride, scale, q_start, cu_seqlens, config)
        check_backward_args(do, o, lse, q, v_cmp)
        check_triton_runs("q", q)
    info, cfg = _prepare(
        q, k_cmp, v_cmp, cmp_block, cmp_stride, scale, q_start, cu_seqlens, config, True
    )
    k_cmp, v_cmp = k_cmp.contiguous(), v_cmp.contiguous()
    return backward(do, q.contiguous(), k_cmp, v_cmp, o, lse.contiguous(), info, cfg)


def contain_non_finite_into(
    o: Tensor, lse: Tensor, q: Tensor, k_cmp: Tensor, v_cmp: Tensor, cmp_block: int,
    cmp_stride: int, scale: float | None = None, *, q_start: int = 0,
    finite: Tensor | None = None, validated: bool = False,
) -> None:  # fmt: skip
    """Where k_cmp or v_cmp holds a non-finite value, overwrite o [B, Tq, HQ, dv] and lse
    [B, Tq, HQ] (float32) with this forward, which keeps such a value to the rows that see its
    block (docs/spec.md, "Non-finite values"); else leave them as they are.

    Decided on the device (one launch whose programs return at once when every value is
    finite), so a caller that computed o and lse with another kernel needs no host sync to
    honour the rule. Dense inputs; arguments as :func:`compressed_attention_triton_with_lse`.
    ``finite``: :func:`all_finite_flag` of k_cmp and v_cmp, where the caller has it (several
    calls over parts of one output), else computed here. ``validated``: the caller's arguments
    were validated already (the cuDNN route); nothing is checked again.
    """
    info, cfg = _prepare(
        q, k_cmp, v_cmp, cmp_block, cmp_stride, scale, q_start, None, None, validated
    )
    k_cmp, v_cmp = k_cmp.contiguous(), v_cmp.contiguous()
    flag = all_finite_flag(k_cmp, v_cmp) if finite is None else finite
    forward(q.contiguous(), k_cmp, v_cmp, info, cfg, into=(o, lse), unless_finite=flag)


def attention_flops(
    batch: int, tq: int, hq: int, dk: int, dv: int, cmp_block: int, cmp_stride: int,
    q_start: int = 0,
) -> int:  # fmt: skip
    """Matmul FLOPs of the forward: 2 * B * HQ * (dk + dv) * sum over rows of N_cmp(t + 1)."""
    visible = sum(
        num_cmp_blocks(t + 1, cmp_block, cmp_stride) for t in range(q_start, q_start + tq)
    )
    return 2 * batch * hq * (dk + dv) * visible


__all__ = [
    "CmpConfig",
    "CompressedAttentionFunction",
    "attend_with_lse",
    "attention_flops",
    "compressed_attention_bwd",
    "compressed_attention_fwd",
    "compressed_attention_triton",
    "compressed_attention_triton_with_lse",
    "contain_non_finite_into",
    "parse_config",
    "resolve_config",
]
