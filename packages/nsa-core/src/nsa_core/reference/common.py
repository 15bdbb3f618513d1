"""Pieces the reference ops share: validation before the body, varlen spans and the joining of
their outputs, the compute dtype, the masked softmax, attention over the visible keys, chunking
over queries."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator
from typing import Generic, ParamSpec, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")


class ValidatedOp(Generic[P, R]):
    """A reference op as users call it by name: ``check`` on the arguments, then ``body``.

    ``body`` alone is what the registry's reference backends run, because :mod:`nsa_core.ops`
    has validated the call already (the op modules export it as ``<op>_impl``). Name, docstring
    and signature are the body's (``functools.update_wrapper``).
    """

    def __init__(self, check: Callable[..., object], body: Callable[P, R]) -> None:
        self.check = check
        self.body = body
        functools.update_wrapper(self, body)

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        self.check(*args, **kwargs)
        return self.body(*args, **kwargs)


def validated_by(check: Callable[..., object]) -> Callable[[Callable[P, R]], ValidatedOp[P, R]]:
    """Decorator of a reference op's body: calls validate with ``check`` (:class:`ValidatedOp`).

    ``check`` takes the op's arguments as the body does (nsa_core.checks' ``check_<op>``).
    """

    def wrap(body: Callable[P, R]) -> ValidatedOp[P, R]:
        return ValidatedOp(check, body)

    return wrap


# Upper bound on the elements of the largest intermediate one query chunk may create; it keeps
# every op's memory O(T * n * l') (or O(T * w)) instead of O(T^2).
CHUNK_ELEMENTS = 1 << 24


def spans(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    """[(start, end)] of each packed sequence."""
    values = [int(x) for x in cu_seqlens.tolist()]
    return list(itertools.pairwise(values))


def join_sequences(outs: list[torch.Tensor], q: torch.Tensor, dv: int) -> torch.Tensor:
    """o [B, Tq, HQ, dv]: the packed sequences' outputs, in order along T (none: Tq = 0)."""
    batch, _, hq, _ = q.shape
    return torch.cat(outs, dim=1) if outs else q.new_zeros(batch, 0, hq, dv)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The reference computes half-precision inputs in float32 and keeps float32/float64."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def masked_softmax(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim restricted to ``mask``; rows with nothing visible give zeros.

    The max is detached (softmax does not depend on it) and masked entries never reach exp as
    ``-inf - -inf``, so neither values nor gradients become NaN on empty rows.
    """
    if scores.shape[-1] == 0:
        return scores
    scores = scores.masked_fill(~mask, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    denom = weights.sum(dim=-1, keepdim=True)
    # Only empty rows (denominator 0) divide by 1; a NaN denominator (a visible NaN or +inf
    # logit) stays NaN, so the whole row is non-finite (docs/spec.md, "Non-finite values").
    return weights / torch.where(denom == 0, torch.ones_like(denom), denom)


def attend_visible(
    probs: torch.Tensor, visible: torch.Tensor, values: torch.Tensor
) -> torch.Tensor:
    """o [B, H, T, G, dv] = sum over visible k of probs[..., k] * values[:, :, k].

    Args:
        probs: [B, H, T, G, K], zero where not visible.
        visible: bool, broadcastable to probs.
        values: [B, H, K, dv].

    docs/spec.md, "Non-finite values": a masked entry must never enter a product, since
    0 * NaN = NaN would poison rows that cannot see the token. The product runs on finite values
    only; an output channel whose visible values hold a non-finite one becomes NaN.
    """
    finite = torch.isfinite(values)
    o = torch.einsum("bhtgk,bhkd->bhtgd", probs, torch.where(finite, values, 0.0))
    seen = visible.expand(probs.shape).to(values.dtype)
    hits = torch.einsum("bhtgk,bhkd->bhtgd", seen, (~finite).to(values.dtype))
    return torch.where(hits > 0, torch.full_like(o, float("nan")), o)


def visible_probs(
    q: torch.Tensor, k: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """p [B, H, C, G, K] in the compute dtype: softmax of ``scale * q . k`` over the visible keys.

    q [B, C, HQ, dk] (head i in group i // G), k [B, K, H, dk]; visible bool, broadcastable to
    [B, H, C, G, K]. Rows that see no key are all zero.
    """
    batch, c, hq, dk = q.shape
    h = k.shape[2]
    dtype = compute_dtype(q.dtype)
    qg = q.to(dtype).view(batch, c, h, hq // h, dk).permute(0, 2, 1, 3, 4)
    kc = k.to(dtype).permute(0, 2, 1, 3)  # [B, H, K, dk]
    scores = torch.einsum("bhtgd,bhkd->bhtgk", qg, kc) * scale
    return masked_softmax(scores, visible)


def attend_keys(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """o [B, H, C, G, dv] in the compute dtype: each query over its visible keys, in one softmax.

    q [B, C, HQ, dk], k [B, K, H, dk], v [B, K, H, dv]; visible as :func:`visible_probs` takes it.
    """
    probs = visible_probs(q, k, visible, scale)
    values = v.to(compute_dtype(q.dtype)).permute(0, 2, 1, 3)  # [B, H, K, dv]
    return attend_visible(probs, visible, values)


def query_chunk(per_query_elements: int) -> int:
    """How many queries one chunk may hold so that its largest intermediate stays bounded."""
    return max(1, CHUNK_ELEMENTS // max(1, per_query_elements))


def query_chunks(tq: int, chunk: int) -> Iterator[tuple[int, int]]:
    """The row ranges [c0, c1) of ``tq`` query rows, ``chunk`` at a time.

    Counting chunks, rather than stepping through tq, keeps a traced tq symbolic: torch.compile
    then guards on the number of chunks alone, not on each sequence length.
    """
    for i in range(-(-tq // chunk)):
        c0 = i * chunk
        yield c0, min(tq, c0 + chunk)


def attend_in_query_chunks(
    q: torch.Tensor, dv: int, chunk: int, attend_chunk: Callable[[int, int], torch.Tensor]
) -> torch.Tensor:
    """o [B, Tq, HQ, dv] in q's dtype, ``chunk`` queries at a time.

    ``attend_chunk(c0, c1)`` gives the output of query rows [c0, c1) as [B, H, c1 - c0, G, dv]
    (head h * G + g of HQ); no query rows give an empty output.
    """
    batch, tq, hq, _ = q.shape
    if tq == 0:
        return q.new_zeros(batch, 0, hq, dv)
    outs = []
    for c0, c1 in query_chunks(tq, chunk):
        o = attend_chunk(c0, c1)
        outs.append(o.permute(0, 2, 1, 3, 4).reshape(batch, c1 - c0, hq, dv))
    return torch.cat(outs, dim=1).to(q.dtype)
