"""The NSA attention core on a sequence sharded over the ranks of a process group.

Each rank holds the rows of its chunks (:class:`~nsa_core.context_parallel.plan.ShardPlan`) of
q, k, v and the gates and gets the same rows of the output as single-process
:func:`nsa_core.nsa_attention` on the whole sequence; gradients reach its own rows of q, k, v and
the gates (and its share of phi's parameters). Per call, in this order:

1. one exchange of raw tokens: the selected branch's K/V (an all-gather, or only the causal
   prefix each rank reads), the window halo (up to w - 1 tokens before each chunk) and the raw
   tokens of compressed blocks that straddle a chunk boundary (up to l - 1 tokens). When a
   branch shares the selected branch's K/V tensors its halos are read from that exchange;
2. each chunk compresses the blocks whose last token it holds, and one all-gather shares the
   compressed blocks (N_cmp(T) of them, T/d);
3. each chunk runs the attention core (:func:`nsa_core.core.run_attention_core`: block
   scoring, the three branches and their gated combine) with ``q_start`` = its offset in its
   sequence, so the backend the registry picks for the core serves all the local work.

docs/context_parallel.md gives the volumes per rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from nsa_core.attention import BRANCHES, check_nsa_attention
from nsa_core.checks import check_cu_seqlens, check_process_group, shape
from nsa_core.config import NSAConfig
from nsa_core.context_parallel.exchange import (
    AllGather,
    CommTimer,
    FetchRanges,
    Piece,
    PieceLayout,
    Transfer,
    anchor,
    exchange,
)
from nsa_core.context_parallel.plan import ShardPlan
from nsa_core.context_parallel.work import ChunkWork, Sequences, plan_work
from nsa_core.core import run_attention_core
from nsa_core.reference.compress import compress

SelExchange = Literal["all_gather", "prefix"]
SEL_EXCHANGES: tuple[SelExchange, ...] = ("all_gather", "prefix")


def token_layout(plan: ShardPlan) -> PieceLayout:
    """The plan's chunks as pieces of the token axis."""
    pieces = tuple(Piece(c.rank, c.local_start, c.start, c.length) for c in plan.chunks())
    return PieceLayout(plan.world_size, pieces)


def block_layout(works: tuple[ChunkWork, ...], world_size: int) -> PieceLayout:
    """The compressed blocks each chunk owns as pieces of the packed block axis.

    A rank's owned blocks sit in its local tensor chunk after chunk, in chunk order.
    """
    used = [0] * world_size
    pieces = []
    for work in works:
        b0, b1 = work.owned_blocks
        rank = work.chunk.rank
        pieces.append(Piece(rank, used[rank], b0, b1 - b0))
        used[rank] += b1 - b0
    return PieceLayout(world_size, tuple(pieces))


class _TokenSource:
    """Tokens [lo, hi) of one branch's K or V, from the exchange or from the local rows.

    ``window`` holds global tokens [window_start, ...) (the selected branch's exchange);
    ``halos[c]`` holds tokens [halo_start[c], chunk c's start) for the rank's c-th chunk.
    """

    def __init__(
        self,
        local: torch.Tensor,
        works: list[ChunkWork],
        *,
        window: torch.Tensor | None = None,
        window_start: int = 0,
        halos: list[torch.Tensor] | None = None,
        halo_starts: list[int] | None = None,
    ) -> None:
        self.local = local
        self.works = works
        self.window = window
        self.window_start = window_start
        self.halos = halos
        self.halo_starts = halo_starts

    def tokens(self, index: int, lo: int, hi: int) -> torch.Tensor:
        """[B, hi - lo, H, D]: tokens [lo, hi) for the rank's ``index``-th chunk (hi <= its end)."""
        if self.window is not None:
            return self.window.narrow(1, lo - self.window_start, hi - lo)
        chunk = self.works[index].chunk
        parts = []
        if lo < chunk.start:
            if self.halos is None or self.halo_starts is None:
                raise RuntimeError(f"tokens [{lo}, {chunk.start}) precede the chunk: no halo")
            start = self.halo_starts[index]
            parts.append(self.halos[index].narrow(1, lo - start, chunk.start - lo))
        first = max(lo, chunk.start)
        parts.append(self.local.narrow(1, chunk.local_start + first - chunk.start, hi - first))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _split_rows(x: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    return list(torch.split(x, lengths, dim=1))


def check_context_parallel(
    q: torch.Tensor,
    plan: object,
    group: dist.ProcessGroup | None,
    cu_seqlens: torch.Tensor | None,
    sel_exchange: object,
) -> int:
    """The rules :func:`context_parallel_nsa_attention` adds to those of
    :func:`~nsa_core.attention.check_nsa_attention` (checked first) -> this rank."""
    if not isinstance(plan, ShardPlan):
        raise TypeError(f"plan must be a ShardPlan, got {type(plan).__name__}")
    check_process_group(group)
    if sel_exchange not in SEL_EXCHANGES:
        raise ValueError(f"sel_exchange must be one of {SEL_EXCHANGES}, got {sel_exchange!r}")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world != plan.world_size:
        raise ValueError(f"plan is for {plan.world_size} ranks, the group has {world}")
    local = plan.local_tokens(rank)
    if q.shape[1] != local:
        raise ValueError(
            f"q {shape(q)} must hold rank {rank}'s {local} tokens of the plan "
            f"(T={plan.total_tokens}, W={world}, {plan.layout})"
        )
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, plan.total_tokens, q.shape[0], q.device)
    return rank


