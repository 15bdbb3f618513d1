"""The attention core: every step of one NSA layer after compression, as one op.

``attention_core`` takes the rotated queries, the compressed keys and values, each branch's raw
keys and values and the gates, and returns the gated output (docs/spec.md). It is one registry
op (:mod:`nsa_core.registry`, ``attention_core``): a call is validated once and resolved once,
and the backend runs the steps as it sees fit.

The reference backend (:func:`attention_core_reference`) composes the step ops: the compressed
branch (handing its log-sum-exp to block scoring where its backend has one), block scoring and
top-n, the selected and sliding branches and the gated combine, each on the backend the registry
picks for it, on arguments this op has validated already. A fused backend (nsa-kernels) owns
every hand-off between steps that its kernels share.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from nsa_core.block_math import num_cmp_blocks
from nsa_core.checks import (
    check_attention_args,
    check_config,
    check_config_numbers,
    check_cu_seqlens,
    check_q_start,
    check_rank,
    check_same_place,
    per_head_context,
    shape,
)
from nsa_core.config import NSAConfig
from nsa_core.op_context import OpContext, op_context
from nsa_core.reference.common import validated_by
from nsa_core.registry import CORE_OP, hooked_fn, resolve, resolve_fn
from nsa_core.toggles import Toggles, get_toggles
from nsa_core.tracing import TraceConstant, compiling, nonstrict_region


def core_context(
    q: torch.Tensor,
    k_sel: torch.Tensor,
    v_sel: torch.Tensor,
    *inputs: torch.Tensor,
    q_start: int = 0,
    cu_seqlens: torch.Tensor | None = None,
) -> OpContext:
    """The routing context of one core call (no checks): q [B, Tq, HQ, dk], the selected
    branch's k [B, Tk, H, dk] and v [B, Tk, H, dv]; it needs a gradient where any of q, k_sel,
    v_sel or ``inputs`` needs one."""
    ctx = op_context(
        q, k_sel, v_sel, k_sel.shape[1], varlen=cu_seqlens is not None, q_start=q_start
    )
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    return dataclasses.replace(ctx, requires_grad=ctx.requires_grad or grad)


@dataclasses.dataclass(frozen=True)
class StepContexts:
    """The routing context of each step of one core call, as the step ops' own checks would
    give them (no checks here: the core call was validated)."""

    compressed: OpContext
    scoring: OpContext
    selected: OpContext
    sliding: OpContext
    combine: OpContext

    @classmethod
    def of(
        cls, q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_sel: Tensor, v_sel: Tensor,
        k_win: Tensor, v_win: Tensor, gates: Tensor, *, q_start: int, cu_seqlens: Tensor | None,
    ) -> StepContexts:  # fmt: skip
        varlen = cu_seqlens is not None
        start = 0 if varlen else q_start
        compressed = op_context(q, k_cmp, v_cmp, start + q.shape[1], varlen=varlen, q_start=start)
        scoring = dataclasses.replace(
            op_context(q, k_cmp, k_cmp, start + q.shape[1], varlen=varlen), requires_grad=False
        )
        selected = op_context(q, k_sel, v_sel, k_sel.shape[1], varlen=varlen)
        sliding = op_context(q, k_win, v_win, k_win.shape[1], varlen=varlen)
        # The combine's inputs do not exist yet: its context from their shape [B, T, HQ, dv].
        heads, dv = q.shape[2], v_sel.shape[3]
        grad = any(c.requires_grad for c in (compressed, selected, sliding)) or (
            torch.is_grad_enabled() and gates.requires_grad
        )
        combine = OpContext(
            device=q.device, dtype=q.dtype, seq_len=q.shape[1], num_q_heads=heads,
            num_kv_heads=heads, head_dim_qk=dv, head_dim_v=dv, requires_grad=grad, varlen=False,
        )  # fmt: skip
        return cls(compressed, scoring, selected, sliding, combine)

    @classmethod
    def of_context(cls, ctx: OpContext) -> StepContexts:
        """The steps' contexts of a core call described by ``ctx`` alone (for reports: the
        compressed keys and the window are taken to span the call's keys)."""
        hq, dv = ctx.num_q_heads, ctx.head_dim_v
        combine = dataclasses.replace(ctx, num_kv_heads=hq, head_dim_qk=dv, varlen=False, q_start=0)
        plain = dataclasses.replace(ctx, q_start=0)
        return cls(
            compressed=ctx,
            scoring=dataclasses.replace(plain, requires_grad=False),
            selected=plain,
            sliding=plain,
            combine=combine,
        )


