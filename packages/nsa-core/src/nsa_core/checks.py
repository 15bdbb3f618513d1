"""Argument checks of every public entry point, written once (docs/spec.md, "Argument rules").

The public ops (:mod:`nsa_core.ops`) and the reference bodies (:mod:`nsa_core.reference`) call the
``check_<op>`` validator of their op before anything else; backends then receive arguments that
passed it. The layer, the cache, the helpers of :mod:`nsa_core.blocks` and :mod:`nsa_core.reads`
and the context-parallel entries check with the functions here too (:class:`~nsa_core.NSAConfig`
and :class:`~nsa_core.Toggles` check their own fields: this module imports them). A failed check
raises ``TypeError`` (wrong kind of value) or ``ValueError`` (right kind, wrong value) and names
the argument and the rule.

Checks that read tensor values (cu_seqlens, block indices) copy them to the host: a device sync
on a GPU. They skip what torch.compile traces (values are not known there) and CUDA graph
captures (the eager call before the capture checked the same arguments).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
from collections.abc import Mapping
from typing import cast

import torch
import torch.distributed as dist

from nsa_core.block_math import cmp_cu_seqlens, num_cmp_blocks, num_sel_blocks
from nsa_core.config import NSAConfig
from nsa_core.limits import MAX_TOKENS
from nsa_core.op_context import OpContext, op_context
from nsa_core.toggles import get_toggles
from nsa_core.tracing import traced


def shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def check_rank(name: str, t: torch.Tensor, rank: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name} must have rank {rank} {layout}, got shape {shape(t)}")


def check_attention_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    k_name: str = "k",
    v_name: str = "v",
) -> tuple[int, int, int, int, int, int]:
    """Check q [B, Tq, HQ, dk], k [B, Tk, H, dk], v [B, Tk, H, dv]; -> (B, Tq, HQ, H, dk, dv)."""
    check_rank("q", q, 4, "[B, T, HQ, dk]")
    check_rank(k_name, k, 4, "[B, T, H, dk]")
    check_rank(v_name, v, 4, "[B, T, H, dv]")
    batch, tq, hq, dk = q.shape
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(
            f"batch sizes differ: q {shape(q)}, {k_name} {shape(k)}, {v_name} {shape(v)}"
        )
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"{k_name} {shape(k)} and {v_name} {shape(v)} differ in tokens or heads")
    h = k.shape[2]
    # Zero heads or zero head dims have no meaning (and would divide by zero in G and scale).
    for what, size, t_name, t in (
        ("query heads HQ", hq, "q", q),
        ("kv heads H", h, k_name, k),
        ("head dim dk", dk, "q", q),
        ("head dim dv", v.shape[3], v_name, v),
    ):
        if size < 1:
            raise ValueError(f"{what} must be >= 1, got {size} ({t_name} {shape(t)})")
    if hq % h != 0:
        raise ValueError(
            f"query heads HQ={hq} (q {shape(q)}) must be a multiple of kv heads H={h} "
            f"({k_name} {shape(k)})"
        )
    if k.shape[3] != dk:
        raise ValueError(f"head dims differ: q {shape(q)} has dk={dk}, {k_name} {shape(k)}")
    for name, t in ((k_name, k), (v_name, v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} dtype {t.dtype} differs from q dtype {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if not q.is_floating_point():
        raise TypeError(f"q must be a floating-point tensor, got {q.dtype}")
    return batch, tq, hq, h, dk, v.shape[3]


def check_q_start(q_start: int, tq: int, tk: int, k_name: str = "k") -> None:
    if q_start < 0:
        raise ValueError(f"q_start must be >= 0, got {q_start}")
    if q_start + tq > tk:
        raise ValueError(
            f"queries at positions [{q_start}, {q_start + tq}) need keys up to {q_start + tq - 1}, "
            f"but {k_name} holds {tk} tokens"
        )


def capturing(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on a GPU whose stream is capturing a CUDA graph (no host reads)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def check_cu_seqlens_kind(cu_seqlens: object, name: str = "cu_seqlens") -> torch.Tensor:
    """cu_seqlens is an int32 tensor [S+1] with S >= 1 (its values unread)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be an int32 tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{name} must be 1-D with at least 2 entries, got {shape(cu_seqlens)}")
    return cu_seqlens


def check_cu_seqlens_values(values: list[int], name: str = "cu_seqlens") -> None:
    """The values of a cu_seqlens: they start at 0 and never decrease."""
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    if any(b < a for a, b in itertools.pairwise(values)):
        raise ValueError(f"{name} must be non-decreasing, got {values}")