def context_parallel_nsa_attention(
    q: torch.Tensor,
    k: torch.Tensor | Mapping[str, torch.Tensor],
    v: torch.Tensor | Mapping[str, torch.Tensor],
    gates: torch.Tensor,
    config: NSAConfig,
    plan: ShardPlan,
    *,
    group: dist.ProcessGroup | None = None,
    phi_k: nn.Module | None = None,
    phi_v: nn.Module | None = None,
    cu_seqlens: torch.Tensor | None = None,
    sel_exchange: SelExchange = "all_gather",
    timer: CommTimer | None = None,
) -> torch.Tensor:
    """:func:`nsa_core.nsa_attention` on a sequence sharded over ``group`` as ``plan`` says.

    Every rank of the group calls it with its own rows and the same plan, config and
    cu_seqlens; the call runs collectives, so ranks call it (and its backward) in step.

    Args:
        q: [B, T_local, HQ, dk], rotated; T_local = ``plan.local_tokens(rank)``, the rank's
            chunks one after the other (``plan.shard`` cuts them from a global tensor).
        k, v: [B, T_local, H, dk] and [B, T_local, H, dv] shared by the three branches, or
            mappings ``{"cmp": ..., "sel": ..., "win": ...}`` of them.
        gates: [B, T_local, HQ, 3] in (0, 1), ordered (cmp, sel, win).
        config: the NSA geometry; its head counts must match q and k.
        plan: how the T tokens are split (the same on every rank).
        group: the process group (default: the world); NCCL on GPUs, gloo on CPU.
        phi_k, phi_v: learned compression (``CompressMLP``); None means the mean. Each rank
            applies phi to the blocks it owns, so its parameters get this rank's share of the
            gradient: sum them over the group (as data-parallel training does).
        cu_seqlens: int32 [S+1] over the GLOBAL packed tokens (B == 1), the same on every rank.
        sel_exchange: ``"all_gather"`` (every rank gets all T tokens of the selected branch's
            K/V) or ``"prefix"`` (point-to-point, each rank gets only the tokens before its last
            chunk's end).
        timer: records the seconds of each exchange, forward and backward.

    Returns:
        o [B, T_local, HQ, dv]: the rank's rows of the single-process output.
    """
    # cu_seqlens is over the global tokens, not q's: check_context_parallel checks it.
    ks, vs = check_nsa_attention(q, k, v, gates, config, phi_k, phi_v, None)
    rank = check_context_parallel(q, plan, group, cu_seqlens, sel_exchange)
    bounds = [0, plan.total_tokens] if cu_seqlens is None else cu_seqlens.tolist()
    seqs = Sequences.build([int(b) for b in bounds], config, varlen=cu_seqlens is not None)
    works = plan_work(plan, seqs, config)
    link, sources = _exchange_raw_tokens(
        ks, vs, works, plan, rank, sel_exchange, q.new_zeros(()), group, timer
    )
    link, k_cmp, v_cmp = _compress_and_share(
        sources["cmp"], works, plan, rank, config, phi_k, phi_v, link, group, timer
    )
    mine = [w for w in works if w.chunk.rank == rank]
    out_parts = []
    for index, work in enumerate(mine):
        chunk = work.chunk
        for seg in work.segments:
            rows = (chunk.local_start + seg.start - chunk.start, seg.end - seg.start)
            varlen_cu = (
                None
                if seg.varlen_bounds is None
                else torch.tensor(seg.varlen_bounds, dtype=torch.int32, device=q.device)
            )
            cmp_rows = (seg.cmp_start, seg.cmp_end - seg.cmp_start)
            (sel_k, sel_v), (win_k, win_v) = sources["sel"], sources["win"]
            o = run_attention_core(
                q.narrow(1, *rows),
                k_cmp.narrow(1, *cmp_rows),
                v_cmp.narrow(1, *cmp_rows),
                sel_k.tokens(index, seg.seq_start, seg.end),
                sel_v.tokens(index, seg.seq_start, seg.end),
                win_k.tokens(index, seg.win_start, seg.end),
                win_v.tokens(index, seg.win_start, seg.end),
                gates.narrow(1, *rows),
                config,
                q_start=0 if varlen_cu is not None else seg.start - seg.seq_start,
                win_start=None if varlen_cu is not None else seg.start - seg.win_start,
                cu_seqlens=varlen_cu,
            )
            out_parts.append(o)
    return anchor(torch.cat(out_parts, dim=1), link)


Sources = dict[str, tuple[_TokenSource, _TokenSource]]