def check_heads_and_gates(
    q: torch.Tensor,
    k_sel: torch.Tensor,
    v_sel: torch.Tensor,
    gates: torch.Tensor,
    config: NSAConfig,
) -> None:
    """q [B, T, HQ, dk] and the selected branch's k [B, *, H, dk], v [B, *, H, dv] have the
    config's heads and head dims; gates are [B, T, HQ, 3] beside q."""
    expected = (config.num_q_heads, config.num_kv_heads, config.head_dim_qk, config.head_dim_v)
    got = (q.shape[2], k_sel.shape[2], q.shape[3], v_sel.shape[3])
    if got != expected:
        raise ValueError(
            f"q {shape(q)} and k/v heads and head dims (HQ, H, dk, dv) = {got} differ from the "
            f"config's {expected}"
        )
    check_rank("gates", gates, 4, "[B, T, HQ, 3]")
    if tuple(gates.shape) != (*q.shape[:3], 3):
        raise ValueError(f"gates {shape(gates)} must be [B, T, HQ, 3] matching q {shape(q)}")
    check_same_place("gates", gates, "q", q)


def check_attention_core(
    q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_sel: Tensor, v_sel: Tensor, k_win: Tensor,
    v_win: Tensor, gates: Tensor, config: NSAConfig, *, q_start: int = 0,
    win_start: int | None = None, cu_seqlens: Tensor | None = None,
) -> OpContext:  # fmt: skip
    """Every rule of :func:`attention_core`; returns the call's routing context."""
    config = check_config(config)
    for branch, k, v in (("cmp", k_cmp, v_cmp), ("sel", k_sel, v_sel), ("win", k_win, v_win)):
        check_attention_args(q, k, v, k_name=f"k_{branch}", v_name=f"v_{branch}")
    check_heads_and_gates(q, k_sel, v_sel, gates, config)
    check_config_numbers(config, q.dtype)
    for name, value in (("q_start", q_start), ("win_start", win_start)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    tq = q.shape[1]
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, tq, q.shape[0], q.device)
        if q_start != 0 or win_start not in (None, 0):
            raise ValueError(f"varlen calls need q_start == 0, got {q_start} and {win_start}")
        for name, k in (("k_sel", k_sel), ("k_win", k_win)):
            if k.shape[1] != tq:
                raise ValueError(f"varlen {name} {shape(k)} must hold q's {tq} tokens")
        return core_context(
            q, k_sel, v_sel, k_cmp, v_cmp, k_win, v_win, gates, cu_seqlens=cu_seqlens
        )
    check_q_start(q_start, tq, k_sel.shape[1], "k_sel")
    check_q_start(q_start if win_start is None else win_start, tq, k_win.shape[1], "k_win")
    needed = num_cmp_blocks(q_start + tq, config.cmp_block, config.cmp_stride)
    if k_cmp.shape[1] < needed:
        raise ValueError(
            f"queries up to position {q_start + tq - 1} see {needed} compressed blocks, "
            f"but k_cmp holds {k_cmp.shape[1]}"
        )
    return core_context(q, k_sel, v_sel, k_cmp, v_cmp, k_win, v_win, gates, q_start=q_start)


def attention_core_reference(
    q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_sel: Tensor, v_sel: Tensor, k_win: Tensor,
    v_win: Tensor, gates: Tensor, config: NSAConfig, *, q_start: int = 0,
    win_start: int | None = None, cu_seqlens: Tensor | None = None, toggles: Toggles,
) -> Tensor:  # fmt: skip
    """The reference core: the step ops composed, each on the backend the registry picks.

    Arguments as :func:`attention_core`. Block scoring takes the compressed branch's
    log-sum-exp where that branch's backend yields one (its ``fn_with_lse``), detached.
    """
    steps = StepContexts.of(
        q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, q_start=q_start, cu_seqlens=cu_seqlens
    )
    cfg, scale = config, config.softmax_scale
    where = {"q_start": q_start, "cu_seqlens": cu_seqlens, "toggles": toggles}
    cmp_args = (q, k_cmp, v_cmp, cfg.cmp_block, cfg.cmp_stride, scale)
    compressed = resolve("compressed_attention", steps.compressed, toggles).backend
    lse = None
    if compressed.fn_with_lse is not None and not toggles.debug_hooks:
        o_cmp, lse = compressed.fn_with_lse(*cmp_args, **where)
        lse = None if lse is None else lse.detach()
    else:
        o_cmp = hooked_fn(compressed, toggles)(*cmp_args, **where)
    score: Callable[..., Any] = resolve_fn("select_blocks", steps.scoring, toggles)
    indices, _ = score(
        q, k_cmp, cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, cfg.num_selected, scale,
        lse=lse, **where,
    )  # fmt: skip
    o_sel = resolve_fn("selected_attention", steps.selected, toggles)(
        q, k_sel, v_sel, indices, cfg.sel_block, scale, **where
    )
    o_win = resolve_fn("sliding_attention", steps.sliding, toggles)(
        q, k_win, v_win, cfg.window, scale, toggles=toggles, cu_seqlens=cu_seqlens,
        q_start=q_start if win_start is None else win_start,
    )  # fmt: skip
    combine = resolve_fn(
        "gated_combine", per_head_context(o_cmp, o_cmp, o_sel, o_win, gates), toggles
    )
    out: torch.Tensor = combine(o_cmp, o_sel, o_win, gates, toggles=toggles)
    return out