def check_cu_seqlens(
    cu_seqlens: torch.Tensor,
    total: int,
    batch: int,
    device: torch.device,
    name: str = "cu_seqlens",
) -> None:
    """cu_seqlens: int32 [S+1], starts at 0, non-decreasing, ends at ``total``; needs B == 1.

    ``name`` is the argument's name in the errors.
    """
    check_cu_seqlens_kind(cu_seqlens, name)
    if cu_seqlens.device != device:
        raise ValueError(f"{name} is on {cu_seqlens.device} but q is on {device}")
    if batch != 1:
        raise ValueError(f"varlen inputs pack sequences along T with B == 1, got B={batch}")
    if capturing(cu_seqlens):
        return  # the values live on the device; the eager call before capture checked them
    values = cu_seqlens.tolist()
    check_cu_seqlens_values(values, name)
    if values[-1] != total:
        raise ValueError(f"{name} must end at T={total}, got {values[-1]}")


def check_block_indices(
    block_indices: torch.Tensor,
    batch: int,
    tq: int,
    h: int,
    num_blocks: int,
    device: torch.device,
    *,
    check_range: bool = True,
) -> None:
    """block_indices [B, Tq, H, n]: integers in [-1, num_blocks), -1 meaning "no block".

    ``check_range`` reads the values on the host (a device sync on CUDA); callers that make
    out-of-range entries harmless on the device may skip it.
    """
    check_rank("block_indices", block_indices, 4, "[B, T, H, n]")
    if block_indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"block_indices must be int32 or int64, got {block_indices.dtype}")
    if tuple(block_indices.shape[:3]) != (batch, tq, h):
        raise ValueError(
            f"block_indices {shape(block_indices)} must be [B={batch}, T={tq}, H={h}, n]"
        )
    if block_indices.device != device:
        raise ValueError(f"block_indices is on {block_indices.device} but q is on {device}")
    if check_range and block_indices.numel() and values_readable(block_indices):
        lo, hi = int(block_indices.min()), int(block_indices.max())
        if lo < -1 or hi >= num_blocks:
            raise ValueError(
                f"block_indices must lie in [-1, {num_blocks}) (selection blocks of the keys), "
                f"got values in [{lo}, {hi}]"
            )


def values_readable(t: torch.Tensor) -> bool:
    """Whether a check may read ``t``'s values on the host: not while torch.compile traces it
    (its values are unknown) nor inside a CUDA graph capture."""
    return not traced(t) and not capturing(t)


def check_block_indices_per_sequence(
    block_indices: torch.Tensor, cu_seqlens: torch.Tensor, sel_block: int
) -> None:
    """Varlen block_indices [1, T, H, n]: row t's entries lie in [-1, ceil(L_s / l')) for the
    sequence s that holds token t (docs/spec.md: varlen indices count the selection blocks of
    their own sequence), with cu_seqlens [S+1] checked already.

    Reads the indices on the host (a device sync on a GPU), one comparison over all rows.
    """
    if not block_indices.numel() or not values_readable(block_indices):
        return
    bounds = cu_seqlens.to(torch.int64)
    lengths = bounds[1:] - bounds[:-1]  # [S]
    blocks = torch.div(lengths + sel_block - 1, sel_block, rounding_mode="floor")  # [S]
    # Each row's bound is the selection blocks of its own sequence.
    row_blocks = torch.repeat_interleave(blocks, lengths, output_size=block_indices.shape[1])
    idx = block_indices[0].to(torch.int64)  # [T, H, n]
    bad = (idx < -1) | (idx >= row_blocks.view(-1, 1, 1))
    if not bool(bad.any()):
        return
    t, head, col = (int(i) for i in bad.nonzero()[0])
    spans = list(itertools.pairwise(cu_seqlens.tolist()))
    seq = next(s for s, (start, end) in enumerate(spans) if start <= t < end)
    start, end = spans[seq]
    raise ValueError(
        f"block_indices must lie in [-1, {int(blocks[seq])}) in sequence {seq} (tokens "
        f"[{start}, {end}) of cu_seqlens, l'={sel_block}): varlen indices count the selection "
        f"blocks of their own sequence; got {int(idx[t, head, col])} at token {t}, kv head {head}"
    )


