"""The fused attention core: the steps after compression in order, with the plan's hand-offs.

Arguments arrive validated by nsa-core (:func:`nsa_core.core.check_attention_core` or
:func:`nsa_core.attention.check_nsa_attention`): nothing here checks them again.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from nsa_core.config import NSAConfig
from nsa_core.core import StepContexts
from nsa_core.op_context import OpContext
from nsa_core.toggles import Toggles
from nsa_kernels.common.local_softmax import LocalSoftmax, holds_local_keys
from nsa_kernels.common.row_runs import RowRuns, as_tensor
from nsa_kernels.core.fan_out import Sum3, fan_out
from nsa_kernels.core.plan import CorePlan


class FusedCore:
    """The registered ``fn`` of the fused ``attention_core`` backend (nsa-core's core signature)
    and its routing report (:class:`nsa_core.registry.StepsReport`)."""

    def steps(self, ctx: OpContext, toggles: Toggles) -> list[str]:
        """Which kernel runs each step for a call described by ``ctx``, and the hand-offs."""
        return CorePlan.make(StepContexts.of_context(ctx), toggles).describe()

    def __call__(
        self, q: Tensor, k_cmp: Tensor, v_cmp: Tensor, k_sel: Tensor, v_sel: Tensor,
        k_win: Tensor, v_win: Tensor, gates: Tensor, config: NSAConfig, *, q_start: int = 0,
        win_start: int | None = None, cu_seqlens: Tensor | None = None, toggles: Toggles,
    ) -> Tensor:  # fmt: skip
        """o [B, Tq, HQ, dv]: nsa-core's ``attention_core`` (shapes there)."""
        steps = StepContexts.of(
            q, k_cmp, v_cmp, k_sel, v_sel, k_win, v_win, gates, q_start=q_start,
            cu_seqlens=cu_seqlens,
        )  # fmt: skip
        plan = CorePlan.make(steps, toggles)
        cfg, scale = config, config.softmax_scale
        where: dict[str, Any] = {"q_start": q_start, "cu_seqlens": cu_seqlens, "toggles": toggles}
        q_cmp, q_sel, q_win = fan_out(q, _sum3() if plan.grad_sum else None)

        cmp_args = (q_cmp, k_cmp, v_cmp, cfg.cmp_block, cfg.cmp_stride, scale)
        o_cmp: Tensor | RowRuns
        lse: Tensor | None = None
        if plan.runs:
            from nsa_kernels.compressed.cudnn import compressed_attention_cudnn_runs_with_lse

            o_cmp, lse = compressed_attention_cudnn_runs_with_lse.unchecked(*cmp_args, **where)
        elif plan.compressed.fn_with_lse is not None:
            o_cmp, lse = plan.compressed.fn_with_lse(*cmp_args, **where)
        else:
            o_cmp = plan.compressed.fn(*cmp_args, **where)
        lse = None if lse is None else lse.detach()
        indices, _ = plan.scoring.fn(
            q_cmp, k_cmp, cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, cfg.num_selected, scale,
            lse=lse, **where,
        )  # fmt: skip

        shared = k_sel is k_win and v_sel is v_win and win_start in (None, q_start)
        local: LocalSoftmax | None = None
        if plan.local and shared and holds_local_keys(cfg.window, cfg.sel_block, k_win.shape[1]):
            from nsa_kernels.sliding.triton_function import sliding_attention_triton_with_local

            o_win, local = sliding_attention_triton_with_local(
                q_win, k_win, v_win, cfg.window, scale, sel_block=cfg.sel_block, q_start=q_start,
                cu_seqlens=cu_seqlens, validated=True,
            )  # fmt: skip
        else:
            o_win = plan.sliding.fn(
                q_win, k_win, v_win, cfg.window, scale, cu_seqlens=cu_seqlens, toggles=toggles,
                q_start=q_start if win_start is None else win_start,
            )  # fmt: skip

        if plan.gated:
            from nsa_kernels.selected.backend import selected_attention_gated

            return selected_attention_gated(
                q_sel, k_sel, v_sel, indices, cfg.sel_block, scale, o_cmp=o_cmp, o_win=o_win,
                gates=gates, local=local, **where,
            )  # fmt: skip
        o_sel = plan.selected.fn(q_sel, k_sel, v_sel, indices, cfg.sel_block, scale, **where)
        out: Tensor = plan.combine.fn(as_tensor(o_cmp), o_sel, o_win, gates, toggles=toggles)
        return out


def _sum3() -> Sum3:
    """The Triton combine's three-way sum (its kernels, not its registry row: a hand-off)."""
    from nsa_kernels.combine.function import sum3_triton

    return sum3_triton
