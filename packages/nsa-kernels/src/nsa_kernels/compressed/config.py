"""Launch configuration of the interval kernels (compressed branch, and the sliding branch that
runs them with l = d = 1 and a window): tiles, warps and stages.

:class:`CmpConfig` holds them (0 = choose) and :func:`resolve_config` fills them in for the head
dims, the dtype, the branch and the device's shared memory. Plain Python and torch: no triton
import here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from nsa_kernels.common.tile_config import TileConfig, check_pow2_tiles, pow2, stages_within

# Shared memory (bytes) the 16-bit default tiles ask at the stage counts where it binds, as
# compiling them for sm_89 reports (ci/compile_triton.py): a device with less per block takes
# fewer stages (:func:`resolve_config`).
FWD_STAGE_BYTES_D128 = {3: 114_688}
# The compressed forward's 128-block key tile on two stages (16 bits, D <= 128), compiled for
# sm_90 (the containing variant, the larger of the two): Hopper holds it, an A100 does not (and
# on sm_80 and sm_89 it spills besides).
FWD_WIDE_TILE_BYTES = 196_608
FWD_STAGE_BYTES_D256 = {2: 131_072}
# The sliding forward at D <= 128 in 16 bits (rows, keys, warps, stages): each query tile walks
# only the w + TPP - 1 keys of its window, so smaller tiles (4 tokens x 16 heads) on one warp
# group fill the SMs better (docs/results/2026-11-26-h100-layer-4.md). Two stages fit every
# device.
WINDOWED_FWD_D128 = (64, 64, 4, 2)
# Its dq likewise (rows, keys, warps, stages): 64-row tiles on one warp group, for the same
# reason (docs/results/2026-11-26-h100-layer-5.md).
WINDOWED_DQ_D128 = (64, 64, 4, 2)
DQ_STAGE_BYTES_D256 = {3: 102_400}
# The sliding dq at D = 256 (rows, keys, warps, stages): 128-row tiles on two warp groups beat
# 64 x 32 with the same dq, bit for bit (docs/results/2026-11-26-h100-layer-7.md). Compiled for
# sm_90 the tile spills nothing; for sm_80 and sm_89 it spills, so a device with less shared
# memory per block than it asks on sm_90 (WINDOWED_DQ_D256_BYTES: an A100) keeps 64 x 32.
WINDOWED_DQ_D256 = (128, 32, 8, 3)
WINDOWED_DQ_D256_BYTES = 172_032
# dk/dv tiles (key blocks, query rows per step) at D = 256 in 16 bits, fastest first at the
# paper's shapes (dk = 192, dv = 128), each with the shared memory it asks compiled for sm_80 and
# sm_89 (sm_90 asks more, within what it has). The sliding branch takes them from the second on
# (128 x 32 was its fastest).
DKV_TILES_D256 = ((128, 64, 164_352), (128, 32, 131_328), (64, 64, 107_008), (64, 32, 78_080))
DKV_TILES_D256_WINDOWED = DKV_TILES_D256[1:]
# Values 256 wide as well (dv > 128; the tables above hold at dv <= 128): the bytes the 16-bit
# tiles ask at dk = dv = 256 compiled for sm_80 and sm_89 (ci/compile_triton.py). The dk/dv
# kernel's 128 x 64 tile asks more than an H100 has on sm_90 and fails to launch there
# (docs/results/2026-11-26-h100-layer-6.md), so it is not listed. A forward of 128 x 64 tiles
# does not fit 99 KiB even on one stage: such a device takes 32-block key tiles (one stage
# fits).
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
            0 chooses from the SM count (:func:`nsa_kernels.compressed.tiles.segment_rows`).
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


# ``"block_m=64,fwd_warps=4"`` -> CmpConfig (unnamed fields keep 0 = choose).
parse_config = CmpConfig.parse

_TILE_FIELDS = ("block_m", "block_n", "dq_block_m", "dq_block_n", "dkv_block_n", "dkv_block_m")
# The fields resolve_config fills, in the order of its tables.
_TABLE_FIELDS = (
    "block_m", "block_n", "fwd_warps", "fwd_stages",
    "dq_block_m", "dq_block_n", "dq_warps", "dq_stages",
    "dkv_block_n", "dkv_block_m", "dkv_warps", "dkv_stages",
)  # fmt: skip


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
    on SM 9.0 (ptxas) and every launch fits Hopper's shared memory; ``windowed``: the sliding
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
    (FWD_WIDE_TILE_BYTES: Hopper), else the bracketed 64-block tiles; the sliding branch's short
    walks keep 64-key tiles, on 64-row tiles (WINDOWED_FWD_D128). The 16-bit rows are the
    fastest of sweeps at the paper's shapes (docs/results/2026-11-26-h100-h200.md,
    docs/results/2026-11-26-h200-layer.md): the compressed backward on 128-block key tiles with
    64-row steps, the sliding backward with three dk/dv stages; at dk = 192 see
    DKV_TILES_D256.

    ``shared_bytes``: the device's shared memory per block
    (:func:`nsa_kernels.common.triton_inputs.max_shared_bytes`; None: no limit). The 16-bit
    stage counts and D = 256 dk/dv tiles above are the most; a device with less shared memory
    (sm_86, sm_89: 99 KiB) takes fewer stages (the ``*_STAGE_BYTES`` tables) and the fastest
    dk/dv tile that fits (``DKV_TILES_D256``): at D <= 128 a two-stage forward; at D = 256 a
    one-stage forward, a two-stage dq and 64 x 32 dk/dv tiles.
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
    filled = zip(_TABLE_FIELDS, table, strict=True)
    return replace(cfg, **{name: getattr(cfg, name) or value for name, value in filled})


def _fitting_tile(
    tiles: tuple[tuple[int, int, int], ...], shared_bytes: int | None
) -> tuple[int, int]:
    """The first (key blocks, query rows) of ``tiles`` whose bytes fit ``shared_bytes`` (None:
    the first), else 32 x 32, which fits 99 KiB at every head dim."""
    fits = [(n, m) for n, m, need in tiles if shared_bytes is None or need <= shared_bytes]
    return fits[0] if fits else (32, 32)
