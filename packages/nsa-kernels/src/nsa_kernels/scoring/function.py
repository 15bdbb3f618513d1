"""Block scoring and top-n selection on Triton: the weights, the tile choice and the launch.

:func:`select_blocks_triton` has the signature and the contract of the reference
``nsa_core.reference.selection.select_blocks`` (docs/spec.md, "Selection scores", "Choosing
blocks"): ascending indices padded with -1, the forced blocks {0, jt-1, jt} as a set, the best
group-summed scores for the other slots, ties to the lower j. It takes one more argument,
``lse``, the compressed branch's log-sum-exp, which saves the kernel its normaliser pass. Its
indices equal the reference's under the index contract of docs/spec.md ("Block scoring on a
GPU: the index contract"), checked by :mod:`nsa_kernels.scoring.contract`.

One kernel launch, no host sync of its own (varlen tiles are built on the device), no
intermediate of size T x N_cmp or T x Nsel: it reads q, k_cmp (and lse) and writes the indices
and counts. Requirements beyond the reference: CUDA tensors (or CPU under ``TRITON_INTERPRET=1``),
dtype float16, bfloat16 or float32 (not bfloat16 under the interpreter, whose bfloat16
``tl.dot`` is wrong), dk <= 256. float32 runs its dots with
``input_precision="ieee"`` (no TF32), which the contract's tolerance assumes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

from nsa_core.blocks import cmp_cu_seqlens
from nsa_core.checks import check_select_blocks
from nsa_kernels.common.tile_config import (
    TileConfig,
    check_config,
    check_pow2_tiles,
    pow2,
    stages_within,
)
from nsa_kernels.common.tile_table import tile_table
from nsa_kernels.common.traced_launch import launch
from nsa_kernels.common.triton_inputs import (
    MAX_HEAD_DIM,
    check_dtype,
    check_triton_runs,
    dot_precision,
    max_shared_bytes,
)
from nsa_kernels.common.triton_inputs import SUPPORTED_DTYPES as SUPPORTED_DTYPES
from nsa_kernels.scoring.kernels import LOG2E, score_topn_kernel

# Shifts of block scores by tl.gather need Triton >= 3.2; older ones take a one-hot contraction.
HAS_GATHER = hasattr(tl, "gather")
# Shared memory (bytes) the float32 kernel asks at two stages with dk = 192, G = 16, compiled
# for sm_89 (99 KiB per block; Triton 3.6, ci/compile_triton.py); one stage fits there.
STAGE_BYTES_FP32_WIDE = {2: 123_904}


@dataclass(frozen=True)
class ScoreConfig(TileConfig):
    """Tiles and launch parameters; 0 means "choose" (see :func:`resolve_config`).

    Attributes:
        block_rows: rows of each ``tl.dot`` = query tokens x query heads of one group (the
            group padded to a power of two); a power of two >= 16, raised to the padded group.
        block_sel: selection blocks per tile (power of two >= 16, raised to n and to the reach
            of a compressed block); a tile's dot has block_sel * pow2(l'/d) columns.
        block_lse: compressed blocks per tile of the normaliser pass (no ``lse`` given).
        warps, stages: the launch.
        shift: how scores move by whole selection blocks: 1 ``tl.gather``, 2 a one-hot
            contraction (any Triton 3), 0 chooses 1 where Triton has ``tl.gather``.
    """

    block_rows: int = 0
    block_sel: int = 0
    block_lse: int = 0
    warps: int = 0
    stages: int = 0
    shift: int = 0


@dataclass(frozen=True)
class PhaseWeights:
    """The overlap weights of docs/spec.md by phase (see :func:`phase_weights`).

    ratio: r = l'/d, the compressed blocks each selection block owns; reach: Q, the most
    selection blocks after its owner that a compressed block overlaps; weights: float32
    [Q + 1, pow2(r)], zero in the padding phases.
    """

    ratio: int
    reach: int
    weights: torch.Tensor


def phase_weights(cmp_block: int, cmp_stride: int, sel_block: int) -> PhaseWeights:
    """c[i, j] of docs/spec.md as a function of the phase of i and the distance j - owner(i).

    With r = l'/d and L = l/d, compressed block i = j0*r + m (0 <= m < r) starts inside
    selection block j0 and covers ``[i, i + L)`` in units of d; its overlap with selection
    block j0 + q, ``[(j0 + q) r, (j0 + q + 1) r)``, is ``min(L, r - m)`` for q = 0 and
    ``clamp(min(m + L - q r, r), 0)`` for q >= 1, independent of j0. It is nonzero up to
    q = Q = (L + r - 2) // r.
    """
    if cmp_block % cmp_stride or sel_block % cmp_stride:
        raise ValueError(
            f"cmp_stride ({cmp_stride}) must divide cmp_block ({cmp_block}) and "
            f"sel_block ({sel_block})"
        )
    ratio = sel_block // cmp_stride
    length = cmp_block // cmp_stride
    reach = (length + ratio - 2) // ratio
    m = torch.arange(pow2(ratio))
    q = torch.arange(reach + 1).unsqueeze(1)
    spill = torch.clamp(torch.minimum(m + length - q * ratio, torch.tensor(ratio)), min=0)
    own = torch.clamp(torch.minimum(torch.tensor(length), ratio - m), min=0)
    weights = torch.where(q == 0, own, spill)
    weights = torch.where(m < ratio, weights, torch.zeros_like(weights))
    return PhaseWeights(ratio=ratio, reach=reach, weights=weights.to(torch.float32))


def resolve_config(
    config: ScoreConfig | None,
    *,
    group: int,
    num_selected: int,
    weights: PhaseWeights,
    tq: int,
    dtype: torch.dtype,
    head_dim: int,
    shared_bytes: int | None = None,
) -> ScoreConfig:
    """Fill the zeros of ``config`` with the defaults, raised to what the kernel needs.

    Defaults (register use checked by compiling for sm_90: no spills in float16/bfloat16):
    128 rows per dot for float16/bfloat16 (8 tokens x 16 heads at G = 16; fewer when Tq holds
    fewer tokens, down to one token per tile for a decode row), 32 for float32 (its IEEE dots
    run on CUDA cores and hold their operands in registers); selection tiles of 128 owned
    compressed blocks at 128 < dk <= 192 (32 selection blocks at l' = 4d), 64 at dk <= 128
    (faster) and for dk > 192 (so that q and two stages of keys fit in shared memory), with at
    most 1024 (token, block) scores per tile (the running top-n sorts them in registers); 64
    blocks per tile of the normaliser pass; 4 warps on dots of at most 128 x 64 at dk <= 128,
    else 8 (4 warps spill on a wider dot or at dk = 192); 2 stages. At dk = 128 four warps fit
    three programs on an SM and measured faster; at dk = 192 they are slower
    (docs/results/2026-11-26-h200-layer-2.md).
    Whatever the request, block_rows holds the padded group, and block_sel is at least 16,
    pow2(n) (the running top-n merges NP-wide chunks of a tile) and pow2(Q) (a spill reaches
    one tile back at most). ``shared_bytes`` (the device's per block, None: no limit): float32
    at dk > 128 takes one stage where two ask more (STAGE_BYTES_FP32_WIDE; sm_86, sm_89).
    """
    cfg = config or ScoreConfig()
    check_pow2_tiles(cfg, ("block_rows", "block_sel", "block_lse"))
    if cfg.shift not in (0, 1, 2):
        raise ValueError(f"shift must be 0 (choose), 1 (tl.gather) or 2 (one-hot), got {cfg.shift}")
    if cfg.shift == 1 and not HAS_GATHER:
        raise ValueError("shift=1 needs tl.gather (Triton >= 3.2); use shift=2")
    heads = pow2(group)
    wide = 32 if dtype == torch.float32 else 128
    # pow2 of the tokens only below ``wide``: a longer (possibly symbolic, under torch.compile)
    # tq gives the same tile and must not be pinned by pow2.
    rows = max(cfg.block_rows or min(wide, heads * pow2(min(max(tq, 1), wide))), heads, 16)
    tokens = rows // heads
    # 64 columns at dk <= 128 measured faster than 128 at every T timed
    # (docs/results/2026-11-26-h100-h200.md); at dk = 192 that alone is slower.
    columns = 64 if head_dim <= 128 else 128 if head_dim <= 192 else 64
    sel = cfg.block_sel or min(max(16, columns // pow2(weights.ratio)), max(16, 1024 // tokens))
    stage_needs = STAGE_BYTES_FP32_WIDE if dtype == torch.float32 and head_dim > 128 else {}
    block_sel = max(sel, pow2(num_selected), pow2(weights.reach))
    dot_elements = rows * block_sel * pow2(weights.ratio)
    return ScoreConfig(
        block_rows=rows,
        block_sel=block_sel,
        block_lse=cfg.block_lse or 64,
        warps=cfg.warps or (4 if dot_elements <= 128 * 64 and head_dim <= 128 else 8),
        stages=cfg.stages or stages_within(2, stage_needs, shared_bytes),
        shift=cfg.shift or (1 if HAS_GATHER else 2),
    )


def parse_config(text: str) -> ScoreConfig:
    """``"block_rows=64,warps=4"`` -> ScoreConfig (unnamed fields keep 0 = choose)."""
    return ScoreConfig.parse(text)


def _log2(x: int) -> int:
    return x.bit_length() - 1


def _head_dim_chunks(dk: int) -> tuple[int, int]:
    """(BK1, BK2): powers of two >= 16 with BK1 + BK2 >= dk; BK2 = 0 when one chunk fits.

    dk = 192 -> (128, 64): no padding to 256. BK1 is the largest power of two <= dk.
    """
    first = max(16, 1 << (dk.bit_length() - 1))
    rest = dk - first
    return first, (max(16, pow2(rest)) if rest > 0 else 0)


def varlen_query_tiles(cu_seqlens: torch.Tensor, total: int, tokens: int) -> torch.Tensor:
    """int32 [ceil(total / tokens) + S, 2]: (sequence, first token) of each query tile.

    Tiles of ``tokens`` tokens never cross a sequence of the packed ``total`` tokens. The table
    is built on the device and sized from the shapes (a bound on the number of tiles), so it
    reads nothing back to the host. Rows are sorted by the position of the tile's last token,
    largest first (that tile walks the most blocks); padding rows are (-1, 0), at the end.
    """
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    bound = -(-total // tokens) + lengths.numel()
    # A tile's last token sees the most blocks: its position + 1 measures the work.
    return tile_table(
        lengths, tokens, bound, lambda seq, first: torch.minimum(first + tokens, lengths[seq])
    )


def select_blocks_triton(
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
    config: ScoreConfig | None = None,
    validated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Score the selection blocks and pick n per query and kv head, in one kernel.

    Args:
        q: [B, Tq, HQ, dk]; row r at position q_start + r (varlen: local to its sequence).
        k_cmp: [B, N, H, dk] compressed keys (packed per sequence when varlen, as
            ``nsa_core.blocks.cmp_cu_seqlens`` says).
        cmp_block, cmp_stride, sel_block: l, d, l' (d divides l and l').
        num_selected: n, forced blocks included.
        scale: softmax scale, default dk^-0.5.
        q_start: position of row 0 (chunked prefill, decode); 0 when varlen.
        cu_seqlens: int32 [S+1] for packed sequences (B == 1); indices are local to each.
        lse: optional float32 [B, Tq, HQ], the natural-log normaliser of the compressed
            branch's softmax (log sum_i exp(scale * q . k_cmp[i]) over the visible blocks,
            -inf where none is visible); without it the kernel computes it in a first pass.
        config: tiles and launch (:class:`ScoreConfig`).
        validated: nsa-core validated the call already (the registry's ``fn``); nothing is
            checked again.

    Returns:
        indices [B, Tq, H, n] int32 ascending, -1 padded; counts [B, Tq, H] int32.
    """
    if not validated:
        check_select_blocks(
            q, k_cmp, cmp_block, cmp_stride, sel_block, num_selected, scale, q_start=q_start,
            cu_seqlens=cu_seqlens, lse=lse,
        )  # fmt: skip
        check_config(config, ScoreConfig)
        check_dtype(q.dtype, "block scoring")
        if q.shape[-1] > MAX_HEAD_DIM:
            raise ValueError(f"head dim dk={q.shape[-1]} exceeds {MAX_HEAD_DIM}")
        check_triton_runs("q", q)
    batch, tq, hq, dk = q.shape
    h = k_cmp.shape[2]
    indices = torch.empty(batch, tq, h, num_selected, dtype=torch.int32, device=q.device)
    counts = torch.empty(batch, tq, h, dtype=torch.int32, device=q.device)
    if tq == 0:
        return indices, counts

    geometry = phase_weights(cmp_block, cmp_stride, sel_block)
    group = hq // h
    cfg = resolve_config(
        config,
        group=group,
        num_selected=num_selected,
        weights=geometry,
        tq=tq,
        dtype=q.dtype,
        head_dim=dk,
        shared_bytes=max_shared_bytes(q.device),
    )
    heads = pow2(group)
    tokens = cfg.block_rows // heads
    bk1, bk2 = _head_dim_chunks(dk)
    # The running top-n is NP >= 2 wide (a sort network needs one axis).
    top_width = max(2, pow2(num_selected))
    q = q if q.stride(-1) == 1 else q.contiguous()
    k_cmp = k_cmp if k_cmp.stride(-1) == 1 else k_cmp.contiguous()
    if cu_seqlens is None:
        dummy = torch.zeros(2, dtype=torch.int32, device=q.device)
        tiles, cu, cmp_cu = dummy, dummy, dummy
        num_tiles = batch * -(-tq // tokens)
    else:
        tiles = varlen_query_tiles(cu_seqlens, tq, tokens)
        cu = cu_seqlens
        cmp_cu = cmp_cu_seqlens(cu_seqlens, cmp_block, cmp_stride).to(torch.int32)
        num_tiles = tiles.shape[0]
    lse_arg = lse if lse is not None else counts
    lse_strides = lse.stride() if lse is not None else (0, 0, 0)
    score_scale = dk**-0.5 if scale is None else float(scale)
    launch(
        score_topn_kernel, (num_tiles, h),
        q, k_cmp, lse_arg, indices, counts, tiles, cu, cmp_cu,
        q.stride(0), q.stride(1), q.stride(2),
        k_cmp.stride(0), k_cmp.stride(1), k_cmp.stride(2),
        lse_strides[0], lse_strides[1], lse_strides[2],
        indices.stride(0), indices.stride(1), indices.stride(2),
        counts.stride(0), counts.stride(1),
        batch, tq, q_start, k_cmp.shape[1], score_scale * LOG2E,
        H=h, G=group, GP=heads, BT=tokens,
        DK=dk, BK1=bk1, BK2=bk2,
        CMP_BLOCK=cmp_block, CMP_STRIDE=cmp_stride, SEL=sel_block,
        R=geometry.ratio, RP=pow2(geometry.ratio), REACH=geometry.reach,
        BS=cfg.block_sel, BL=cfg.block_lse,
        NUM_SEL=num_selected, NP=top_width,
        LOG_BT=_log2(tokens), LOG_BS=_log2(cfg.block_sel), LOG_NP=_log2(top_width),
        HAS_LSE=lse is not None, VARLEN=cu_seqlens is not None,
        USE_GATHER=cfg.shift == 1, DOT_PREC=dot_precision(q.dtype),
        num_warps=cfg.warps, num_stages=cfg.stages, writes=(indices, counts),
    )  # fmt: skip
    return indices, counts