def _exchange_raw_tokens(
    ks: dict[str, torch.Tensor],
    vs: dict[str, torch.Tensor],
    works: tuple[ChunkWork, ...],
    plan: ShardPlan,
    rank: int,
    sel_exchange: SelExchange,
    link: torch.Tensor,
    group: dist.ProcessGroup | None,
    timer: CommTimer | None,
) -> tuple[torch.Tensor, Sources]:
    """Stage 1, one exchange: the selected branch's K/V, the window and compressed halos.

    Returns the link and, per branch, the (K, V) token sources its local work reads. A branch
    whose K and V are the selected branch's tensors reads them from the selected exchange.
    """
    tokens = token_layout(plan)
    per_rank = [[w for w in works if w.chunk.rank == r] for r in range(plan.world_size)]
    mine = per_rank[rank]
    shared = {b: ks[b] is ks["sel"] and vs[b] is vs["sel"] for b in ("win", "cmp")}

    def first_read(rank_works: list[ChunkWork]) -> int:
        starts = [w.sel_start for w in rank_works]
        starts += [w.win_halo_start for w in rank_works if shared["win"]]
        starts += [w.cmp_raw_start for w in rank_works if shared["cmp"]]
        return min(starts)

    transfers: list[Transfer] = []
    if sel_exchange == "all_gather":
        window_start = 0
        transfers += [AllGather("sel_k", tokens), AllGather("sel_v", tokens)]
    else:
        prefix = tuple(((first_read(ws), ws[-1].chunk.end),) for ws in per_rank)
        window_start = prefix[rank][0][0]
        transfers += [FetchRanges("sel_k", tokens, prefix), FetchRanges("sel_v", tokens, prefix)]
    inputs = [ks["sel"], vs["sel"]]
    halo_requests = {
        "win": tuple(tuple((w.win_halo_start, w.chunk.start) for w in ws) for ws in per_rank),
        "cmp": tuple(
            tuple((min(w.cmp_raw_start, w.chunk.start), w.chunk.start) for w in ws)
            for ws in per_rank
        ),
    }
    halo_branches = [b for b in ("win", "cmp") if not shared[b]]
    for b in halo_branches:
        transfers += [
            FetchRanges(f"{b}_halo_k", tokens, halo_requests[b]),
            FetchRanges(f"{b}_halo_v", tokens, halo_requests[b]),
        ]
        inputs += [ks[b], vs[b]]
    link, outs = exchange(transfers, inputs, link, group=group, timer=timer)

    sel = (
        _TokenSource(ks["sel"], mine, window=outs[0], window_start=window_start),
        _TokenSource(vs["sel"], mine, window=outs[1], window_start=window_start),
    )
    sources: Sources = {"sel": sel, "win": sel, "cmp": sel}
    for i, b in enumerate(halo_branches):
        requests = halo_requests[b][rank]
        lengths = [end - start for start, end in requests]
        starts = [start for start, _ in requests]
        halo_k, halo_v = (_split_rows(outs[2 + 2 * i + j], lengths) for j in (0, 1))
        sources[b] = (
            _TokenSource(ks[b], mine, halos=halo_k, halo_starts=starts),
            _TokenSource(vs[b], mine, halos=halo_v, halo_starts=starts),
        )
    return link, sources


def _compress_and_share(
    raw: tuple[_TokenSource, _TokenSource],
    works: tuple[ChunkWork, ...],
    plan: ShardPlan,
    rank: int,
    config: NSAConfig,
    phi_k: nn.Module | None,
    phi_v: nn.Module | None,
    link: torch.Tensor,
    group: dist.ProcessGroup | None,
    timer: CommTimer | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 2: phi over the blocks each chunk owns, then one all-gather of every block.

    Returns the link, k_cmp [B, N, H, dk] and v_cmp [B, N, H, dv], N = every packed block.
    """
    mine = [w for w in works if w.chunk.rank == rank]
    owned: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    for index, work in enumerate(mine):
        raw_cu = None
        if work.cmp_raw_bounds is not None:
            raw_cu = torch.tensor(work.cmp_raw_bounds, dtype=torch.int32, device=link.device)
        for source, phi, blocks in zip(raw, (phi_k, phi_v), owned, strict=True):
            x = source.tokens(index, work.cmp_raw_start, work.chunk.end)
            compressed = compress(x, config.cmp_block, config.cmp_stride, phi, cu_seqlens=raw_cu)
            b0, b1 = work.owned_blocks
            if compressed.shape[1] != b1 - b0:
                raise RuntimeError(
                    f"chunk {work.chunk.index} compressed {compressed.shape[1]} blocks, "
                    f"owns {b1 - b0}: the ownership arithmetic is wrong"
                )
            blocks.append(compressed)
    layout = block_layout(works, plan.world_size)
    link, (k_cmp, v_cmp) = exchange(
        [AllGather("cmp_blocks_k", layout), AllGather("cmp_blocks_v", layout)],
        [torch.cat(owned[0], dim=1), torch.cat(owned[1], dim=1)],
        link,
        group=group,
        timer=timer,
    )
    return link, k_cmp, v_cmp


__all__ = [
    "BRANCHES",
    "SEL_EXCHANGES",
    "SelExchange",
    "block_layout",
    "context_parallel_nsa_attention",
    "token_layout",
]
