"""The passkey task: its token layout, batches with the needle at a chosen or drawn depth, and
the accuracy rule (exact match of the greedy answer tokens)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE = -100  # cross_entropy's ignore_index: positions that carry no loss


@dataclass(frozen=True)
class NeedleTask:
    """Token layout of the passkey task.

    Ids: filler [0, filler_vocab), then KEY, QUERY, then ``value_len`` ranges of ``value_vocab``
    ids, one per answer position. The needle is ``KEY v1 .. vL`` written ``needle_repeats``
    times in a row.
    """

    filler_vocab: int = 16
    value_len: int = 4
    value_vocab: int = 16
    needle_repeats: int = 1

    @property
    def needle_len(self) -> int:
        """Tokens of the whole needle, its repeats included."""
        return self.needle_repeats * (self.value_len + 1)

    @property
    def key_id(self) -> int:
        return self.filler_vocab

    @property
    def query_id(self) -> int:
        return self.filler_vocab + 1

    def value_base(self, k: int) -> int:
        """First id of answer position k's range (k = 0..value_len-1)."""
        return self.filler_vocab + 2 + k * self.value_vocab

    @property
    def vocab_size(self) -> int:
        return self.value_base(self.value_len)


@dataclass
class NeedleBatch:
    """tokens [B, T] int64; targets [B, L+1] int64 for the last L+1 positions (IGNORE on the last
    one: its prediction runs past the sequence); starts [B] (the first KEY); answers [B, L]."""

    tokens: torch.Tensor
    targets: torch.Tensor
    starts: torch.Tensor
    answers: torch.Tensor


def needle_span(task: NeedleTask, seq_len: int, reach: int, sel_block: int) -> tuple[int, int]:
    """(lo, hi): the KEY positions allowed, inclusive.

    The first scored row is QUERY at ``q0 = T - L - 1``; through the windows it can see tokens
    [q0 - reach + 1, q0] (``reach = layers * (w - 1) + 1``), the later scored rows less far back.
    The needle [p, p + N) (N = ``needle_len``) must end before that: ``p + N - 1 <= q0 - reach``.
    ``lo = l'`` skips block 0.
    """
    q0 = seq_len - task.value_len - 1
    lo, hi = sel_block, q0 - reach - task.needle_len + 1
    if hi < lo:
        raise ValueError(
            f"T={seq_len} is too short for a needle beyond the windows' reach of {reach} tokens "
            f"and past block 0 (l'={sel_block})"
        )
    return lo, hi


def needle_batch(
    task: NeedleTask,
    batch: int,
    seq_len: int,
    reach: int,
    sel_block: int,
    generator: torch.Generator,
    *,
    depth: float | None = None,
) -> NeedleBatch:
    """A batch on the CPU; ``depth`` in [0, 1] fixes where the needle sits, None draws it.

    ``reach``: how far back the windows let the QUERY row see (:func:`needle_span`).
    """
    lo, hi = needle_span(task, seq_len, reach, sel_block)
    tokens = torch.randint(0, task.filler_vocab, (batch, seq_len), generator=generator)
    bases = torch.tensor([task.value_base(k) for k in range(task.value_len)])
    answers = bases + torch.randint(
        0, task.value_vocab, (batch, task.value_len), generator=generator
    )
    if depth is None:
        starts = torch.randint(lo, hi + 1, (batch,), generator=generator)
    else:
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth must be in [0, 1], got {depth}")
        starts = torch.full((batch,), lo + round(depth * (hi - lo)), dtype=torch.int64)
    rows = torch.arange(batch)
    offsets = torch.arange(1, task.value_len + 1)
    for copy in range(task.needle_repeats):
        first = starts + copy * (task.value_len + 1)
        tokens[rows, first] = task.key_id
        tokens[rows.unsqueeze(1), first.unsqueeze(1) + offsets] = answers
    q0 = seq_len - task.value_len - 1
    tokens[:, q0] = task.query_id
    tokens[:, q0 + 1 :] = answers
    targets = torch.full((batch, task.value_len + 1), IGNORE, dtype=torch.int64)
    targets[:, : task.value_len] = answers
    return NeedleBatch(tokens=tokens, targets=targets, starts=starts, answers=answers)


def answer_hits(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, P, V], targets [B, P] (IGNORE where unscored) -> (exact [B] bool, token [B]).

    ``exact``: every scored greedy token is right; ``token``: the share of scored tokens right.
    """
    scored = targets != IGNORE
    right = (logits.argmax(-1) == targets) & scored
    exact = (right | ~scored).all(dim=-1)
    token = right.sum(-1).float() / scored.sum(-1).clamp_min(1).float()
    return exact, token
