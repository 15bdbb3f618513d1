"""An :class:`~nsa_core.NSAAttention` layer's forward on a sequence sharded over a group."""

from __future__ import annotations

import torch
import torch.distributed as dist

from nsa_core.attention import NSAAttention, positions_of
from nsa_core.checks import check_cu_seqlens, check_process_group, shape
from nsa_core.context_parallel.attention import SelExchange, context_parallel_nsa_attention
from nsa_core.context_parallel.exchange import CommTimer
from nsa_core.context_parallel.plan import ShardPlan


def context_parallel_layer_forward(
    layer: NSAAttention,
    x: torch.Tensor,
    plan: ShardPlan,
    *,
    group: dist.ProcessGroup | None = None,
    cu_seqlens: torch.Tensor | None = None,
    sel_exchange: SelExchange = "all_gather",
    timer: CommTimer | None = None,
) -> torch.Tensor:
    """``layer(x)`` on a sequence sharded over ``group``: this rank's rows of the output.

    The projections, RoPE (at each row's global position, or its position in its sequence with
    varlen), the gates and the output projection are per token, so each rank applies them to its
    own rows; only the attention core exchanges data
    (:func:`~nsa_core.context_parallel.context_parallel_nsa_attention`).

    Args:
        layer: the layer, with the same parameters on every rank.
        x: [B, T_local, hidden], this rank's rows as ``plan`` cuts them.
        plan: how the T tokens are split (the same on every rank).
        group: the process group (default: the world).
        cu_seqlens: int32 [S+1] over the global packed tokens (B == 1), the same on every rank.
        sel_exchange, timer: as for the core.

    Returns:
        y [B, T_local, hidden]. Parameter gradients are this rank's share: sum them over the
        group (data-parallel training's all-reduce does).

    Arguments are checked as ``layer(x)`` and :func:`context_parallel_nsa_attention` check
    theirs, with the same errors (x by :meth:`NSAAttention.check_input`, the group by
    :func:`nsa_core.checks.check_process_group`).
    """
    if not isinstance(layer, NSAAttention):
        raise TypeError(f"layer must be an NSAAttention, got {type(layer).__name__}")
    if not isinstance(plan, ShardPlan):
        raise TypeError(f"plan must be a ShardPlan, got {type(plan).__name__}")
    layer.check_input(x)
    check_process_group(group)
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, plan.total_tokens, x.shape[0], x.device)
    rank = dist.get_rank(group)
    global_positions = positions_of(plan.total_tokens, cu_seqlens, x.device)
    positions = plan.shard(global_positions[None], rank)[0]  # [T_local]
    if positions.shape[0] != x.shape[1]:
        raise ValueError(
            f"x {shape(x)} must hold rank {rank}'s {positions.shape[0]} tokens of the plan"
        )
    inp = layer.branch_inputs(x, positions)
    o = context_parallel_nsa_attention(
        inp.q,
        inp.k,
        inp.v,
        inp.gates,
        layer.config,
        plan,
        group=group,
        phi_k=layer.phi_k,
        phi_v=layer.phi_v,
        cu_seqlens=cu_seqlens,
        sel_exchange=sel_exchange,
        timer=timer,
    )
    y: torch.Tensor = layer.o_proj(o.flatten(2))
    return y
