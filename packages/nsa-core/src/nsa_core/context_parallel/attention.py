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
3. each chunk runs nsa_core's public ops (:func:`nsa_core.attention.branch_outputs`, then
   :func:`nsa_core.ops.gated_combine`) with ``q_start`` = its offset in its sequence, so the
   backends the registry picks serve all the local work.

docs/context_parallel.md gives the volumes per rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from nsa_core import ops
from nsa_core.attention import BRANCHES, branch_outputs, check_nsa_attention
from nsa_core.checks import check_cu_seqlens, shape
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
from nsa_core.reference.compress import compress

SlcExchange = Literal["all_gather", "prefix"]
SLC_EXCHANGES: tuple[SlcExchange, ...] = ("all_gather", "prefix")


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
    k: torch.Tensor | Mapping[str, torch.Tensor],
    v: torch.Tensor | Mapping[str, torch.Tensor],
    gates: torch.Tensor,
    config: NSAConfig,
    plan: object,
    group: dist.ProcessGroup | None,
    phi_k: nn.Module | None,
    phi_v: nn.Module | None,
    cu_seqlens: torch.Tensor | None,
    slc_exchange: object,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
    """Every rule of :func:`context_parallel_nsa_attention` -> per-branch k, v and the rank."""
    ks, vs = check_nsa_attention(q, k, v, gates, config, phi_k, phi_v, None)
    if not isinstance(plan, ShardPlan):
        raise TypeError(f"plan must be a ShardPlan, got {type(plan).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context parallel attention needs an initialized torch.distributed")
    if slc_exchange not in SLC_EXCHANGES:
        raise ValueError(f"slc_exchange must be one of {SLC_EXCHANGES}, got {slc_exchange!r}")
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
    return ks, vs, rank


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
    slc_exchange: SlcExchange = "all_gather",
    timer: CommTimer | None = None,
) -> torch.Tensor:
    """:func:`nsa_core.nsa_attention` on a sequence sharded over ``group`` as ``plan`` says.

    Every rank of the group calls it with its own rows and the same plan, config and
    cu_seqlens; the call runs collectives, so ranks call it (and its backward) in step.

    Args:
        q: [B, T_local, HQ, dk], rotated; T_local = ``plan.local_tokens(rank)``, the rank's
            chunks one after the other (``plan.shard`` cuts them from a global tensor).
        k, v: [B, T_local, H, dk] and [B, T_local, H, dv] shared by the three branches, or
            mappings ``{"cmp": ..., "slc": ..., "win": ...}`` of them.
        gates: [B, T_local, HQ, 3] in (0, 1), ordered (cmp, slc, win).
        config: the NSA geometry; its head counts must match q and k.
        plan: how the T tokens are split (the same on every rank).
        group: the process group (default: the world); NCCL on GPUs, gloo on CPU.
        phi_k, phi_v: learned compression (``CompressMLP``); None means the mean. Each rank
            applies phi to the blocks it owns, so its parameters get this rank's share of the
            gradient: sum them over the group (as data-parallel training does).
        cu_seqlens: int32 [S+1] over the GLOBAL packed tokens (B == 1), the same on every rank.
        slc_exchange: ``"all_gather"`` (every rank gets all T tokens of the selected branch's
            K/V) or ``"prefix"`` (point-to-point, each rank gets only the tokens before its last
            chunk's end).
        timer: records the seconds of each exchange, forward and backward.

    Returns:
        o [B, T_local, HQ, dv]: the rank's rows of the single-process output.
    """
    ks, vs, rank = check_context_parallel(
        q, k, v, gates, config, plan, group, phi_k, phi_v, cu_seqlens, slc_exchange
    )
    total = plan.total_tokens
    bounds = [0, total] if cu_seqlens is None else [int(b) for b in cu_seqlens.tolist()]
    seqs = Sequences.build(bounds, config, varlen=cu_seqlens is not None)
    works = plan_work(plan, seqs, config)
    mine = [w for w in works if w.chunk.rank == rank]
    tokens = token_layout(plan)
    world = plan.world_size

    shared_win = ks["win"] is ks["slc"] and vs["win"] is vs["slc"]
    shared_cmp = ks["cmp"] is ks["slc"] and vs["cmp"] is vs["slc"]

    # ---- stage 1: raw tokens (selected branch, window halo, straddling compressed blocks)
    def reads_from(rank_works: list[ChunkWork]) -> int:
        starts = [w.slc_start for w in rank_works]
        if shared_win:
            starts += [w.win_halo_start for w in rank_works]
        if shared_cmp:
            starts += [w.cmp_raw_start for w in rank_works]
        return min(starts)

    per_rank = [[w for w in works if w.chunk.rank == r] for r in range(world)]
    transfers: list[Transfer] = []
    inputs: list[torch.Tensor] = []
    if slc_exchange == "all_gather":
        window_start = 0
        for name, x in (("slc_k", ks["slc"]), ("slc_v", vs["slc"])):
            transfers.append(AllGather(name, tokens))
            inputs.append(x)
    else:
        prefix = tuple(((reads_from(ws), ws[-1].chunk.end),) for ws in per_rank)
        window_start = prefix[rank][0][0]
        for name, x in (("slc_k", ks["slc"]), ("slc_v", vs["slc"])):
            transfers.append(FetchRanges(name, tokens, prefix))
            inputs.append(x)
    win_requests = tuple(tuple((w.win_halo_start, w.chunk.start) for w in ws) for ws in per_rank)
    cmp_requests = tuple(
        tuple((min(w.cmp_raw_start, w.chunk.start), w.chunk.start) for w in ws) for ws in per_rank
    )
    if not shared_win:
        transfers += [
            FetchRanges("win_halo_k", tokens, win_requests),
            FetchRanges("win_halo_v", tokens, win_requests),
        ]
        inputs += [ks["win"], vs["win"]]
    if not shared_cmp:
        transfers += [
            FetchRanges("cmp_halo_k", tokens, cmp_requests),
            FetchRanges("cmp_halo_v", tokens, cmp_requests),
        ]
        inputs += [ks["cmp"], vs["cmp"]]
    link, outs = exchange(transfers, inputs, q.new_zeros(()), group=group, timer=timer)

    slc_k = _TokenSource(ks["slc"], mine, window=outs[0], window_start=window_start)
    slc_v = _TokenSource(vs["slc"], mine, window=outs[1], window_start=window_start)
    at = 2

    def halo_sources(
        local_k: torch.Tensor,
        local_v: torch.Tensor,
        requests: tuple[tuple[tuple[int, int], ...], ...],
    ) -> tuple[_TokenSource, _TokenSource]:
        nonlocal at
        lengths = [end - start for start, end in requests[rank]]
        starts = [start for start, _ in requests[rank]]
        halo_k, halo_v = (_split_rows(outs[at + i], lengths) for i in (0, 1))
        at += 2
        return (
            _TokenSource(local_k, mine, halos=halo_k, halo_starts=starts),
            _TokenSource(local_v, mine, halos=halo_v, halo_starts=starts),
        )

    win_k, win_v = (
        (slc_k, slc_v) if shared_win else halo_sources(ks["win"], vs["win"], win_requests)
    )
    cmp_k, cmp_v = (
        (slc_k, slc_v) if shared_cmp else halo_sources(ks["cmp"], vs["cmp"], cmp_requests)
    )

    # ---- stage 2: compress the blocks each chunk owns, share them
    owned_k: list[torch.Tensor] = []
    owned_v: list[torch.Tensor] = []
    for index, work in enumerate(mine):
        end = work.chunk.end
        raw_cu = (
            None
            if work.cmp_raw_bounds is None
            else torch.tensor(work.cmp_raw_bounds, dtype=torch.int32, device=q.device)
        )
        for source, phi, owned in ((cmp_k, phi_k, owned_k), (cmp_v, phi_v, owned_v)):
            raw = source.tokens(index, work.cmp_raw_start, end)
            compressed = compress(raw, config.cmp_block, config.cmp_stride, phi, cu_seqlens=raw_cu)
            b0, b1 = work.owned_blocks
            if compressed.shape[1] != b1 - b0:
                raise RuntimeError(
                    f"chunk {work.chunk.index} compressed {compressed.shape[1]} blocks, "
                    f"owns {b1 - b0}: the ownership arithmetic is wrong"
                )
            owned.append(compressed)
    blocks = block_layout(works, world)
    link, (k_cmp, v_cmp) = exchange(
        [AllGather("cmp_blocks_k", blocks), AllGather("cmp_blocks_v", blocks)],
        [torch.cat(owned_k, dim=1), torch.cat(owned_v, dim=1)],
        link,
        group=group,
        timer=timer,
    )

    # ---- stage 3: the branches, chunk by chunk, on the registry's backends
    out_parts = []
    for index, work in enumerate(mine):
        chunk = work.chunk
        for seg in work.segments:
            rows = (chunk.local_start + seg.start - chunk.start, seg.end - seg.start)
            q_seg = q.narrow(1, *rows)
            varlen_cu = (
                None
                if seg.varlen_bounds is None
                else torch.tensor(seg.varlen_bounds, dtype=torch.int32, device=q.device)
            )
            cmp_rows = (seg.cmp_start, seg.cmp_end - seg.cmp_start)
            o_cmp, o_slc, o_win, _ = branch_outputs(
                config,
                q_seg,
                k_cmp.narrow(1, *cmp_rows),
                v_cmp.narrow(1, *cmp_rows),
                slc_k.tokens(index, seg.seq_start, seg.end),
                slc_v.tokens(index, seg.seq_start, seg.end),
                win_k.tokens(index, seg.win_start, seg.end),
                win_v.tokens(index, seg.win_start, seg.end),
                q_start=0 if varlen_cu is not None else seg.start - seg.seq_start,
                win_start=None if varlen_cu is not None else seg.start - seg.win_start,
                cu_seqlens=varlen_cu,
            )
            out_parts.append(ops.gated_combine(o_cmp, o_slc, o_win, gates.narrow(1, *rows)))
    return anchor(torch.cat(out_parts, dim=1), link)


__all__ = [
    "BRANCHES",
    "SLC_EXCHANGES",
    "SlcExchange",
    "block_layout",
    "context_parallel_nsa_attention",
    "token_layout",
]