def check_int(name: str, value: object, minimum: int, maximum: int | None = None) -> int:
    """``value`` as an int in [minimum, maximum]; bools and floats (even 4.0) are refused.

    A symbolic int (torch.compile tracing shapes as symbols) passes as it is: the bounds become
    guards, and making it a Python int would pin the graph to its value.
    """
    if isinstance(value, torch.SymInt):
        if value < minimum or (maximum is not None and value > maximum):
            raise ValueError(f"{name} must be in [{minimum}, {maximum}], got {value}")
        return cast(int, value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if int(value) < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and int(value) > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return int(value)


def check_num_selected(num_selected: object, sel_block: int) -> int:
    """n >= 1 with n * l' <= 2^31 - 1: more blocks than any int32-addressed sequence holds.

    Within the bound the indices keep their n columns (-1 padded); beyond it the call would only
    fail in the allocator, so it is refused here (docs/spec.md, "Symbols").
    """
    return check_int("num_selected", num_selected, 1, max(1, MAX_TOKENS // sel_block))


def check_same_place(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """``t`` has the dtype and device of ``ref``."""
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} dtype {t.dtype} differs from {ref_name} dtype {ref.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")


def check_positive_real(name: str, value: object, kind: str = "a float") -> None:
    """``value`` is a finite real number > 0 (not a bool); ``kind`` names it in the TypeError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__} {value!r}")
    if not math.isfinite(float(value)) or float(value) <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {value}")


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype logits are scaled and rotary angles computed in for inputs of ``dtype``:
    float64 for float64, float32 otherwise (the reference and every kernel compute float16,
    bfloat16 and float32 inputs in float32; docs/spec.md)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# The normal numbers of each work dtype: a value outside rounds to 0 (or a subnormal, which
# GPUs flush to 0) or to inf in it, and the softmax or the rotation turns to NaN or garbage.
_NORMAL_RANGE = {
    dtype: (torch.finfo(dtype).tiny, torch.finfo(dtype).max)
    for dtype in (torch.float32, torch.float64)
}


def check_normal_in(name: str, value: float, dtype: torch.dtype, use: str) -> None:
    """``value`` (a finite real > 0) stays finite and > 0 in the work dtype of inputs of
    ``dtype`` (:func:`work_dtype`); ``use`` says what that dtype computes, for the message."""
    work = work_dtype(dtype)
    lo, hi = _NORMAL_RANGE[work]
    if not lo <= value <= hi:
        raise ValueError(
            f"{name} must be finite and > 0 in {work}, the dtype {use} for {dtype} inputs: "
            f"within [{lo}, {hi}], got {value}"
        )


def check_scale(scale: object, dtype: torch.dtype | None = None, *, name: str = "scale") -> None:
    """``scale`` is None (dk ** -0.5) or a finite real number > 0; given the inputs' ``dtype``,
    it must also be finite and > 0 in their work dtype (1e39 is finite in float64, not in the
    float32 that bfloat16, float16 and float32 logits are scaled in)."""
    if scale is None:
        return
    check_positive_real(name, scale, "a float or None")
    if dtype is not None:
        check_normal_in(name, float(cast(float, scale)), dtype, "logits are scaled in")


def check_config_numbers(config: NSAConfig, dtype: torch.dtype, name: str = "config") -> None:
    """The config's scale and rope_theta stay finite and > 0 in the work dtype of inputs of
    ``dtype`` (the config has no dtype, so its own check could only ask for float64)."""
    if config.scale is not None:
        check_normal_in(f"{name}.scale", config.scale, dtype, "logits are scaled in")
    check_normal_in(f"{name}.rope_theta", config.rope_theta, dtype, "rotary angles are computed in")


def per_head_context(x: torch.Tensor, *inputs: torch.Tensor) -> OpContext:
    """The routing context of an op over x [B, T, H, D] with one kind of head and one head dim
    (H = HQ, dk = dv = D); it needs a gradient where any of ``inputs`` (default: x) needs one."""
    return OpContext(
        device=x.device,
        dtype=x.dtype,
        seq_len=x.shape[1],
        num_q_heads=x.shape[2],
        num_kv_heads=x.shape[2],
        head_dim_qk=x.shape[3],
        head_dim_v=x.shape[3],
        requires_grad=torch.is_grad_enabled() and any(t.requires_grad for t in inputs or (x,)),
        varlen=False,
    )


def check_cmp_geometry(cmp_block: object, cmp_stride: object) -> tuple[int, int]:
    """l >= 1 and d >= 1 with d dividing l, l at most 2^31 - 1 (docs/spec.md, "Symbols")."""
    l_cmp = check_int("cmp_block", cmp_block, 1, MAX_TOKENS)
    d = check_int("cmp_stride", cmp_stride, 0)
    if d < 1 or l_cmp % d != 0:
        raise ValueError(f"cmp_stride ({d}) must be >= 1 and divide cmp_block ({l_cmp})")
    return l_cmp, d


def check_varlen_or_start(
    op: str,
    q: torch.Tensor,
    tk: int,
    q_start: object,
    cu_seqlens: torch.Tensor | None,
    *,
    keys_are_tokens: bool = True,
    k_name: str = "k",
) -> int:
    """q_start an int >= 0 that leaves room in the keys; varlen needs q_start == 0."""
    start = check_int("q_start", q_start, 0, MAX_TOKENS)
    batch, tq = q.shape[0], q.shape[1]
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, tq, batch, q.device)
        if start != 0:
            raise ValueError(f"varlen {op} needs q_start == 0, got {start}")
        if keys_are_tokens and tk != tq:
            raise ValueError(
                f"varlen {op} needs {k_name} with q's tokens: q has {tq}, {k_name} has {tk}"
            )
    elif keys_are_tokens:
        check_q_start(start, tq, tk, k_name)
    return start


def check_sel_block(sel_block: object) -> int:
    """l' >= 1, at most 2^31 - 1 (docs/spec.md, "Symbols")."""
    return check_int("sel_block", sel_block, 1, MAX_TOKENS)


def check_sel_geometry(sel_block: object, cmp_stride: int) -> int:
    """l' as :func:`check_sel_block` takes it, and divided by the checked stride d."""
    l_sel = check_sel_block(sel_block)
    if l_sel % cmp_stride != 0:
        raise ValueError(f"cmp_stride ({cmp_stride}) must divide sel_block ({l_sel})")
    return l_sel


def check_cmp_keys(
    op: str,
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    cmp_block: int,
    cmp_stride: int,
    q_start: int,
    cu_seqlens: torch.Tensor | None,
) -> None:
    """k_cmp holds every compressed block the queries can see (exactly, when varlen)."""
    if cu_seqlens is not None:
        capturing = cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing()
        if capturing:
            return
        expected = int(cmp_cu_seqlens(cu_seqlens, cmp_block, cmp_stride)[-1])
        if k_cmp.shape[1] != expected:
            raise ValueError(
                f"k_cmp holds {k_cmp.shape[1]} blocks but cu_seqlens {cu_seqlens.tolist()} "
                f"implies {expected} (l={cmp_block}, d={cmp_stride}) for {op}"
            )
        return
    needed = num_cmp_blocks(q_start + q.shape[1], cmp_block, cmp_stride)
    if k_cmp.shape[1] < needed:
        raise ValueError(
            f"queries up to position {q_start + q.shape[1] - 1} see {needed} compressed blocks, "
            f"but k_cmp holds {k_cmp.shape[1]}"
        )


def check_compressed_attention(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    cmp_block: object,
    cmp_stride: object,
    scale: object = None,
    *,
    q_start: object = 0,
    cu_seqlens: torch.Tensor | None = None,
) -> OpContext:
    """Every rule of ``compressed_attention``; raises on the first one broken. Returns the
    call's routing context (keys: the queries' last position + 1)."""
    check_attention_args(q, k_cmp, v_cmp, k_name="k_cmp", v_name="v_cmp")
    l_cmp, d = check_cmp_geometry(cmp_block, cmp_stride)
    check_scale(scale, q.dtype)
    start = check_varlen_or_start(
        "compressed_attention", q, k_cmp.shape[1], q_start, cu_seqlens, keys_are_tokens=False
    )
    check_cmp_keys("compressed_attention", q, k_cmp, l_cmp, d, start, cu_seqlens)
    return op_context(
        q, k_cmp, v_cmp, start + q.shape[1], varlen=cu_seqlens is not None, q_start=start
    )


def check_selected_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_indices: torch.Tensor,
    sel_block: object,
    scale: object = None,
    *,
    q_start: object = 0,
    cu_seqlens: torch.Tensor | None = None,
    check_range: bool | None = None,
) -> OpContext:
    """Every rule of ``selected_attention``; returns the call's routing context.

    ``check_range`` reads the indices' values (a device sync on CUDA); None reads them on a CPU
    and on CUDA only where NSA_SEL_CHECK_INDICES asks (the kernels treat out-of-range entries
    as -1). Varlen indices are checked per sequence: each row's against its own sequence's
    selection blocks.
    """
    batch, tq, _, h, _, _ = check_attention_args(q, k, v)
    if check_range is None:
        check_range = q.device.type == "cpu" or get_toggles().sel_check_indices
    l_sel = check_sel_block(sel_block)
    check_scale(scale, q.dtype)
    check_varlen_or_start("selected_attention", q, k.shape[1], q_start, cu_seqlens)
    check_block_indices(
        block_indices,
        batch,
        tq,
        h,
        num_sel_blocks(k.shape[1], l_sel),
        q.device,
        check_range=check_range and cu_seqlens is None,
    )
    if check_range and cu_seqlens is not None:
        check_block_indices_per_sequence(block_indices, cu_seqlens, l_sel)
    return op_context(q, k, v, k.shape[1], varlen=cu_seqlens is not None)


def check_sliding_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: object,
    scale: object = None,
    *,
    q_start: object = 0,
    cu_seqlens: torch.Tensor | None = None,
) -> OpContext:
    """Every rule of ``sliding_attention``; raises on the first one broken. Returns the call's
    routing context."""
    check_attention_args(q, k, v)
    check_int("window", window, 1, MAX_TOKENS)
    check_scale(scale, q.dtype)
    check_varlen_or_start("sliding_attention", q, k.shape[1], q_start, cu_seqlens)
    return op_context(q, k, v, k.shape[1], varlen=cu_seqlens is not None)


def check_select_blocks(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    cmp_block: object,
    cmp_stride: object,
    sel_block: object,
    num_selected: object,
    scale: object = None,
    *,
    q_start: object = 0,
    cu_seqlens: torch.Tensor | None = None,
    lse: object = None,
) -> OpContext:
    """Every rule of ``select_blocks`` (d must divide l' as well as l; lse None or float32
    [B, Tq, HQ] on q's device). Returns the call's routing context: selection takes no
    gradient, so it never asks for one."""
    check_attention_args(q, k_cmp, k_cmp, k_name="k_cmp", v_name="k_cmp")
    check_lse(lse, q)
    l_cmp, d = check_cmp_geometry(cmp_block, cmp_stride)
    l_sel = check_sel_geometry(sel_block, d)
    check_num_selected(num_selected, l_sel)
    check_scale(scale, q.dtype)
    start = check_varlen_or_start(
        "select_blocks", q, k_cmp.shape[1], q_start, cu_seqlens, keys_are_tokens=False
    )
    check_cmp_keys("select_blocks", q, k_cmp, l_cmp, d, start, cu_seqlens)
    ctx = op_context(q, k_cmp, k_cmp, start + q.shape[1], varlen=cu_seqlens is not None)
    return dataclasses.replace(ctx, requires_grad=False)


def check_lse(lse: object, q: torch.Tensor) -> None:
    """``lse`` is None or the compressed softmax's normaliser: float32 [B, Tq, HQ] like q."""
    if lse is None:
        return
    if not isinstance(lse, torch.Tensor):
        raise TypeError(f"lse must be a float32 tensor [B, Tq, HQ], got {type(lse).__name__}")
    if lse.dtype != torch.float32:
        raise TypeError(f"lse must be float32, got {lse.dtype}")
    if tuple(lse.shape) != tuple(q.shape[:3]):
        raise ValueError(f"lse {shape(lse)} must be [B, Tq, HQ] matching q {shape(q)}")
    if lse.device != q.device:
        raise ValueError(f"lse is on {lse.device} but q is on {q.device}")


def check_block_scores(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    cmp_block: object,
    cmp_stride: object,
    sel_block: object,
    scale: object = None,
    *,
    q_start: object = 0,
) -> None:
    """Every rule of ``block_scores``: the rules of ``select_blocks`` without n and varlen."""
    check_attention_args(q, k_cmp, k_cmp, k_name="k_cmp", v_name="k_cmp")
    l_cmp, d = check_cmp_geometry(cmp_block, cmp_stride)
    check_sel_geometry(sel_block, d)
    check_scale(scale, q.dtype)
    start = check_varlen_or_start(
        "block_scores", q, k_cmp.shape[1], q_start, None, keys_are_tokens=False
    )
    check_cmp_keys("block_scores", q, k_cmp, l_cmp, d, start, None)


def check_topn_blocks(
    scores: torch.Tensor, num_selected: object, sel_block: object, *, q_start: object = 0
) -> None:
    """Every rule of ``topn_blocks``: real scores [B, Tq, H, Nsel] covering every valid block."""
    check_rank("scores", scores, 4, "[B, T, H, Nsel]")
    if not scores.is_floating_point():
        raise TypeError(f"scores must be a floating-point tensor, got {scores.dtype}")
    l_sel = check_sel_block(sel_block)
    check_num_selected(num_selected, l_sel)
    start = check_int("q_start", q_start, 0, MAX_TOKENS)
    tq, n_sel = scores.shape[1], scores.shape[3]
    needed = num_sel_blocks(start + tq, l_sel)
    if n_sel < needed:
        raise ValueError(
            f"scores {shape(scores)} hold {n_sel} blocks; queries up to position "
            f"{start + tq - 1} need {needed}"
        )


def check_floating(name: str, t: torch.Tensor) -> None:
    """``t`` (a checked tensor) holds floating-point values."""
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")


def check_split_blocks(x: torch.Tensor, cmp_block: object, cmp_stride: object) -> None:
    """x [B, T, H, D] with the compression geometry l, d."""
    check_rank("x", x, 4, "[B, T, H, D]")
    check_cmp_geometry(cmp_block, cmp_stride)


def check_compress(
    x: torch.Tensor,
    cmp_block: object,
    cmp_stride: object,
    phi: object = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
) -> None:
    """Every rule of ``compress``: x [B, T, H, D] floating point (phi averages or learns from
    it), l and d, phi a module or None, cu_seqlens."""
    check_split_blocks(x, cmp_block, cmp_stride)
    check_floating("x", x)
    if phi is not None and not isinstance(phi, torch.nn.Module):
        raise TypeError(f"phi must be a torch.nn.Module or None, got {type(phi).__name__}")
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, x.shape[1], x.shape[0], x.device)


def check_apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: object) -> OpContext:
    """x [B, T, H, D] floating point with D even; positions [T] or [B | 1, T] integers on x's
    device; theta a finite real number > 0, also in the work dtype of x (:func:`work_dtype`).

    Returns the call's routing context: rotary embedding has one kind of head and one head dim,
    so it says HQ = H and dk = dv = D.
    """
    check_rank("x", x, 4, "[B, T, H, D]")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"rotary head_dim must be even, got x {shape(x)}")
    if not isinstance(positions, torch.Tensor):
        kind = type(positions).__name__
        raise TypeError(f"positions must be a torch.Tensor [T] or [B, T], got {kind}")
    if positions.is_floating_point() or positions.is_complex() or positions.dtype == torch.bool:
        raise TypeError(f"positions must hold integers, got {positions.dtype}")
    if positions.dim() not in (1, 2) or positions.shape[-1] != x.shape[1]:
        raise ValueError(f"positions {list(positions.shape)} do not match x's T={x.shape[1]}")
    if positions.dim() == 2 and positions.shape[0] not in (1, x.shape[0]):
        raise ValueError(f"positions {list(positions.shape)} must have 1 or B={x.shape[0]} rows")
    if positions.device != x.device:
        raise ValueError(f"positions is on {positions.device} but x is on {x.device}")
    check_positive_real("theta", theta)
    check_normal_in("theta", float(cast(float, theta)), x.dtype, "rotary angles are computed in")
    return per_head_context(x)


