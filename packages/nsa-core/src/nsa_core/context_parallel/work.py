"""What each chunk of a sharded sequence computes and which tokens and blocks it reads.

Pure host arithmetic on the plan, the sequence boundaries and the NSA geometry: every rank
derives the same :class:`ChunkWork` for every chunk, so each knows what its peers will ask of it
without a round of requests. Positions follow docs/spec.md: compressed block i of a sequence
covers its tokens [i*d, i*d + l) and is complete once token i*d + l - 1 exists; with varlen,
positions and blocks restart in each packed sequence and the blocks of all sequences are packed
in order (``nsa_core.blocks.cmp_cu_seqlens``).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from nsa_core.block_math import num_cmp_blocks
from nsa_core.config import NSAConfig
from nsa_core.context_parallel.plan import Chunk, ShardPlan


@dataclass(frozen=True)
class Sequences:
    """Packed sequences over the global token axis.

    Attributes:
        bounds: token offsets [S+1], from 0 to T (``cu_seqlens``; ``(0, T)`` when dense).
        cmp_bounds: [S+1] offsets of each sequence's compressed blocks, packed in order.
        varlen: whether the caller passed ``cu_seqlens`` (positions restart per sequence).
    """

    bounds: tuple[int, ...]
    cmp_bounds: tuple[int, ...]
    varlen: bool

    @classmethod
    def build(cls, bounds: Sequence[int], config: NSAConfig, *, varlen: bool) -> Sequences:
        cmp = [0]
        for a, b in itertools.pairwise(bounds):
            cmp.append(cmp[-1] + num_cmp_blocks(b - a, config.cmp_block, config.cmp_stride))
        return cls(tuple(bounds), tuple(cmp), varlen)

    def seq_of_token(self, position: int) -> int:
        """The (non-empty) sequence holding token ``position`` < T."""
        return bisect.bisect_right(self.bounds, position) - 1

    def seq_of_block(self, block: int) -> int:
        """The sequence owning packed compressed block ``block``."""
        return bisect.bisect_right(self.cmp_bounds, block) - 1

    def blocks_before(self, position: int, config: NSAConfig) -> int:
        """Packed compressed blocks whose last token lies before ``position``."""
        if position == 0:
            return 0
        seq = self.seq_of_token(position - 1)
        start = self.bounds[seq]
        return self.cmp_bounds[seq] + num_cmp_blocks(
            position - start, config.cmp_block, config.cmp_stride
        )

    def local_bounds(self, start: int, end: int) -> tuple[int, ...]:
        """cu_seqlens of tokens [start, end) (``start`` a sequence boundary or a block start),
        relative to ``start``; the last sequence may be cut at ``end``."""
        inner = [b - start for b in self.bounds if start < b < end]
        return (0, *inner, end - start)


@dataclass(frozen=True)
class Segment:
    """Query rows [start, end) of a chunk computed by one call of the branch ops.

    A dense call (``varlen_bounds is None``) sees one sequence that began at ``seq_start``:
    its queries sit at positions ``start - seq_start`` on, its selected keys are tokens
    [seq_start, end), its window keys tokens [win_start, end) and its compressed blocks the
    packed blocks [cmp_start, cmp_end). A varlen call (``varlen_bounds`` its cu_seqlens,
    relative to ``start``) holds whole sequences from ``start`` on, the last one possibly cut at
    ``end``; its keys are its own tokens.
    """

    start: int
    end: int
    seq_start: int
    varlen_bounds: tuple[int, ...] | None
    cmp_start: int
    cmp_end: int
    win_start: int


@dataclass(frozen=True)
class ChunkWork:
    """Everything one chunk computes and reads.

    Attributes:
        chunk: the chunk ([start, end) of the tokens, its rank and local rows).
        segments: the calls of the branch ops that cover the chunk's query rows, in order.
        owned_blocks: packed compressed blocks [b0, b1) whose last token is in the chunk: the
            chunk's rank computes them (phi over the raw compressed-branch keys and values).
        cmp_raw_start: raw tokens [cmp_raw_start, end) that those blocks cover (from up to
            l - 1 tokens before the chunk); ``end`` when the chunk owns no block.
        cmp_raw_bounds: cu_seqlens of those raw tokens (varlen), None when dense.
        win_halo_start: tokens [win_halo_start, start) before the chunk that its window reads.
        sel_start: the first token its selected branch reads (0 when dense).
    """

    chunk: Chunk
    segments: tuple[Segment, ...]
    owned_blocks: tuple[int, int]
    cmp_raw_start: int
    cmp_raw_bounds: tuple[int, ...] | None
    win_halo_start: int
    sel_start: int

    @property
    def first_token_read(self) -> int:
        """The first token any branch of the chunk reads."""
        return min(self.sel_start, self.cmp_raw_start, self.win_halo_start)


def chunk_work(chunk: Chunk, seqs: Sequences, config: NSAConfig) -> ChunkWork:
    """The :class:`ChunkWork` of ``chunk``."""
    s, e = chunk.start, chunk.end
    w = config.window
    head_seq = seqs.seq_of_token(s)
    cs, ce = seqs.bounds[head_seq], seqs.bounds[head_seq + 1]
    segments: list[Segment] = []
    if not seqs.varlen or cs < s:
        # The chunk starts inside a sequence: its first rows continue it, at positions s - cs.
        head_end = e if not seqs.varlen else min(e, ce)
        first_block = seqs.cmp_bounds[head_seq]
        seen = num_cmp_blocks(head_end - cs, config.cmp_block, config.cmp_stride)
        segments.append(
            Segment(s, head_end, cs, None, first_block, first_block + seen, max(cs, s - w + 1))
        )
        rest = head_end
    else:
        rest = s
    if rest < e:
        # Whole sequences from ``rest`` on (the last possibly cut at e): one varlen call.
        segments.append(
            Segment(
                rest,
                e,
                rest,
                seqs.local_bounds(rest, e),
                seqs.blocks_before(rest, config),
                seqs.blocks_before(e, config),
                rest,
            )
        )
    b0, b1 = seqs.blocks_before(s, config), seqs.blocks_before(e, config)
    if b1 > b0:
        owner_seq = seqs.seq_of_block(b0)
        raw_start = seqs.bounds[owner_seq] + (b0 - seqs.cmp_bounds[owner_seq]) * config.cmp_stride
    else:
        raw_start = e
    raw_bounds = seqs.local_bounds(raw_start, e) if seqs.varlen and raw_start < e else None
    return ChunkWork(
        chunk=chunk,
        segments=tuple(segments),
        owned_blocks=(b0, b1),
        cmp_raw_start=raw_start,
        cmp_raw_bounds=raw_bounds,
        win_halo_start=min(s, segments[0].win_start),
        sel_start=min(seg.seq_start for seg in segments),
    )


def plan_work(plan: ShardPlan, seqs: Sequences, config: NSAConfig) -> tuple[ChunkWork, ...]:
    """The work of every chunk of ``plan``, in global order."""
    return tuple(chunk_work(c, seqs, config) for c in plan.chunks())
