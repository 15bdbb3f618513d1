"""NSA as flash-attn-style functionals: ``nsa_func`` and ``nsa_varlen_func``.

They take what ``flash_attn_func`` and ``flash_attn_varlen_func`` take (q, k, v in flash-attn's
layouts, a softmax scale, a window, packed sequences by cu_seqlens) and run the NSA attention
core (docs/spec.md). Head counts and head dims come from the tensors; the block geometry (l, d,
l', n, w) from an :class:`~nsa_core.config.NSAConfig`, the paper's defaults unless given. When
there are fewer queries than keys, the queries are the last positions of the key sequence
(flash-attn's causal alignment): a chunk of a prefill.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from itertools import pairwise

import torch
from torch import nn

from nsa_core.attention import branch_parts, check_nsa_attention
from nsa_core.checks import (
    check_attention_args,
    check_cu_seqlens,
    check_int,
    check_rank,
    check_scale,
    shape,
)
from nsa_core.config import NSAConfig
from nsa_core.core import run_attention_core
from nsa_core.limits import MAX_TOKENS
from nsa_core.reference.compress import compress_impl

KV = torch.Tensor | Mapping[str, torch.Tensor]


def call_config(
    config: NSAConfig | None,
    softmax_scale: float | None,
    window: int | None,
    q: torch.Tensor,
    k_sel: torch.Tensor,
    v_sel: torch.Tensor,
) -> NSAConfig:
    """The geometry of one call: ``config`` (None: the paper's defaults) with the heads and head
    dims of q [B, Tq, HQ, dk], k_sel [B, Tk, H, dk] and v_sel [B, Tk, H, dv], and the call's
    ``softmax_scale`` and ``window`` where given."""
    if config is None:
        config = NSAConfig()
    elif not isinstance(config, NSAConfig):
        raise TypeError(f"config must be an NSAConfig or None, got {type(config).__name__}")
    if window is not None:
        check_int("window", window, 1, MAX_TOKENS)
    _, _, hq, h, dk, dv = check_attention_args(
        q, k_sel, v_sel, k_name="k['sel']", v_name="v['sel']"
    )
    check_scale(softmax_scale, q.dtype, name="softmax_scale")
    return dataclasses.replace(
        config,
        num_q_heads=hq,
        num_kv_heads=h,
        head_dim_qk=dk,
        head_dim_v=dv,
        scale=config.scale if softmax_scale is None else float(softmax_scale),
        window=config.window if window is None else window,
    )


def mean_gates(q: torch.Tensor) -> torch.Tensor:
    """gates [..., HQ, 3] of 1/3 (in q's dtype) beside q [..., HQ, dk]: the mean of the three
    branches, the gates a call without them gets."""
    return torch.full((*q.shape[:-1], 3), 1 / 3, dtype=q.dtype, device=q.device)


def _run(
    q: torch.Tensor,
    ks: dict[str, torch.Tensor],
    vs: dict[str, torch.Tensor],
    gates: torch.Tensor,
    config: NSAConfig,
    phi_k: nn.Module | None,
    phi_v: nn.Module | None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """o [B, Tq, HQ, dv] of validated arguments: compression over all Tk keys, then the core
    with q at the last Tq positions (packed: Tq == Tk in every sequence)."""
    l_cmp, d = config.cmp_block, config.cmp_stride
    k_cmp = compress_impl(ks["cmp"], l_cmp, d, phi_k, cu_seqlens=cu_seqlens)
    v_cmp = compress_impl(vs["cmp"], l_cmp, d, phi_v, cu_seqlens=cu_seqlens)
    return run_attention_core(
        q, k_cmp, v_cmp, ks["sel"], vs["sel"], ks["win"], vs["win"], gates, config,
        q_start=ks["sel"].shape[1] - q.shape[1], cu_seqlens=cu_seqlens,
    )  # fmt: skip


def nsa_func(
    q: torch.Tensor,
    k: KV,
    v: KV,
    gates: torch.Tensor | None = None,
    *,
    config: NSAConfig | None = None,
    softmax_scale: float | None = None,
    window: int | None = None,
    phi_k: nn.Module | None = None,
    phi_v: nn.Module | None = None,
) -> torch.Tensor:
    """Causal NSA in flash-attn's dense layout, with fewer queries than keys allowed.

    Args:
        q: [B, Tq, HQ, dk], rotated; row r is position ``Tk - Tq + r`` (the last Tq positions of
            the keys, flash-attn's causal alignment): Tq < Tk is a chunk of a prefill.
        k, v: [B, Tk, H, dk] and [B, Tk, H, dv] shared by the three branches, or mappings
            ``{"cmp": ..., "sel": ..., "win": ...}`` of them, every branch with the same Tk.
        gates: [B, Tq, HQ, 3] in (0, 1), ordered (cmp, sel, win); None weighs each branch 1/3
            (their mean).
        config: the geometry l, d, l', n, w and the scale (None: NSAConfig's paper defaults);
            its head counts and head dims are replaced by the tensors'.
        softmax_scale: overrides the config's scale for this call (flash-attn's name).
        window: overrides the config's w for this call.
        phi_k, phi_v: learned compression (``CompressMLP``); None means the mean.

    Returns:
        o [B, Tq, HQ, dv], equal to the last Tq rows of the same call over all Tk queries. The
        arguments are validated once; compression runs over all Tk keys, then the attention
        core (:func:`nsa_core.core.attention_core`) with ``q_start = Tk - Tq``.
    """
    ks, vs = branch_parts(k, v)
    cfg = call_config(config, softmax_scale, window, q, ks["sel"], vs["sel"])
    gates = mean_gates(q) if gates is None else gates
    ks, vs = check_nsa_attention(q, ks, vs, gates, cfg, phi_k, phi_v, None, chunked=True)
    return _run(q, ks, vs, gates, cfg, phi_k, phi_v)


def _check_max_seqlen(name: str, value: object, lengths: list[int]) -> None:
    """``value`` is None or an int at least the longest of ``lengths`` (flash-attn sizes its
    launch by it, so an upper bound is what it means)."""
    if value is None:
        return
    longest = max(lengths, default=0)
    if check_int(name, value, 0) < longest:
        raise ValueError(f"{name} must be >= the longest sequence, {longest}, got {value}")


def nsa_varlen_func(
    q: torch.Tensor,
    k: KV,
    v: KV,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    gates: torch.Tensor | None = None,
    *,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    config: NSAConfig | None = None,
    softmax_scale: float | None = None,
    window: int | None = None,
    phi_k: nn.Module | None = None,
    phi_v: nn.Module | None = None,
) -> torch.Tensor:
    """Causal NSA over packed sequences in flash-attn's varlen layout.

    Args:
        q: [total_q, HQ, dk], rotated, sequence i in rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``.
        k, v: [total_k, H, dk] and [total_k, H, dv] (or mappings per branch, as :func:`nsa_func`
            takes them), sequence i in rows ``cu_seqlens_k[i]:cu_seqlens_k[i+1]``.
        cu_seqlens_q, cu_seqlens_k: int32 [S+1], from 0 to total_q and total_k, non-decreasing.
            Each sequence has Tq_i <= Tk_i; its queries are its last Tq_i positions, and its
            positions start at 0.
        gates: [total_q, HQ, 3] in (0, 1), ordered (cmp, sel, win); None weighs each branch 1/3.
        max_seqlen_q, max_seqlen_k: for flash-attn compatibility; checked when given (at least
            the longest sequence), not needed.
        config, softmax_scale, window, phi_k, phi_v: as :func:`nsa_func` takes them.

    Returns:
        o [total_q, HQ, dv]. Where cu_seqlens_q equals cu_seqlens_k the core runs its packed
        path once; otherwise each sequence runs through :func:`nsa_func`'s dense path in turn,
        the reference route for chunked varlen.
    """
    ks3, vs3 = branch_parts(k, v)
    check_rank("q", q, 3, "[total_q, HQ, dk]")
    for b in ks3:
        check_rank(f"k[{b!r}]", ks3[b], 3, "[total_k, H, dk]")
        check_rank(f"v[{b!r}]", vs3[b], 3, "[total_k, H, dv]")
    if gates is not None:
        check_rank("gates", gates, 3, "[total_q, HQ, 3]")
    q4 = q.unsqueeze(0)
    ks = {b: t.unsqueeze(0) for b, t in ks3.items()}
    vs = {b: t.unsqueeze(0) for b, t in vs3.items()}
    cfg = call_config(config, softmax_scale, window, q4, ks["sel"], vs["sel"])
    gates4 = mean_gates(q4) if gates is None else gates.unsqueeze(0)
    check_cu_seqlens(cu_seqlens_q, q.shape[0], 1, q.device, "cu_seqlens_q")
    check_cu_seqlens(cu_seqlens_k, ks["sel"].shape[1], 1, q.device, "cu_seqlens_k")
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if len(bounds_q) != len(bounds_k):
        raise ValueError(
            f"cu_seqlens_q {shape(cu_seqlens_q)} and cu_seqlens_k {shape(cu_seqlens_k)} must "
            "hold the same number of sequences"
        )
    spans = [
        (*span_q, *span_k)
        for span_q, span_k in zip(pairwise(bounds_q), pairwise(bounds_k), strict=True)
    ]
    lengths_q = [eq - sq for sq, eq, _, _ in spans]
    lengths_k = [ek - sk for _, _, sk, ek in spans]
    for i, (tq, tk) in enumerate(zip(lengths_q, lengths_k, strict=True)):
        if tq > tk:
            raise ValueError(
                f"sequence {i} has {tq} queries but {tk} keys: its queries are its last "
                "positions, so Tq_i <= Tk_i"
            )
    _check_max_seqlen("max_seqlen_q", max_seqlen_q, lengths_q)
    _check_max_seqlen("max_seqlen_k", max_seqlen_k, lengths_k)
    if bounds_q == bounds_k:
        ks, vs = check_nsa_attention(q4, ks, vs, gates4, cfg, phi_k, phi_v, cu_seqlens_q)
        return _run(q4, ks, vs, gates4, cfg, phi_k, phi_v, cu_seqlens_q)[0]
    ks, vs = check_nsa_attention(q4, ks, vs, gates4, cfg, phi_k, phi_v, None, chunked=True)
    outs = [
        _run(
            q4[:, sq:eq], {b: t[:, sk:ek] for b, t in ks.items()},
            {b: t[:, sk:ek] for b, t in vs.items()}, gates4[:, sq:eq], cfg, phi_k, phi_v,
        )[0]
        if eq > sq
        else q.new_zeros(0, cfg.num_q_heads, cfg.head_dim_v)
        for sq, eq, sk, ek in spans
    ]  # fmt: skip
    return torch.cat(outs, dim=0)