def check_gated_combine(
    o_cmp: torch.Tensor, o_sel: torch.Tensor, o_win: torch.Tensor, gates: torch.Tensor
) -> OpContext:
    """o_cmp, o_sel, o_win [B, T, HQ, dv] alike; gates [B, T, HQ, 3] of their dtype and device.

    Returns the call's routing context: the combine has no kv heads and one head dim, so it says
    H = HQ and dk = dv.
    """
    check_rank("gates", gates, 4, "[B, T, HQ, 3]")
    for name, o in (("o_cmp", o_cmp), ("o_sel", o_sel), ("o_win", o_win)):
        check_rank(name, o, 4, "[B, T, HQ, dv]")
        if o.shape != o_cmp.shape:
            raise ValueError(f"{name} {shape(o)} differs from o_cmp {shape(o_cmp)}")
        check_same_place(name, o, "o_cmp", o_cmp)
    if tuple(gates.shape) != (*o_cmp.shape[:3], 3):
        raise ValueError(f"gates {shape(gates)} must be [B, T, HQ, 3] matching {shape(o_cmp)}")
    check_same_place("gates", gates, "o_cmp", o_cmp)
    if not o_cmp.is_floating_point():
        raise TypeError(f"o_cmp must be a floating-point tensor, got {o_cmp.dtype}")
    return per_head_context(o_cmp, o_cmp, o_sel, o_win, gates)


