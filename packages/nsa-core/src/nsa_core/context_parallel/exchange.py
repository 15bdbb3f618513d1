"""Autograd-aware exchanges of sharded tensors between the ranks of a process group.

A sharded axis (axis 1 of ``x [B, N, ...]``: tokens or compressed blocks) is tiled by
:class:`Piece` s in global order, each held by one rank at some local rows. Two transfers move
rows between ranks:

- :class:`AllGather`: every rank gets the whole axis ``[B, N, ...]`` (``all_gather`` of the
  local rows, padded to the longest). Backward: ``all_to_all`` of the gradient rows to their
  owners, each owner summing the W contributions in rank order.
- :class:`FetchRanges`: every rank gets the global ranges it asked for, concatenated
  (point-to-point, one message per peer and transfer). Backward: the gradient rows go back the
  same way, each owner adding them in a fixed order (its own rows first, then peer by peer in
  rank order).

Every sum of the backward runs in an order fixed by the layout, never by arrival time, so the
gradients are bit-reproducible run to run on any backend. :func:`exchange` runs a list of
transfers in ONE autograd node, so each rank runs the backward collectives of a call in the
same order, and chains calls through a ``link`` scalar, so a later exchange's backward always
runs before an earlier one's: collectives of different calls never interleave differently on
different ranks (which would deadlock).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Piece:
    """Rows [global_start, global_start + length) of the axis, at ``local_start`` on ``rank``."""

    rank: int
    local_start: int
    global_start: int
    length: int

    @property
    def global_end(self) -> int:
        return self.global_start + self.length


@dataclass(frozen=True)
class PieceLayout:
    """Pieces tiling the axis [0, total) in global order, over ``world_size`` ranks."""

    world_size: int
    pieces: tuple[Piece, ...]

    def __post_init__(self) -> None:
        at = 0
        for piece in self.pieces:
            if piece.global_start != at or piece.length < 0:
                raise ValueError(f"pieces must tile the axis in order: {piece} after {at}")
            if not 0 <= piece.rank < self.world_size:
                raise ValueError(f"piece {piece} names a rank outside [0, {self.world_size})")
            at = piece.global_end
        for rank in range(self.world_size):
            row = 0
            for piece in self.local_pieces(rank):
                if piece.local_start != row:
                    raise ValueError(f"rank {rank}'s pieces must tile its rows: {piece} at {row}")
                row += piece.length

    @property
    def total(self) -> int:
        return self.pieces[-1].global_end if self.pieces else 0

    def local_length(self, rank: int) -> int:
        """Rows ``rank`` holds."""
        return sum(p.length for p in self.pieces if p.rank == rank)

    def local_pieces(self, rank: int) -> list[Piece]:
        """The pieces of ``rank`` in local row order."""
        return sorted((p for p in self.pieces if p.rank == rank), key=lambda p: p.local_start)

    def overlap(self, start: int, end: int) -> Iterator[tuple[Piece, int, int]]:
        """(piece, lo, hi) for every piece meeting [start, end), in global order."""
        for piece in self.pieces:
            lo, hi = max(start, piece.global_start), min(end, piece.global_end)
            if lo < hi:
                yield piece, lo, hi


@dataclass(frozen=True)
class AllGather:
    """Every rank receives the whole axis, in global order: [B, layout.total, ...]."""

    name: str
    layout: PieceLayout


@dataclass(frozen=True)
class FetchRanges:
    """Rank r receives the concatenation of ``requests[r]`` (global [start, end) ranges).

    Every rank holds the same ``requests`` (it is derived from the plan), so each knows what
    to send to whom without asking.
    """

    name: str
    layout: PieceLayout
    requests: tuple[tuple[tuple[int, int], ...], ...]

    def received(self, rank: int) -> int:
        """Rows of ``rank``'s output."""
        return sum(end - start for start, end in self.requests[rank])


Transfer = AllGather | FetchRanges


