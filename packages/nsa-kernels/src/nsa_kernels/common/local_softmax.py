"""The softmax of each query row over its forced blocks, handed from the sliding branch to the
selected one.

A query at position t (jt = t // l') always selects its blocks 0, jt - 1 and jt (docs/spec.md,
"Forced blocks": 1 initial + 2 local). The local ones hold the keys ``[max(jt - 1, 0) * l', t]``,
which a window of w >= 2 l' holds as well. Where the selected and sliding branches share their
keys and values (the spec's allowed special case), a sliding kernel that walks those keys first
has their softmax on the way; it adds block 0's keys and stores the result
(:class:`LocalSoftmax`), and the selected kernel starts its own walk from it instead of loading
those tiles once per row (the fused core, :mod:`nsa_kernels.core`, hands it over). The name keeps
the local keys, the part the window shares.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nsa_core.reference.common import spans


@dataclass(frozen=True)
class LocalSoftmax:
    """Each row's softmax over the keys of its forced blocks: ``[0, l')`` and
    ``[max(t // l' - 1, 0) * l', t]``, those up to t.

    o [B, Tq, HQ, dv] normalised, in q's dtype; lse [B, Tq, HQ] float32 (float64 from
    :func:`local_softmax_reference` on float64 inputs), natural log; sel_block: l'. No gradient
    flows through either (the selected branch's backward recomputes its softmax from its own
    log-sum-exp).
    """

    o: torch.Tensor
    lse: torch.Tensor
    sel_block: int

    def __post_init__(self) -> None:
        if self.o.dim() != 4 or self.lse.shape != self.o.shape[:3]:
            raise ValueError(
                f"LocalSoftmax takes o [B, Tq, HQ, dv] and lse [B, Tq, HQ], got "
                f"{list(self.o.shape)} and {list(self.lse.shape)}"
            )
        if self.sel_block < 1:
            raise ValueError(f"sel_block must be >= 1, got {self.sel_block}")


def check_local_softmax(local: LocalSoftmax, o_shape: tuple[int, ...], sel_block: int) -> None:
    """``local`` must be for a call whose output is o_shape [B, Tq, HQ, dv], at l' = sel_block."""
    if local.sel_block != sel_block or tuple(local.o.shape) != tuple(o_shape):
        raise ValueError(
            f"local softmax {list(local.o.shape)} of l'={local.sel_block} for a call of "
            f"{list(o_shape)}, l'={sel_block}"
        )


def holds_local_keys(window: int, sel_block: int, num_keys: int) -> bool:
    """Whether a window of ``window`` keys holds every row's local keys: w >= 2 l', or a window
    no shorter than the keys (then it bounds nothing)."""
    return window >= 2 * sel_block or window >= num_keys


def check_holds_local_keys(window: int, sel_block: int, num_keys: int) -> None:
    """Refuse a sliding call asked for the local softmax whose window does not hold the local
    keys (:func:`holds_local_keys`)."""
    if not holds_local_keys(window, sel_block, num_keys):
        raise ValueError(
            f"window={window} < 2 * sel_block={2 * sel_block}: the window does not hold every "
            "row's local blocks"
        )


def local_softmax_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sel_block: int,
    scale: float | None = None,
    *,
    q_start: int = 0,
    cu_seqlens: torch.Tensor | None = None,
) -> LocalSoftmax:
    """The local softmax straight from its definition, in q's dtype (float64 for tests).

    q [B, Tq, HQ, dk] (row r at position q_start + r; varlen: positions restart in every
    sequence), k [B, Tk, H, dk], v [B, Tk, H, dv]: row t attends to the keys of its sequence at
    positions ``0 .. l' - 1`` and ``max(t // l' - 1, 0) * l' .. t``, those up to t. Dense over
    [Tq, Tk]: small shapes only.
    """
    _, tq, hq, dk = q.shape
    h = k.shape[2]
    scale = dk**-0.5 if scale is None else scale
    if cu_seqlens is None:
        q_pos = torch.arange(tq, device=q.device) + q_start
        k_pos = torch.arange(k.shape[1], device=q.device)
        q_seq = torch.zeros(tq, dtype=torch.long, device=q.device)
        k_seq = torch.zeros(k.shape[1], dtype=torch.long, device=q.device)
    else:
        q_pos = torch.empty(tq, dtype=torch.long, device=q.device)
        q_seq = torch.empty(tq, dtype=torch.long, device=q.device)
        for i, (start, end) in enumerate(spans(cu_seqlens)):
            q_pos[start:end] = torch.arange(end - start, device=q.device)
            q_seq[start:end] = i
        k_pos, k_seq = q_pos, q_seq
    first = torch.clamp(q_pos // sel_block - 1, min=0) * sel_block
    forced = (k_pos[None, :] >= first[:, None]) | (k_pos[None, :] < sel_block)
    seen = (
        (k_seq[None, :] == q_seq[:, None]) & forced & (k_pos[None, :] <= q_pos[:, None])
    )  # [Tq, Tk]
    kq = k.repeat_interleave(hq // h, dim=2)
    vq = v.repeat_interleave(hq // h, dim=2)
    logits = torch.einsum("bthd,bshd->bhts", q, kq) * scale
    logits = logits.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [B, HQ, Tq]
    p = torch.exp(logits - lse[..., None])
    # Keys a row does not see take no part at all (0 x a non-finite value would be NaN).
    products = p[..., None] * vq.permute(0, 2, 1, 3)[:, :, None]  # [B, HQ, Tq, Tk, dv]
    o = torch.where(seen[None, None, :, :, None], products, 0).sum(dim=3)
    o = o.permute(0, 2, 1, 3).to(q.dtype).contiguous()
    return LocalSoftmax(o=o, lse=lse.transpose(1, 2).contiguous(), sel_block=sel_block)