# ------------------------------------------------------------------ helpers, layer, cache, groups


def check_device(name: str, device: object) -> torch.device | None:
    """``device`` as a torch.device (None stays None); anything else is refused by name."""
    if device is None:
        return None
    if not isinstance(device, (str, torch.device)):
        raise TypeError(
            f"{name} must be a torch.device, a str or None, got {type(device).__name__}"
        )
    try:
        return torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"{name} {device!r} is not a device: {err}") from None


def check_float_dtype(name: str, dtype: object) -> torch.dtype:
    """``dtype`` is a floating-point torch.dtype."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point torch.dtype, got {dtype!r}")
    return dtype


def check_length(name: str, value: object) -> int:
    """A count of tokens (or of the blocks they hold): an int in [0, 2^31 - 1]."""
    return check_int(name, value, 0, MAX_TOKENS)


def check_position(name: str, value: object) -> int:
    """A token position: an int in [0, 2^31 - 2] (no sequence holds more than 2^31 - 1 tokens)."""
    return check_int(name, value, 0, MAX_TOKENS - 1)


def check_config(config: object, name: str = "config") -> NSAConfig:
    """``config`` is an NSAConfig (its fields checked themselves when it was made)."""
    if not isinstance(config, NSAConfig):
        raise TypeError(f"{name} must be an NSAConfig, got {type(config).__name__}")
    return config


def check_block_geometry(cmp_block: object, cmp_stride: object, sel_block: object) -> None:
    """l, d and l' as docs/spec.md's "Symbols" has them: d divides l and l'."""
    _, d = check_cmp_geometry(cmp_block, cmp_stride)
    check_sel_geometry(sel_block, d)