@validated_by(check_attention_core)
def attention_core(
    q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_sel: Tensor, v_sel: Tensor, k_win: Tensor,
    v_win: Tensor, gates: Tensor, config: NSAConfig, *, q_start: int = 0,
    win_start: int | None = None, cu_seqlens: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """The NSA attention core after compression: block scoring and top-n, the three branches and
    the gated combine (docs/spec.md), validated once and run by the backend the registry picks.

    Args:
        q: [B, Tq, HQ, dk], rotated; row r sits at position ``q_start + r``.
        k_cmp, v_cmp: [B, N, H, dk] and [B, N, H, dv], the compressed keys and values (N_cmp of
            the queries' last position + 1 at least; packed per sequence when varlen).
        k_sel, v_sel: [B, Tk, H, dk] and [B, Tk, H, dv], every token from position 0.
        k_win, v_win: [B, Tw, H, dk] and [B, Tw, H, dv], tokens from position
            ``q_start - win_start`` on (``win_start`` None: from 0, as k_sel).
        gates: [B, Tq, HQ, 3] in (0, 1), ordered (cmp, sel, win).
        config: the NSA geometry (l, d, l', n, w, scale); its head counts must match q and k.
        cu_seqlens: int32 [S+1] for packed sequences (B == 1, q_start == 0, Tk == Tw == Tq).

    Returns:
        o [B, Tq, HQ, dv], in q's dtype also under ``torch.autocast``: the core computes in its
        inputs' dtype with the float32 steps docs/spec.md gives half precision.
    """
    toggles = get_toggles()
    ctx = core_context(
        q, k_sel, v_sel, k_cmp, v_cmp, k_win, v_win, gates, q_start=q_start, cu_seqlens=cu_seqlens
    )
    # Autocast would run the reference's float32 einsums in its lower precision: off here, the
    # inputs' dtype decides (docs/spec.md, "Decode", the compute dtype).
    with torch.autocast(q.device.type, enabled=False):
        out: torch.Tensor = resolve_fn(CORE_OP, ctx, toggles)(
            q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, config, q_start=q_start,
            win_start=win_start, cu_seqlens=cu_seqlens, toggles=toggles,
        )  # fmt: skip
    return out


def run_attention_core(
    q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_sel: Tensor, v_sel: Tensor, k_win: Tensor,
    v_win: Tensor, gates: Tensor, config: NSAConfig, *, q_start: int = 0,
    win_start: int | None = None, cu_seqlens: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """:func:`attention_core` on arguments its caller has validated: one resolution, no checks
    (nsa_attention, the layer and the context-parallel chunks validate the whole call first).

    Under torch.compile the call is a non-strict region (:mod:`nsa_core.tracing`): routing and
    the kernels' host planning run once, when the graph is traced.
    """
    if not compiling():
        return attention_core.body(
            q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, config, q_start=q_start,
            win_start=win_start, cu_seqlens=cu_seqlens,
        )  # fmt: skip
    # A region takes no None: win_start None means the window's keys start at 0, as q_start does.
    win = q_start if win_start is None else win_start
    tensors = (q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates)
    if cu_seqlens is None:
        return _core_region(*tensors, config.trace_constant, q_start, win)
    return _varlen_core_region(*tensors, cu_seqlens, config.trace_constant)


@nonstrict_region
def _core_region(
    q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_sel: Tensor, v_sel: Tensor, k_win: Tensor,
    v_win: Tensor, gates: Tensor, config: TraceConstant[NSAConfig], q_start: int, win_start: int,
) -> Tensor:  # fmt: skip
    out: Tensor = attention_core.body(
        q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, config.value, q_start=q_start,
        win_start=win_start,
    )  # fmt: skip
    return out


@nonstrict_region
def _varlen_core_region(
    q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_sel: Tensor, v_sel: Tensor, k_win: Tensor,
    v_win: Tensor, gates: Tensor, cu_seqlens: Tensor, config: TraceConstant[NSAConfig],
) -> Tensor:  # fmt: skip
    out: Tensor = attention_core.body(
        q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, config.value, cu_seqlens=cu_seqlens
    )
    return out
