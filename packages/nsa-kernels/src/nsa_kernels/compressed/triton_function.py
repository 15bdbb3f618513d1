"""Compressed attention on Triton: tile choice, the launches, and the autograd Function.

:func:`compressed_attention_triton` has the reference op's signature and semantics
(docs/spec.md, "Compressed branch"): query t sees compressed block i iff ``i*d + l - 1 <= t``,
softmax over the visible blocks, rows that see none give 0 and no gradient.
:func:`compressed_attention_triton_with_lse` also returns the log-sum-exp the block-scoring
kernel takes to skip its own normaliser pass.

Requirements beyond the reference: CUDA tensors (or CPU under ``TRITON_INTERPRET=1``), dtype
float16, bfloat16 or float32, dk and dv <= 256 (tiles are padded to powers of two and masked).
float32 runs every ``tl.dot`` with ``input_precision="ieee"`` (no TF32) to meet the float32 bound
of docs/spec.md; float16/bfloat16 multiply on tensor cores with float32 accumulation.

The launches never read device values on the host: packed sequences (``cu_seqlens``) reach the
kernels through tile tables built on the device, sized from the shapes alone.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ParamSpec

import torch
from torch.autograd.function import once_differentiable

from nsa_core.blocks import cmp_cu_seqlens, num_cmp_blocks
from nsa_core.checks import check_compressed_attention
from nsa_kernels.common.finite_flag import all_finite_flag, finite_path_launches
from nsa_kernels.common.forward_outputs import forward_outputs, no_visible_keys
from nsa_kernels.common.tile_config import TileConfig, check_pow2_tiles, pow2, stages_within
from nsa_kernels.common.tile_table import tile_table
from nsa_kernels.common.triton_inputs import MAX_HEAD_DIM as MAX_HEAD_DIM
from nsa_kernels.common.triton_inputs import SUPPORTED_DTYPES as SUPPORTED_DTYPES
from nsa_kernels.common.triton_inputs import (
    check_dtype,
    check_head_dims,
    dot_precision,
    max_shared_bytes,
    num_sms,
)
from nsa_kernels.compressed.triton_bwd import (
    cmp_bwd_dkv_kernel,
    cmp_bwd_dq_kernel,
    cmp_dkv_reduce_kernel,
)
from nsa_kernels.compressed.triton_fwd import LOG2E, cmp_fwd_kernel

_P = ParamSpec("_P")
# Fewest columns of a value tile whose last columns are masked (see _Launch.bv).
MIN_MASKED_VALUE_TILE = 64
# The dk/dv kernel aims at this many programs per SM, so the unequal key tiles balance out.
DKV_PROGRAMS_PER_SM = 4
# Fewest query rows one dk/dv program takes when a key tile is split over several programs.
MIN_SEGMENT_ROWS = 512
# Shared memory (bytes) the 16-bit default tiles ask per stage count where it is the binding
# limit, compiled for sm_89 (99 KiB per block; Triton 3.6, ci/compile_triton.py): a device with
# less per block takes fewer stages (:func:`resolve_config`).
FWD_STAGE_BYTES_D128 = {3: 114_688}
# The compressed forward's 128-block key tile on two stages (16 bits, D <= 128) asks this much
# compiled for sm_90 (its containing variant; the finite one asks 163,840 B): Hopper's 227 KiB
# hold it, an A100's 163 KiB do not (on sm_80 and sm_89 it spills besides).
FWD_WIDE_TILE_BYTES = 196_608
FWD_STAGE_BYTES_D256 = {2: 131_072}
# The sliding forward at D <= 128 in 16 bits (rows, keys, warps, stages): each query tile walks
# only the w + TPP - 1 keys of its window, so smaller tiles (4 tokens x 16 heads) on one warp
# group fill the SMs better. T = 64k, w = 512 on an H100: 4.02 ms on (128, 64, 8, 3), 3.65 on
# these (docs/results/2026-11-26-h100-layer-4.md). Two stages ask 80 KiB: every device fits.
WINDOWED_FWD_D128 = (64, 64, 4, 2)
# Its dq likewise (rows, keys, warps, stages): 64-row tiles on one warp group. T = 64k, w = 512
# on an H100, the sliding forward+backward against 128 x 64 on 8 warps: 15.92 / 16.75 ms and
# 16.01 / 16.33 (two interleaved sweeps, docs/results/2026-11-26-h100-layer-5.md).
WINDOWED_DQ_D128 = (64, 64, 4, 2)
DQ_STAGE_BYTES_D256 = {3: 102_400}
# The sliding dq at D = 256 (rows, keys, warps, stages): 128-row tiles on two warp groups. T = 64k
# / 16k, dk = 192, dv = 128, w = 512, G = 16 on an H100: the sliding forward+backward 25.23 /
# 6.43 ms against 32.49 / 8.40 on 64 x 32 (docs/results/2026-11-26-h100-layer-7.md, runs 13-14;
# dq bit for bit the same). Compiled for sm_90 it asks 172,032 B and spills nothing; for sm_80
# and sm_89 it spills (255 registers), so a device with less shared memory per block than
# that (an A100 has 166,912 B) keeps 64 x 32.
WINDOWED_DQ_D256 = (128, 32, 8, 3)
WINDOWED_DQ_D256_BYTES = 172_032
# dk/dv tiles (key blocks, query rows per step) at D = 256 in 16 bits, fastest first, each with
# the shared memory it asks compiled for sm_80 and sm_89 (sm_90 asks more, within its 227 KiB).
# T = 64k, dk = 192, dv = 128 on an H200: the compressed backward took 92.6 / 103.5 / 105.6 /
# 117.4 ms on these (180.4 on 32 x 32); the sliding forward+backward 36.7 ms on 128 x 32, 37.8
# on 64 x 64, 42.8 on 64 x 32 (54.2 on 32 x 32).
DKV_TILES_D256 = ((128, 64, 164_352), (128, 32, 131_328), (64, 64, 107_008), (64, 32, 78_080))
DKV_TILES_D256_WINDOWED = DKV_TILES_D256[1:]
# Values 256 wide as well (dv > 128; the tables above hold at dv <= 128): the bytes the 16-bit
# tiles ask at dk = dv = 256 compiled for sm_80 and sm_89 (Triton 3.7.1, ci/compile_triton.py).
# The dk/dv kernel's 128 x 64 tile asks 262,656 B on sm_90, past an H100's 232,448: it failed with
# OutOfResources there (docs/results/2026-11-26-h100-layer-6.md); every tile below ran on it.
# A forward of 128 x 64 tiles does not fit 99 KiB even on one stage: such a device takes 32-block
# key tiles (one stage fits).
FWD_STAGE_BYTES_WIDE_V = {2: 147_456, 1: 114_688}
FWD_NARROW_KEYS_WIDE_V = (128, 32, 8, 1)
DQ_STAGE_BYTES_WIDE_V = {3: 135_168, 2: 102_400}
DKV_TILES_WIDE_V = ((128, 32, 172_288), (64, 64, 139_776), (64, 32, 102_656))


@dataclass(frozen=True)
class CmpConfig(TileConfig):
    """Tiles and launch parameters; 0 means "choose" (see :func:`resolve_config`).

    Attributes:
        block_m: forward rows per program (query tokens x query heads of one group), a power of
            two >= 16. A group of G <= block_m heads takes block_m // G tokens per program; a
            larger group is split into chunks of block_m heads.
        block_n: forward compressed blocks per key tile (power of two >= 16).
        fwd_warps, fwd_stages: forward launch.
        dq_block_m, dq_block_n, dq_warps, dq_stages: the dq kernel, as the forward.
        dkv_block_n: compressed blocks per dk/dv program (power of two >= 16).
        dkv_block_m: query rows (tokens x heads) per step of the dk/dv kernel.
        dkv_warps, dkv_stages: dk/dv launch.
        dkv_segment: most query rows one dk/dv program walks; a key tile seen by more rows is
            split over several programs whose float32 partials are summed in a fixed order.
            0 chooses from the SM count (about DKV_PROGRAMS_PER_SM programs per SM).
    """

    block_m: int = 0
    block_n: int = 0
    fwd_warps: int = 0
    fwd_stages: int = 0
    dq_block_m: int = 0
    dq_block_n: int = 0
    dq_warps: int = 0
    dq_stages: int = 0
    dkv_block_n: int = 0
    dkv_block_m: int = 0
    dkv_warps: int = 0
    dkv_stages: int = 0
    dkv_segment: int = 0


def parse_config(text: str) -> CmpConfig:
    """``"block_m=64,fwd_warps=4"`` -> CmpConfig (unnamed fields keep 0 = choose)."""
    return CmpConfig.parse(text)


_TILE_FIELDS = ("block_m", "block_n", "dq_block_m", "dq_block_n", "dkv_block_n", "dkv_block_m")


def resolve_config(
    config: CmpConfig | None,
    dk: int,
    dv: int,
    dtype: torch.dtype,
    *,
    windowed: bool = False,
    shared_bytes: int | None = None,
) -> CmpConfig:
    """Fill the zeros of ``config`` with the defaults for head dims dk, dv and ``dtype``.

    Defaults (D = next power of two of max(dk, dv)), chosen so that no kernel spills registers
    on SM 9.0 (ptxas) and every launch fits 227 KiB of shared memory; ``windowed``: the sliding
    branch (l = d = 1 and a window), whose dk/dv programs walk a few hundred rows each:

    | case | forward (rows x blocks, warps, stages) | dq | dk/dv (blocks x rows) |
    |---|---|---|---|
    | 16-bit, D <= 128 | 128 x 128, 8, 2 (128 x 64, 8, 3) | 128 x 64, 8, 2 | 128 x 64, 8, 2 |
    | 16-bit, D <= 128, windowed | 64 x 64, 4, 2 | 64 x 64, 4, 2 | 128 x 32, 8, 3 |
    | 16-bit, D = 256 | 128 x 64, 8, 2 | 64 x 32, 8, 3 | 128 x 64, 8, 2 |
    | 16-bit, D = 256, windowed | 128 x 64, 8, 2 | 128 x 32, 8, 3 (Hopper) | 128 x 32, 8, 2 |
    | 16-bit, dv = 256 | 128 x 64, 8, 2 | 64 x 32, 8, 3 | 128 x 32, 8, 2 |
    | float32 (no tensor cores) | 32 x 16, 8, 2 | 32 x 16, 8, 2 | 16 x 16, 8, 2 |

    The compressed forward at D <= 128 takes 128-block key tiles where their two stages fit
    (FWD_WIDE_TILE_BYTES: Hopper), else the bracketed 64-block tiles: 10.38 -> 9.94 ms at
    T = 64k on an H200 (docs/results/2026-11-26-h200-layer-2.md); the sliding branch's short
    walks keep 64 (4.31 ms against 3.98 on 128), on 64-row tiles (WINDOWED_FWD_D128). The
    16-bit rows are the fastest of sweeps at T = 64k, HQ = 64, H = 4 on an H200
    (docs/results/2026-11-26-h100-h200.md, docs/results/2026-11-26-h200-layer.md): at d = 128
    the compressed branch's backward 67.0 -> 40.2 ms on 128-block key tiles, 35.5 ms with 64-row
    steps; the sliding branch's (w = 512) forward+backward 20.4 -> 17.8 ms with three dk/dv
    stages; at dk = 192 see DKV_TILES_D256.

    ``shared_bytes``: the device's shared memory per block (:func:`max_shared_bytes`; None: no
    limit). The 16-bit stage counts and D = 256 dk/dv tiles above are the most; a device with
    less shared memory (sm_86, sm_89: 99 KiB) takes fewer stages (the ``*_STAGE_BYTES`` tables)
    and the fastest dk/dv tile that fits (``DKV_TILES_D256``): at D <= 128 a two-stage
    forward; at D = 256 a one-stage forward, a two-stage dq and 64 x 32 dk/dv tiles.
    """
    cfg = config or CmpConfig()
    check_pow2_tiles(cfg, _TILE_FIELDS)
    if cfg.dkv_segment < 0:
        raise ValueError(f"dkv_segment must be >= 0, got {cfg.dkv_segment}")
    if dtype == torch.float32:
        table: tuple[int, ...] = (32, 16, 8, 2, 32, 16, 8, 2, 16, 16, 8, 2)
    elif pow2(max(dv, 16)) > 128:
        fwd: tuple[int, ...] = (128, 64, 8, stages_within(2, FWD_STAGE_BYTES_WIDE_V, shared_bytes))
        if shared_bytes is not None and shared_bytes < FWD_STAGE_BYTES_WIDE_V[1]:
            fwd = FWD_NARROW_KEYS_WIDE_V
        dq_stages = stages_within(3, DQ_STAGE_BYTES_WIDE_V, shared_bytes)
        dkv_n, dkv_m = _fitting_tile(DKV_TILES_WIDE_V, shared_bytes)
        table = (*fwd, 64, 32, 8, dq_stages, dkv_n, dkv_m, 8, 2)
    elif pow2(max(dk, 16)) > 128:
        fwd_stages = stages_within(2, FWD_STAGE_BYTES_D256, shared_bytes)
        dq_stages = stages_within(3, DQ_STAGE_BYTES_D256, shared_bytes)
        tiles = DKV_TILES_D256_WINDOWED if windowed else DKV_TILES_D256
        dkv_n, dkv_m = _fitting_tile(tiles, shared_bytes)
        hopper = shared_bytes is None or shared_bytes >= WINDOWED_DQ_D256_BYTES
        dq = WINDOWED_DQ_D256 if windowed and hopper else (64, 32, 8, dq_stages)
        table = (128, 64, 8, fwd_stages, *dq, dkv_n, dkv_m, 8, 2)
    elif windowed:
        table = (*WINDOWED_FWD_D128, *WINDOWED_DQ_D128, 128, 32, 8, 3)
    else:
        wide = shared_bytes is None or shared_bytes >= FWD_WIDE_TILE_BYTES
        keys, stages = (
            (128, 2) if wide else (64, stages_within(3, FWD_STAGE_BYTES_D128, shared_bytes))
        )
        table = (128, keys, 8, stages, 128, 64, 8, 2, 128, 64, 8, 2)
    names = (
        "block_m", "block_n", "fwd_warps", "fwd_stages",
        "dq_block_m", "dq_block_n", "dq_warps", "dq_stages",
        "dkv_block_n", "dkv_block_m", "dkv_warps", "dkv_stages",
    )  # fmt: skip
    return replace(
        cfg, **{name: getattr(cfg, name) or value for name, value in zip(names, table, strict=True)}
    )


def _fitting_tile(
    tiles: tuple[tuple[int, int, int], ...], shared_bytes: int | None
) -> tuple[int, int]:
    """The first (key blocks, query rows) of ``tiles`` whose bytes fit ``shared_bytes`` (None:
    the first), else 32 x 32, which fits 99 KiB at every head dim."""
    fits = [(n, m) for n, m, need in tiles if shared_bytes is None or need <= shared_bytes]
    return fits[0] if fits else (32, 32)


@dataclass(frozen=True)
class RowTiles:
    """How a query group is laid out on ``block_m`` rows: HPP heads x TPP tokens, NCH chunks."""

    heads: int
    tokens: int
    chunks: int


def row_tiles(group: int, block_m: int) -> RowTiles:
    heads = min(group, block_m)
    return RowTiles(heads=heads, tokens=block_m // heads, chunks=-(-group // heads))


@dataclass(frozen=True)
class _Launch:
    """The facts every launch of one call shares."""

    batch: int
    tq: int
    hq: int
    h: int
    dk: int
    dv: int
    num_blocks: int
    cmp_block: int
    cmp_stride: int
    q_start: int
    scale: float
    cu_seqlens: torch.Tensor | None
    cmp_cu: torch.Tensor | None
    # The sliding branch runs these kernels with l = d = 1 (blocks are tokens) and a window of
    # the last ``window`` keys; 0: no window (the compressed branch).
    window: int = 0
    # The sliding branch's local softmax for the selected branch (cmp_fwd_kernel's LOCAL): l';
    # 0: none.
    local_block: int = 0

    @classmethod
    def of_call(
        cls,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float | None,
        q_start: int,
        cu_seqlens: torch.Tensor | None,
        *,
        cmp_block: int,
        cmp_stride: int,
        cmp_cu: torch.Tensor | None,
        window: int = 0,
        local_block: int = 0,
    ) -> _Launch:
        """The facts of a validated call: q [B, Tq, HQ, dk], k [B, N, H, dk], v [B, N, H, dv]
        (N blocks, or tokens for the sliding branch)."""
        batch, tq, hq, dk = q.shape
        return cls(
            batch=batch, tq=tq, hq=hq, h=k.shape[2], dk=dk, dv=v.shape[3],
            num_blocks=k.shape[1], cmp_block=cmp_block, cmp_stride=cmp_stride, q_start=q_start,
            scale=dk**-0.5 if scale is None else float(scale), cu_seqlens=cu_seqlens,
            cmp_cu=cmp_cu, window=window, local_block=local_block,
        )  # fmt: skip

    @property
    def windowed(self) -> bool:
        return self.window > 0

    @property
    def group(self) -> int:
        return self.hq // self.h

    @property
    def bk(self) -> int:
        return pow2(max(self.dk, 16))

    @property
    def bv(self) -> int:
        tile = pow2(max(self.dv, 16))
        if self.dv != tile and tile < MIN_MASKED_VALUE_TILE:
            # A value tile of 16 or 32 columns with a masked tail (dv = 8, 24), beside a q/K tile
            # with one (dk not a multiple of 16), gave wrong outputs in 16 bits on an H100 and an
            # illegal address in the sliding forward (Triton 3.6;
            # docs/results/2026-11-26-h100-layer-6.md); dv = 40 on 64 columns was exact.
            return MIN_MASKED_VALUE_TILE
        return tile


def _prepare(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    cmp_block: int,
    cmp_stride: int,
    scale: float | None,
    q_start: int,
    cu_seqlens: torch.Tensor | None,
    config: CmpConfig | None,
) -> tuple[_Launch, CmpConfig]:
    """Validate like the reference op, then the kernels' own limits; collect the launch facts
    and fill the zeros of ``config`` for them (:func:`resolve_config`)."""
    check_compressed_attention(
        q, k_cmp, v_cmp, cmp_block, cmp_stride, scale, q_start=q_start, cu_seqlens=cu_seqlens
    )
    dk, dv = q.shape[3], v_cmp.shape[3]
    check_dtype(q.dtype, "compressed attention")
    check_head_dims(dk, dv)
    cmp_cu = None
    if cu_seqlens is not None:
        cmp_cu = cmp_cu_seqlens(cu_seqlens, cmp_block, cmp_stride).to(torch.int32)
    info = _Launch.of_call(
        q, k_cmp, v_cmp, scale, q_start, cu_seqlens,
        cmp_block=cmp_block, cmp_stride=cmp_stride, cmp_cu=cmp_cu,
    )  # fmt: skip
    return info, resolve_config(config, dk, dv, q.dtype, shared_bytes=max_shared_bytes(q.device))


def _query_tiles(info: _Launch, tokens: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """(varlen tile table or a dummy, number of query tiles) for ``tokens`` tokens per tile."""
    if info.cu_seqlens is None:
        return torch.zeros(2, dtype=torch.int32, device=device), info.batch * -(-info.tq // tokens)
    lengths = (info.cu_seqlens[1:] - info.cu_seqlens[:-1]).to(torch.int64)
    bound = -(-info.tq // tokens) + lengths.numel()
    # A tile's last token sees the most blocks: its position + 1 measures the work.
    table = tile_table(
        lengths, tokens, bound, lambda seq, first: torch.minimum(first + tokens, lengths[seq])
    )
    return table, bound


def _key_tiles(info: _Launch, blocks: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """(varlen tile table or a dummy, number of key tiles) for ``blocks`` blocks per tile."""
    if info.cu_seqlens is None or info.cmp_cu is None:
        dense_tiles = info.batch * -(-info.num_blocks // blocks)
        return torch.zeros(2, dtype=torch.int32, device=device), dense_tiles
    lengths = (info.cu_seqlens[1:] - info.cu_seqlens[:-1]).to(torch.int64)
    cmp_lengths = (info.cmp_cu[1:] - info.cmp_cu[:-1]).to(torch.int64)
    bound = -(-info.num_blocks // blocks) + lengths.numel()
    first_row = info.cmp_block - 1
    # The queries that see a tile's first block: the rows from its end token to the sequence end.
    table = tile_table(
        cmp_lengths,
        blocks,
        bound,
        lambda seq, first: (lengths[seq] - first * info.cmp_stride - first_row).clamp_min(0),
    )
    return table, bound


def _varlen_args(info: _Launch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if info.cu_seqlens is None or info.cmp_cu is None:
        dummy = torch.zeros(2, dtype=torch.int32, device=device)
        return dummy, dummy
    return info.cu_seqlens, info.cmp_cu


def _fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    info: _Launch,
    cfg: CmpConfig,
    *,
    into: tuple[torch.Tensor, torch.Tensor] | None = None,
    unless_finite: torch.Tensor | None = None,
    local: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o, lse) of the forward kernel, written into ``into`` when given.

    ``local`` (with ``info.local_block``, the sliding branch): (o_loc [B, Tq, HQ, dv], lse_loc
    [B, Tq, HQ]) at o's and lse's strides, receive each row's softmax over its forced blocks'
    keys (cmp_fwd_kernel's LOCAL).

    ``unless_finite``: an :func:`all_finite_flag`; launch the containing path alone, gated on
    it, so that its programs work only where the flagged tensors hold a non-finite value and
    otherwise leave ``into`` as it is (no host sync either way).
    """
    o, lse = into or forward_outputs(q, info.batch, info.tq, info.hq, info.dv)
    if (local is None) != (info.local_block == 0):
        raise ValueError("the local softmax's buffers come with info.local_block, and only then")
    if info.tq == 0:
        return o, lse
    if info.num_blocks == 0:
        if local is not None:
            no_visible_keys(*local)
        return no_visible_keys(o, lse)
    loc_o, loc_lse = local or (o, lse)
    if loc_o.stride() != o.stride() or loc_lse.stride() != lse.stride():
        raise ValueError("the local softmax's buffers take o's and lse's strides")
    layout = row_tiles(info.group, cfg.block_m)
    tiles, num_tiles = _query_tiles(info, layout.tokens, q.device)
    cu, cmp_cu = _varlen_args(info, q.device)
    grid = (num_tiles * info.h * layout.chunks,)
    # Two launches, one of which returns at once: see cmp_fwd_kernel (the finite path does not
    # contain non-finite values).
    finite_paths: tuple[bool, ...]
    if unless_finite is not None:
        finite, finite_paths = unless_finite, (False,)
    else:
        finite, finite_paths = finite_path_launches(True, v)
    for finite_path in finite_paths:
        cmp_fwd_kernel[grid](
            q, k, v, o, lse, loc_o, loc_lse, finite, tiles, cu, cmp_cu,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            o.stride(0), o.stride(1), o.stride(2),
            lse.stride(0), lse.stride(1),
            info.batch, info.tq, info.q_start, info.h, info.window, info.scale * LOG2E,
            G=info.group, HPP=layout.heads, TPP=layout.tokens, NCH=layout.chunks, BM=cfg.block_m,
            DK=info.dk, BK=info.bk, DV=info.dv, BV=info.bv,
            LBLK=info.cmp_block, DSTR=info.cmp_stride, BN=cfg.block_n,
            VARLEN=info.cu_seqlens is not None, WINDOWED=info.windowed, CONTAIN=not finite_path,
            DOT_PREC=dot_precision(q.dtype),
            LOCAL=local is not None, SEL=max(info.local_block, 1),
            num_warps=cfg.fwd_warps, num_stages=cfg.fwd_stages,
        )  # fmt: skip
    return o, lse