def check_cmp_cu_seqlens(cu_seqlens: object, cmp_block: object, cmp_stride: object) -> None:
    """Every rule of :func:`nsa_core.blocks.cmp_cu_seqlens`: cu_seqlens an int32 tensor [S+1]
    from 0, non-decreasing, and the compression geometry l, d.

    The values are read on the CPU only: on a GPU that would be a device sync in the kernels
    that call it, after the op's validator has read the same cu_seqlens once
    (:func:`check_cu_seqlens`).
    """
    cu = check_cu_seqlens_kind(cu_seqlens)
    check_cmp_geometry(cmp_block, cmp_stride)
    if cu.device.type == "cpu" and values_readable(cu):
        check_cu_seqlens_values(cu.tolist())


def check_selected_reads(position: object, block_indices: object, sel_block: object) -> None:
    """Every rule of :func:`nsa_core.selected_reads`: a position, a list or tuple of block
    indices (ints >= -1, -1 meaning none) and l'."""
    check_position("position", position)
    if not isinstance(block_indices, (list, tuple)):
        raise TypeError(
            f"block_indices must be a list or tuple of ints, got {type(block_indices).__name__}"
        )
    for i, j in enumerate(block_indices):
        check_int(f"block_indices[{i}]", j, -1, MAX_TOKENS)
    check_sel_block(sel_block)