@dataclass
class CommTimer:
    """Wall seconds spent in exchanges, by ``"<fwd|bwd>:<transfer name>"``.

    Each timed section synchronizes the device before and after it (on CUDA), so it measures
    the exchange alone; that also removes any overlap of compute and communication, which is
    why the timer is off unless a caller passes one.
    """

    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    @contextmanager
    def section(self, name: str, device: torch.device) -> Iterator[None]:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        try:
            yield
        finally:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            self.calls[name] = self.calls.get(name, 0) + 1

    def total(self, prefix: str = "") -> float:
        """Seconds of every section whose name starts with ``prefix``."""
        return sum(s for name, s in self.seconds.items() if name.startswith(prefix))

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


@contextmanager
def _maybe_timed(timer: CommTimer | None, name: str, device: torch.device) -> Iterator[None]:
    if timer is None:
        yield
    else:
        with timer.section(name, device):
            yield


def _rows(x: torch.Tensor, start: int, length: int) -> torch.Tensor:
    return x.narrow(1, start, length)


def _cat_rows(parts: Sequence[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """parts concatenated on axis 1; an empty [B, 0, ...] of ``like`` when there are none."""
    if not parts:
        return like.new_empty(like.shape[0], 0, *like.shape[2:])
    return torch.cat(list(parts), dim=1)


# ----------------------------------------------------------------------------------- all-gather


def _all_gather_forward(
    t: AllGather, x: torch.Tensor, group: dist.ProcessGroup | None, rank: int
) -> torch.Tensor:
    """x [B, L_rank, ...] -> [B, N, ...]: every rank's rows in global order."""
    world = t.layout.world_size
    longest = max(t.layout.local_length(r) for r in range(world))
    padded = x.new_zeros(x.shape[0], longest, *x.shape[2:])
    padded[:, : x.shape[1]] = x
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded.contiguous(), group=group)
    parts = [_rows(gathered[p.rank], p.local_start, p.length) for p in t.layout.pieces]
    return _cat_rows(parts, x)


def _all_gather_backward(
    t: AllGather, grad: torch.Tensor, group: dist.ProcessGroup | None, rank: int
) -> torch.Tensor:
    """grad [B, N, ...] on every rank -> [B, L_rank, ...]: the sum over ranks, in rank order."""
    layout = t.layout
    world = layout.world_size
    # Rows for rank p, in p's local order, for every p in rank order; token-major because
    # all_to_all splits the first axis.
    send_parts = [
        _rows(grad, p.global_start, p.length) for r in range(world) for p in layout.local_pieces(r)
    ]
    send = _cat_rows(send_parts, grad).movedim(1, 0).contiguous()
    mine = layout.local_length(rank)
    recv = grad.new_empty(world * mine, grad.shape[0], *grad.shape[2:])
    dist.all_to_all_single(
        recv,
        send,
        output_split_sizes=[mine] * world,
        input_split_sizes=[layout.local_length(r) for r in range(world)],
        group=group,
    )
    total = recv.narrow(0, 0, mine).clone()
    for source in range(1, world):  # a fixed order: bit-reproducible on every backend
        total += recv.narrow(0, source * mine, mine)
    return total.movedim(0, 1).contiguous()


# -------------------------------------------------------------------------------- fetch ranges


def _wanted(t: FetchRanges, rank: int) -> list[tuple[Piece, int, int]]:
    """(piece, lo, hi) for every piece of ``rank``'s requests, in output order."""
    return [hit for start, end in t.requests[rank] for hit in t.layout.overlap(start, end)]


def _served(t: FetchRanges, rank: int) -> dict[int, list[tuple[Piece, int, int]]]:
    """Per peer that reads any, in rank order: (piece, lo, hi) of ``rank``'s rows it requested.

    What ``rank`` sends forward and receives back in the backward.
    """
    served: dict[int, list[tuple[Piece, int, int]]] = {}
    for peer in range(t.layout.world_size):
        if peer != rank:
            hits = [hit for hit in _wanted(t, peer) if hit[0].rank == rank]
            if hits:
                served[peer] = hits
    return served


def _local_rows(piece: Piece, lo: int) -> int:
    return piece.local_start + lo - piece.global_start


def _p2p(
    sends: dict[int, torch.Tensor],
    recvs: dict[int, torch.Tensor],
    tag: int,
    group: dist.ProcessGroup | None,
) -> None:
    """One batch of point-to-point messages: ``sends[peer]`` out, ``recvs[peer]`` filled in."""

    def global_rank(peer: int) -> int:  # P2POp names peers by their rank in the world
        return peer if group is None else dist.get_global_rank(group, peer)

    ops = [
        dist.P2POp(dist.isend, buf, global_rank(peer), group, tag)
        for peer, buf in sorted(sends.items())
    ]
    ops += [
        dist.P2POp(dist.irecv, buf, global_rank(peer), group, tag)
        for peer, buf in sorted(recvs.items())
    ]
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()


def _fetch_forward(
    t: FetchRanges,
    x: torch.Tensor,
    group: dist.ProcessGroup | None,
    rank: int,
    tag: int,
) -> torch.Tensor:
    """x [B, L_rank, ...] -> [B, received(rank), ...]."""
    world = t.layout.world_size
    sends = {
        peer: _cat_rows(
            [_rows(x, _local_rows(piece, lo), hi - lo) for piece, lo, hi in hits], x
        ).contiguous()
        for peer, hits in _served(t, rank).items()
    }
    wanted = _wanted(t, rank)
    counts = [0] * world
    for piece, lo, hi in wanted:
        counts[piece.rank] += hi - lo
    recvs = {
        peer: x.new_empty(x.shape[0], n, *x.shape[2:])
        for peer, n in enumerate(counts)
        if n and peer != rank
    }
    _p2p(sends, recvs, tag, group)
    cursor = [0] * world
    out = []
    for piece, lo, hi in wanted:
        if piece.rank == rank:
            out.append(_rows(x, _local_rows(piece, lo), hi - lo))
        else:
            out.append(_rows(recvs[piece.rank], cursor[piece.rank], hi - lo))
            cursor[piece.rank] += hi - lo
    return _cat_rows(out, x)


def _fetch_backward(
    t: FetchRanges,
    grad: torch.Tensor,
    local_shape: torch.Size,
    group: dist.ProcessGroup | None,
    rank: int,
    tag: int,
) -> torch.Tensor:
    """grad [B, received(rank), ...] -> [B, L_rank, ...], summed over every rank's requests."""
    grad_local = grad.new_zeros(local_shape)
    # Slices of my output that peers own go back to them, one message per peer.
    back: dict[int, list[torch.Tensor]] = {}
    offset = 0
    own: list[tuple[Piece, int, int, int]] = []
    for piece, lo, hi in _wanted(t, rank):
        if piece.rank == rank:
            own.append((piece, lo, hi, offset))
        else:
            back.setdefault(piece.rank, []).append(_rows(grad, offset, hi - lo))
        offset += hi - lo
    sends = {peer: _cat_rows(parts, grad).contiguous() for peer, parts in back.items()}
    peer_hits = _served(t, rank)
    recvs = {
        peer: grad.new_empty(grad.shape[0], sum(hi - lo for _, lo, hi in hits), *grad.shape[2:])
        for peer, hits in peer_hits.items()
    }
    _p2p(sends, recvs, tag, group)
    # A fixed order of additions: my own requests first, then peer by peer in rank order.
    for piece, lo, hi, at in own:
        _rows(grad_local, _local_rows(piece, lo), hi - lo).add_(_rows(grad, at, hi - lo))
    for peer in sorted(peer_hits):
        at = 0
        for piece, lo, hi in peer_hits[peer]:
            _rows(grad_local, _local_rows(piece, lo), hi - lo).add_(_rows(recvs[peer], at, hi - lo))
            at += hi - lo
    return grad_local


# --------------------------------------------------------------------------- the autograd node


class _Exchange(torch.autograd.Function):
    """One autograd node running a list of transfers, forward and backward, in list order."""

    @staticmethod
    def forward(
        ctx: Any,
        transfers: tuple[Transfer, ...],
        group: dist.ProcessGroup | None,
        timer: CommTimer | None,
        link: torch.Tensor,
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        rank = dist.get_rank(group)
        ctx.transfers = transfers
        ctx.group = group
        ctx.timer = timer
        ctx.local_shapes = [x.shape for x in tensors]
        outs = []
        for tag, (t, x) in enumerate(zip(transfers, tensors, strict=True)):
            with torch.no_grad(), _maybe_timed(timer, f"fwd:{t.name}", x.device):
                if isinstance(t, AllGather):
                    outs.append(_all_gather_forward(t, x, group, rank))
                else:
                    outs.append(_fetch_forward(t, x, group, rank, tag))
        return (link.new_zeros(()), *outs)

    @staticmethod
    def backward(ctx: Any, grad_link: torch.Tensor, *grads: torch.Tensor) -> tuple[Any, ...]:
        rank = dist.get_rank(ctx.group)
        grads_in = []
        for tag, (t, grad, local_shape) in enumerate(
            zip(ctx.transfers, grads, ctx.local_shapes, strict=True)
        ):
            with _maybe_timed(ctx.timer, f"bwd:{t.name}", grad.device):
                if isinstance(t, AllGather):
                    grads_in.append(_all_gather_backward(t, grad.contiguous(), ctx.group, rank))
                else:
                    grads_in.append(
                        _fetch_backward(t, grad.contiguous(), local_shape, ctx.group, rank, tag)
                    )
        return (None, None, None, torch.zeros_like(grad_link), *grads_in)


def exchange(
    transfers: Sequence[Transfer],
    tensors: Sequence[torch.Tensor],
    link: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    timer: CommTimer | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Run ``transfers[i]`` on ``tensors[i]`` (each [B, L_rank, ...]) in one autograd node.

    Every rank of ``group`` must call this with the same transfers (the same layouts and
    requests), in the same order relative to its other collective calls.

    Args:
        transfers: what to move, one per tensor.
        tensors: the local rows, [B, layout.local_length(rank), ...] each.
        link: a scalar; pass the ``link`` returned by the previous exchange of the same
            computation (or any scalar for the first). Its gradient ties the nodes together so
            that this call's backward runs before the previous call's on every rank.
        group: the process group (default: the world).
        timer: records the seconds of each transfer, forward and backward.

    Returns:
        (link, outputs): a fresh scalar link, and one tensor per transfer, [B, layout.total,
        ...] for :class:`AllGather`, [B, received(rank), ...] for :class:`FetchRanges`.
    """
    if len(transfers) != len(tensors):
        raise ValueError(f"{len(transfers)} transfers for {len(tensors)} tensors")
    rank = dist.get_rank(group)
    for t, x in zip(transfers, tensors, strict=True):
        if x.shape[1] != t.layout.local_length(rank):
            raise ValueError(
                f"transfer {t.name!r}: rank {rank} holds {t.layout.local_length(rank)} rows, "
                f"the tensor has {x.shape[1]}"
            )
    result = _Exchange.apply(  # type: ignore[no-untyped-call]
        tuple(transfers), group, timer, link, *tensors
    )
    return result[0], list(result[1:])


class _Anchor(torch.autograd.Function):
    """out unchanged; backward sends a zero gradient to ``link`` so every exchange node runs."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, link: torch.Tensor) -> torch.Tensor:
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, grad.new_zeros(())


def anchor(out: torch.Tensor, link: torch.Tensor) -> torch.Tensor:
    """``out``, with ``link`` in its graph: a backward from ``out`` reaches every chained exchange.

    Without it, a rank whose output happens not to depend on an exchanged tensor (a chunk that
    sees no compressed block) would skip that exchange's backward while its peers wait in it.
    """
    result: torch.Tensor = _Anchor.apply(out, link)  # type: ignore[no-untyped-call]
    return result