def segment_rows(info: _Launch, cfg: CmpConfig, tokens: int, num_sms: int) -> int:
    """Query rows per dk/dv program: cfg.dkv_segment, or from the work and the SM count.

    Without a setting: the (query row, key tile) pairs over DKV_PROGRAMS_PER_SM * num_sms
    programs, a multiple of ``tokens`` (rows per step), at least MIN_SEGMENT_ROWS; in windowed
    mode (the sliding branch) no split: every tile's rows, the whole sequence.

    The work is the number of (query row, key tile) pairs of one sequence of ``tq`` rows (for
    packed sequences an overestimate: it treats them as one sequence, which splits less).
    """
    if cfg.dkv_segment:
        return cfg.dkv_segment
    bn = cfg.dkv_block_n
    rows = info.tq
    if info.windowed:
        # A windowed key tile meets at most bn + w - 1 rows, and T / bn tiles share the work
        # evenly. Segments are absolute row ranges, so a split would allocate float32 partials
        # for every (tile, segment) pair, most never met (13.5 GiB at T = 128k, HQ = 64, H = 4,
        # d = 128, w = 512 on 132 SMs), and launch as many programs, most loading K/V for nothing.
        return max(rows, 1)
    pairs = 0
    for tile in range(-(-info.num_blocks // bn)):
        first = tile * bn * info.cmp_stride + info.cmp_block - 1 - info.q_start
        last = first + bn + info.window - 1 if info.windowed else rows
        pairs += max(0, min(rows, last) - max(0, first))
    work = pairs * info.batch * info.h
    seg = max(MIN_SEGMENT_ROWS, -(-work // (DKV_PROGRAMS_PER_SM * num_sms)))
    seg = -(-seg // tokens) * tokens
    return min(seg, max(rows, 1))


def _bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    info: _Launch,
    cfg: CmpConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if info.tq == 0 or info.num_blocks == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    do = do.contiguous()
    o = o.contiguous()
    delta = torch.empty_like(lse)
    lse2 = torch.empty_like(lse)
    cu, cmp_cu = _varlen_args(info, q.device)
    varlen = info.cu_seqlens is not None
    prec = dot_precision(q.dtype)

    layout = row_tiles(info.group, cfg.dq_block_m)
    tiles, num_tiles = _query_tiles(info, layout.tokens, q.device)
    cmp_bwd_dq_kernel[(num_tiles * info.h * layout.chunks,)](
        q, k, v, o, do, lse, delta, lse2, dq, tiles, cu, cmp_cu,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        lse.stride(0), lse.stride(1),
        info.batch, info.tq, info.q_start, info.h, info.window, info.scale * LOG2E, info.scale,
        G=info.group, HPP=layout.heads, TPP=layout.tokens, NCH=layout.chunks,
        BM=cfg.dq_block_m, DK=info.dk, BK=info.bk, DV=info.dv, BV=info.bv,
        LBLK=info.cmp_block, DSTR=info.cmp_stride, BN=cfg.dq_block_n,
        VARLEN=varlen, WINDOWED=info.windowed, DOT_PREC=prec,
        num_warps=cfg.dq_warps, num_stages=cfg.dq_stages,
    )  # fmt: skip

    bn = cfg.dkv_block_n
    layout = row_tiles(info.group, cfg.dkv_block_m)
    tiles, num_tiles = _key_tiles(info, bn, q.device)
    seg = segment_rows(info, cfg, layout.tokens, num_sms(q.device))
    num_segs = max(1, -(-info.tq // seg))
    parts = num_tiles * info.h * num_segs if num_segs > 1 else 1
    dk_part = torch.empty(parts, bn, info.bk, dtype=torch.float32, device=q.device)
    dv_part = torch.empty(parts, bn, info.bv, dtype=torch.float32, device=q.device)
    common = dict(
        DK=info.dk, BK=info.bk, DV=info.dv, BV=info.bv,
        LBLK=info.cmp_block, DSTR=info.cmp_stride, BN=bn, VARLEN=varlen,
        WINDOWED=info.windowed,
    )  # fmt: skip
    cmp_bwd_dkv_kernel[(num_segs * num_tiles * info.h,)](
        q, k, v, do, lse2, delta, dk, dv, dk_part, dv_part, tiles, cu, cmp_cu,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        do.stride(0), do.stride(1), do.stride(2),
        lse.stride(0), lse.stride(1),
        info.batch, info.tq, info.q_start, info.num_blocks, info.h, num_tiles, num_segs, seg,
        info.window, info.scale * LOG2E, info.scale,
        G=info.group, HPP=layout.heads, TPQ=layout.tokens, NCH=layout.chunks,
        BMQ=cfg.dkv_block_m, DOT_PREC=prec, **common,
        num_warps=cfg.dkv_warps, num_stages=cfg.dkv_stages,
    )  # fmt: skip
    if num_segs > 1:
        cmp_dkv_reduce_kernel[(num_tiles * info.h,)](
            dk, dv, dk_part, dv_part, tiles, cu, cmp_cu,
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            info.batch, info.tq, info.q_start, info.num_blocks, info.h, num_segs, seg, info.window,
            **common, num_warps=8,
        )  # fmt: skip
    return dq, dk, dv


def compressed_attention_fwd(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    cmp_block: int,
    cmp_stride: int,
    scale: float | None = None,
    *,
    q_start: int = 0,
    cu_seqlens: torch.Tensor | None = None,
    config: CmpConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward only: o [B, Tq, HQ, dv] in q's dtype, lse [B, Tq, HQ] float32 (natural log).

    Arguments as :func:`compressed_attention_triton_with_lse`; lse is -inf on rows that see no
    block.
    """
    info, cfg = _prepare(q, k_cmp, v_cmp, cmp_block, cmp_stride, scale, q_start, cu_seqlens, config)
    return _fwd(q.contiguous(), k_cmp.contiguous(), v_cmp.contiguous(), info, cfg)


def contain_non_finite_into(
    o: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    cmp_block: int,
    cmp_stride: int,
    scale: float | None = None,
    *,
    q_start: int = 0,
    finite: torch.Tensor | None = None,
) -> None:
    """Where k_cmp or v_cmp holds a non-finite value, overwrite o [B, Tq, HQ, dv] and lse
    [B, Tq, HQ] (float32) with this forward, which keeps such a value to the rows that see its
    block (docs/spec.md, "Non-finite values"); else leave them as they are.

    Decided on the device (one launch whose programs return at once when every value is
    finite), so a caller that computed o and lse with another kernel needs no host sync to
    honour the rule. Dense inputs; arguments as :func:`compressed_attention_triton_with_lse`.
    ``finite``: :func:`all_finite_flag` of k_cmp and v_cmp, where the caller has it (several
    calls over parts of one output), else computed here.
    """
    info, cfg = _prepare(q, k_cmp, v_cmp, cmp_block, cmp_stride, scale, q_start, None, None)
    k_cmp, v_cmp = k_cmp.contiguous(), v_cmp.contiguous()
    flag = all_finite_flag(k_cmp, v_cmp) if finite is None else finite
    _fwd(q.contiguous(), k_cmp, v_cmp, info, cfg, into=(o, lse), unless_finite=flag)


def compressed_attention_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    cmp_block: int,
    cmp_stride: int,
    scale: float | None = None,
    *,
    q_start: int = 0,
    cu_seqlens: torch.Tensor | None = None,
    config: CmpConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk_cmp, dv_cmp for the upstream gradient ``do [B, Tq, HQ, dv]`` (o, lse: forward)."""
    info, cfg = _prepare(q, k_cmp, v_cmp, cmp_block, cmp_stride, scale, q_start, cu_seqlens, config)
    return _bwd(
        do, q.contiguous(), k_cmp.contiguous(), v_cmp.contiguous(), o, lse.contiguous(), info, cfg
    )


class CompressedAttentionFunction(torch.autograd.Function):
    """(o, lse) of the compressed kernels for the launch facts ``info`` (either branch that
    runs them: compressed, or sliding with l = d = 1 and a window); o is differentiable in q
    and the keys and values, lse is not."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        info: _Launch,
        cfg: CmpConfig,
        local: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        o, lse = _fwd(q, k, v, info, cfg, local=local)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.info = info
        ctx.cfg = cfg
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    @once_differentiable
    def backward(
        ctx: Any, do: torch.Tensor, _dlse: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _bwd(do, q, k, v, o, lse, ctx.info, ctx.cfg)
        return dq, dk, dv, None, None, None


def attend_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, info: _Launch, cfg: CmpConfig,
    local: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(o, lse) through :class:`CompressedAttentionFunction` where a gradient is wanted, else
    the forward kernel alone. q [B, Tq, HQ, dk], k [B, N, H, dk], v [B, N, H, dv]; ``local``
    as :func:`_fwd` takes it (written, no gradient)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        o, lse = CompressedAttentionFunction.apply(q, k, v, info, cfg, local)  # type: ignore[no-untyped-call]
        assert isinstance(o, torch.Tensor)
        assert isinstance(lse, torch.Tensor)
        return o, lse
    return _fwd(q.contiguous(), k.contiguous(), v.contiguous(), info, cfg, local=local)


def compressed_attention_triton_with_lse(
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    cmp_block: int,
    cmp_stride: int,
    scale: float | None = None,
    *,
    q_start: int = 0,
    cu_seqlens: torch.Tensor | None = None,
    config: CmpConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compressed attention (docs/spec.md) on Triton and its log-sum-exp; the reference op's
    contract.

    Query row r sits at position ``t = q_start + r`` (varlen: positions restart at 0 in every
    sequence); head h (kv head ``h // G``) attends in one softmax to the compressed blocks i with
    ``i*d + l - 1 <= t``. A row that sees no block gives 0 and passes no gradient.

    Args:
        q: [B, Tq, HQ, dk]; k_cmp: [B, N, H, dk]; v_cmp: [B, N, H, dv]; float16, bfloat16 or
            float32, HQ a multiple of H, dk and dv <= 256.
        cmp_block, cmp_stride: l and d (d divides l).
        scale: softmax scale, default dk ** -0.5.
        q_start: position of q[:, 0] (dense only).
        cu_seqlens: int32 [S+1] over tokens for packed sequences (B == 1, q_start == 0); k_cmp
            and v_cmp packed per sequence as ``nsa_core.blocks.cmp_cu_seqlens`` says.
        config: tiles and launch parameters (default: :func:`resolve_config`).

    Returns:
        o [B, Tq, HQ, dv] in q's dtype (differentiable in q, k_cmp, v_cmp) and lse [B, Tq, HQ]
        float32: ``log sum_i exp(scale * q . k_cmp[i])`` over the visible blocks, -inf for rows
        that see none (no gradient flows through lse).
    """
    info, cfg = _prepare(q, k_cmp, v_cmp, cmp_block, cmp_stride, scale, q_start, cu_seqlens, config)
    return attend_with_lse(q, k_cmp, v_cmp, info, cfg)


def _output_only(
    with_lse: Callable[_P, tuple[torch.Tensor, torch.Tensor]], name: str, doc: str
) -> Callable[_P, torch.Tensor]:
    """``with_lse`` without its log-sum-exp: the same arguments, o alone."""

    def attend(*args: _P.args, **kwargs: _P.kwargs) -> torch.Tensor:
        return with_lse(*args, **kwargs)[0]

    attend.__name__ = attend.__qualname__ = name
    attend.__doc__ = doc
    # help() and inspect show the arguments of with_lse, and o alone as the result.
    signature = inspect.signature(with_lse).replace(return_annotation="torch.Tensor")
    attend.__signature__ = signature  # type: ignore[attr-defined]
    return attend


compressed_attention_triton = _output_only(
    compressed_attention_triton_with_lse,
    "compressed_attention_triton",
    """Compressed attention (docs/spec.md) on Triton; the reference op's contract.

    Arguments as :func:`compressed_attention_triton_with_lse`, whose o it returns:
    o [B, Tq, HQ, dv] in q's dtype, differentiable in q, k_cmp and v_cmp.
    """,
)


def attention_flops(
    batch: int,
    tq: int,
    hq: int,
    dk: int,
    dv: int,
    cmp_block: int,
    cmp_stride: int,
    q_start: int = 0,
) -> int:
    """Matmul FLOPs of the forward: 2 * B * HQ * (dk + dv) * sum over rows of N_cmp(t + 1)."""
    visible = sum(
        num_cmp_blocks(t + 1, cmp_block, cmp_stride) for t in range(q_start, q_start + tq)
    )
    return 2 * batch * hq * (dk + dv) * visible


__all__ = [
    "CmpConfig",
    "CompressedAttentionFunction",
    "attend_with_lse",
    "attention_flops",
    "compressed_attention_bwd",
    "compressed_attention_fwd",
    "compressed_attention_triton",
    "compressed_attention_triton_with_lse",
    "parse_config",
    "resolve_config",
    "row_tiles",
    "segment_rows",
    "tile_table",
]