def check_branch_inputs(
    q: object, k: object, v: object, gates: object, branches: tuple[str, ...]
) -> None:
    """q [B, T, HQ, dk]; k and v mappings from each of ``branches`` to [B, T, H, dk] and
    [B, T, H, dv]; gates [B, T, HQ, 3]."""
    q = check_tensor_rank("q", q, 4, "[B, T, HQ, dk]")
    batch_tokens = q.shape[:2]
    ks, vs = (
        check_branch_mapping(name, parts, branches, layout)
        for name, parts, layout in (("k", k, "[B, T, H, dk]"), ("v", v, "[B, T, H, dv]"))
    )
    for b in branches:
        for name, t in ((f"k[{b!r}]", ks[b]), (f"v[{b!r}]", vs[b])):
            if t.shape[:2] != batch_tokens:
                raise ValueError(f"{name} {shape(t)} must hold q's [B, T] {list(batch_tokens)}")
        if ks[b].shape[3] != q.shape[3]:
            raise ValueError(f"head dims differ: q {shape(q)}, k[{b!r}] {shape(ks[b])}")
        if vs[b].shape[2] != ks[b].shape[2]:
            raise ValueError(f"k[{b!r}] {shape(ks[b])} and v[{b!r}] {shape(vs[b])} differ in heads")
    gates = check_tensor_rank("gates", gates, 4, "[B, T, HQ, 3]")
    if tuple(gates.shape) != (*q.shape[:3], 3):
        raise ValueError(f"gates {shape(gates)} must be [B, T, HQ, 3] matching q {shape(q)}")


