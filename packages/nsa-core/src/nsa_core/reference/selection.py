"""Block scoring (paper Eq. 8-10) and top-n selection with the forced initial and local blocks."""

from __future__ import annotations

import torch

from nsa_core.block_math import cmp_block_band, cmp_cu_seqlens, num_sel_blocks
from nsa_core.checks import check_block_scores, check_select_blocks, check_topn_blocks
from nsa_core.reference.common import (
    masked_softmax,
    query_chunk,
    query_chunks,
    spans,
    validated_by,
)
from nsa_core.reference.compressed_attention import cmp_visible


def block_scores(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    cmp_block: int,
    cmp_stride: int,
    sel_block: int,
    scale: float | None = None,
    *,
    q_start: int = 0,
) -> torch.Tensor:
    """S [B, Tq, H, Nsel]: group-summed selection scores, Nsel = ceil((q_start + Tq) / l').

    ``s[t, h, j] = sum_i c[i, j] * p_cmp[t, h, i]`` with c the overlap of compressed block i with
    selection block j in units of d, then ``S[t, g, j] = sum of s over the G heads of group g``.
    Computed in float32 (float64 for float64 inputs) without gradient: selection is discrete.

    Args:
        q: [B, Tq, HQ, dk]; k_cmp: [B, N, H, dk] compressed keys.
    """
    check_block_scores(q, k_cmp, cmp_block, cmp_stride, sel_block, scale, q_start=q_start)
    batch, tq, hq, dk = q.shape
    n_cmp, h = k_cmp.shape[1], k_cmp.shape[2]
    scale = dk**-0.5 if scale is None else scale
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    n_sel = num_sel_blocks(q_start + tq, sel_block)
    with torch.no_grad():
        band, weight = cmp_block_band(
            n_cmp, n_sel, cmp_block, cmp_stride, sel_block, device=q.device, dtype=dtype
        )
        exact = dtype == torch.float64
        chunk = query_chunk(hq * n_cmp * (dk if exact else 2) + h * n_sel * band.shape[1])
        kc = k_cmp.permute(0, 2, 1, 3)  # [B, H, N, dk]
        outs = []
        for c0, c1 in query_chunks(tq, chunk):
            qg = q[:, c0:c1].view(batch, c1 - c0, h, hq // h, dk).permute(0, 2, 1, 3, 4)
            logits = tie_exact_logits(qg, kc) * scale  # [B, H, C, G, N]
            t = torch.arange(q_start + c0, q_start + c1, device=q.device)
            visible = cmp_visible(t, n_cmp, cmp_block, cmp_stride)[None, None, :, None, :]
            p = masked_softmax(logits.to(dtype), visible).sum(dim=3)  # group sum: commutes with c
            p = torch.nn.functional.pad(p, (0, 1))  # the zero that band padding points at
            s = (p[..., band] * weight).sum(dim=-1)  # [B, H, C, Nsel]
            outs.append(s.permute(0, 2, 1, 3))
        if not outs:
            return q.new_zeros(batch, 0, h, n_sel, dtype=dtype)
        return torch.cat(outs, dim=1)


def tie_exact_logits(qg: torch.Tensor, kc: torch.Tensor) -> torch.Tensor:
    """q . k for qg [B, H, C, G, dk] and kc [B, H, N, dk] -> [B, H, C, G, N], equal keys tied.

    The tie rule needs bit-equal logits for equal keys wherever they sit, which a matrix product
    does not promise (its tiles may round the same dot product differently by column). float64
    inputs take one multiply-and-sum per logit, which does. Lower precisions accumulate a
    float64 product of their exactly representable values and round once to float32: equal
    keys then land on the same float32 unless a rounding boundary falls within float64's
    last-bit noise (about 2^-29 odds per pair).
    """
    if qg.dtype == torch.float64:
        return (qg.unsqueeze(-2) * kc[:, :, None, None]).sum(dim=-1)
    logits = torch.einsum("bhtgd,bhnd->bhtgn", qg.double(), kc.double())
    return logits.float()


def topn_blocks(
    scores: torch.Tensor, num_selected: int, sel_block: int, *, q_start: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose n blocks per (b, t, group): the forced ones, then the best scores.

    Block j is valid for the query at t iff ``j*l' <= t``. Forced: the valid members of
    {0, t // l', t // l' - 1}. The other slots go to the highest scores among valid, non-forced
    blocks, ties to the lower j. Fewer than n valid blocks: all valid blocks.

    Args:
        scores: [B, Tq, H, Nsel] with Nsel >= ceil((q_start + Tq) / l').
        num_selected: n.

    Returns:
        indices [B, Tq, H, n] int32, ascending, padded with -1 at the end; counts [B, Tq, H] int32.
    """
    check_topn_blocks(scores, num_selected, sel_block, q_start=q_start)
    batch, tq, h, n_sel = scores.shape
    t = torch.arange(q_start, q_start + tq, device=scores.device)
    jt = torch.div(t, sel_block, rounding_mode="floor").unsqueeze(1)  # [Tq, 1]
    j = torch.arange(n_sel, device=scores.device).unsqueeze(0)  # [1, Nsel]
    valid = (j <= jt).unsqueeze(1)  # [Tq, 1, Nsel], broadcast over heads
    forced = valid & ((j == 0) | (j == jt) | (j == jt - 1)).unsqueeze(1)
    inf = float("inf")  # a Python scalar: no host-to-device copy, so graph capture works
    # docs/spec.md, "Non-finite values": a non-finite score ranks below every finite one (it
    # sorts with the invalid blocks, which all lie above t // l', so valid ones still come first
    # by j) and never displaces a forced block.
    ranked = valid & torch.isfinite(scores)
    key = torch.where(forced, inf, torch.where(ranked, scores, -inf))
    # A stable descending sort keeps equal scores in ascending j: the tie rule.
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    take = min(num_selected, n_sel)
    top = order[..., :take]
    chosen = valid.expand(batch, tq, h, n_sel).gather(-1, top)
    top = torch.where(chosen, top, torch.full_like(top, n_sel)).sort(dim=-1).values
    top = torch.where(top == n_sel, torch.full_like(top, -1), top)
    if take < num_selected:
        top = torch.nn.functional.pad(top, (0, num_selected - take), value=-1)
    return top.to(torch.int32), chosen.sum(dim=-1).to(torch.int32)


@validated_by(check_select_blocks)
def select_blocks(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    cmp_block: int,
    cmp_stride: int,
    sel_block: int,
    num_selected: int,
    scale: float | None = None,
    *,
    q_start: int = 0,
    cu_seqlens: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Score the selection blocks and pick n per query and group (chunked over queries).

    Args:
        q: [B, Tq, HQ, dk]; row r at position q_start + r.
        k_cmp: [B, N, H, dk] compressed keys (packed per sequence when varlen).
        cu_seqlens: int32 [S+1] for packed sequences (B == 1, q_start == 0); indices are local
            to each sequence.
        lse: optional, the compressed branch's normaliser for the same q, k_cmp, scale,
            q_start and cu_seqlens: float32 [B, Tq, HQ], natural log, -inf on rows that see no
            block (what :func:`nsa_core.ops.compressed_attention_with_lse` returns). A backend
            that can use it skips its own normaliser pass; the reference checks it and does not
            read it: the spec defines the scores from its own compressed softmax.

    Selection takes no gradient: q, k_cmp and lse are read detached. GPU backends keep the
    index contract of docs/spec.md.

    Returns:
        indices [B, Tq, H, n] int32 ascending, -1 padded; counts [B, Tq, H] int32.
    """
    batch, tq, hq, _ = q.shape
    q, k_cmp = q.detach(), k_cmp.detach()
    if cu_seqlens is not None:
        cmp_cu = cmp_cu_seqlens(cu_seqlens, cmp_block, cmp_stride)
        parts = [
            select_blocks_impl(
                q[:, s:e], k_cmp[:, cs:ce], cmp_block, cmp_stride, sel_block, num_selected, scale
            )
            for (s, e), (cs, ce) in zip(spans(cu_seqlens), spans(cmp_cu), strict=True)
        ]
        h = k_cmp.shape[2]
        if not parts:
            empty = torch.zeros(batch, 0, h, dtype=torch.int32, device=q.device)
            return empty.unsqueeze(-1).expand(batch, 0, h, num_selected), empty
        return torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1)
    n_sel = num_sel_blocks(q_start + tq, sel_block)
    chunk = query_chunk(hq * (k_cmp.shape[1] + n_sel) + 2 * n_sel)
    indices, counts = [], []
    for c0, c1 in query_chunks(max(tq, 1), chunk):
        c1 = min(tq, c1)
        s = block_scores(
            q[:, c0:c1], k_cmp, cmp_block, cmp_stride, sel_block, scale, q_start=q_start + c0
        )
        s = torch.nn.functional.pad(s, (0, n_sel - s.shape[-1]))
        i, c = topn_blocks(s, num_selected, sel_block, q_start=q_start + c0)
        indices.append(i)
        counts.append(c)
    return torch.cat(indices, 1), torch.cat(counts, 1)


# The body without the checks: the registry's reference backend (ValidatedOp).
select_blocks_impl = select_blocks.body