def check_branch_mapping(
    name: str, parts: object, branches: tuple[str, ...], layout: str
) -> dict[str, torch.Tensor]:
    """``parts`` maps each of ``branches`` (and nothing else) to a rank-4 tensor ``layout``."""
    if not isinstance(parts, Mapping) or set(parts) != set(branches):
        kind = type(parts).__name__
        raise TypeError(f"{name} must be a mapping with keys {branches}, got {kind}")
    return {b: check_tensor_rank(f"{name}[{b!r}]", parts[b], 4, layout) for b in branches}


def check_tensor_rank(name: str, t: object, rank: int, layout: str) -> torch.Tensor:
    """:func:`check_rank` that returns the tensor it checked."""
    check_rank(name, cast(torch.Tensor, t), rank, layout)
    return cast(torch.Tensor, t)


def check_decode_stats(
    position: object,
    reads: tuple[tuple[str, object], ...],
    reads_expected: object,
) -> None:
    """A decode step's statistics: its position, the ``(name, [B, H] integer tensor)`` reads of
    each branch, all of one shape, and the spec's count, an int >= 0."""
    check_position("position", position)
    first_name, first = reads[0]
    for name, value in reads:
        t = check_tensor_rank(name, value, 2, "[B, H]")
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise TypeError(f"{name} must hold integer counts, got {t.dtype}")
        if t.shape != cast(torch.Tensor, first).shape:
            raise ValueError(
                f"{name} {shape(t)} differs from {first_name} {shape(cast(torch.Tensor, first))}"
            )
    check_int("reads_expected", reads_expected, 0)


def check_layer_input(
    x: object, hidden_size: int, weight: torch.Tensor, compute: torch.dtype
) -> torch.Tensor:
    """x [B, T, hidden] for a layer of ``hidden_size`` whose parameters have ``weight``'s dtype
    and device and that computes in ``compute`` (its :meth:`~nsa_core.NSAAttention.compute_dtype`):
    x comes in the layer's dtype or the compute dtype (docs/spec.md, "Decode")."""
    x = check_tensor_rank("x", x, 3, "[B, T, hidden]")
    if x.shape[-1] != hidden_size:
        raise ValueError(f"x {shape(x)} must end in hidden_size={hidden_size}")
    if x.dtype not in (weight.dtype, compute):
        if compute == weight.dtype:
            fix = f"cast the layer (layer.to({x.dtype})) or x"
            if x.dtype in (torch.float16, torch.bfloat16):
                fix += f", or run the layer under torch.autocast({weight.device.type!r}, {x.dtype})"
            raise TypeError(f"x dtype {x.dtype} differs from the layer's {weight.dtype}: {fix}")
        raise TypeError(
            f"x dtype {x.dtype} is neither the layer's {weight.dtype} nor the autocast dtype "
            f"{compute}: under autocast x comes in one of those two"
        )
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} but the layer is on {weight.device}")
    if x.shape[1] > MAX_TOKENS:
        raise ValueError(f"x {shape(x)} holds more than the {MAX_TOKENS} tokens int32 addresses")
    return x


def check_process_group(group: object) -> None:
    """``group`` is None (the default group) or a torch.distributed ProcessGroup, and
    torch.distributed is initialized: the context-parallel entries run collectives over it."""
    if not dist.is_available():
        raise ValueError("group: context parallelism needs torch.distributed; this torch lacks it")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}"
        )
    if not dist.is_initialized():
        raise ValueError(
            "group needs an initialized torch.distributed (None means its default group): call "
            "torch.distributed.init_process_group first"
        )


def check_cache_seqlens(cache_seqlens: object, batch: int) -> list[int]:
    """cache_seqlens, an integer tensor [B] of the tokens each sequence of a serving cache holds,
    as host ints, each in [0, 2^31 - 1]."""
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(
            f"cache_seqlens must be an integer torch.Tensor [B], got {type(cache_seqlens).__name__}"
        )
    if cache_seqlens.dtype.is_floating_point or cache_seqlens.dtype.is_complex:
        raise TypeError(f"cache_seqlens must hold integers, got {cache_seqlens.dtype}")
    if cache_seqlens.dtype == torch.bool:
        raise TypeError("cache_seqlens must hold integers, got torch.bool")
    if tuple(cache_seqlens.shape) != (batch,):
        raise ValueError(f"cache_seqlens {shape(cache_seqlens)} must be [B={batch}]")
    lengths = [int(n) for n in cache_seqlens.tolist()]
    for b, n in enumerate(lengths):
        check_int(f"cache_seqlens[{b}]", n, 0, MAX_TOKENS)
    return lengths
