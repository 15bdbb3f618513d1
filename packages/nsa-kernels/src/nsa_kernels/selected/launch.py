"""Launch configuration of the selected-branch kernels: tiles, checks, and the facts of a call.

:class:`SelConfig` holds the tiles and launch parameters (0 = choose), :func:`resolve_config`
fills them in, :func:`prepare` validates a call like the reference op and collects the
:class:`Launch` facts every kernel of the call shares; the resolved config says whether the
forward and dq load K/V through TMA descriptors (``tma``). Plain Python and torch: no triton
import here.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace

import torch

from nsa_core.checks import check_selected_attention
from nsa_core.toggles import Toggles, get_toggles
from nsa_kernels.common.entry_checks import check_toggles
from nsa_kernels.common.tile_config import (
    TileConfig,
    check_config,
    check_pow2_tiles,
    pow2,
    stages_within,
)
from nsa_kernels.common.triton_inputs import MAX_HEAD_DIM as MAX_HEAD_DIM
from nsa_kernels.common.triton_inputs import SUPPORTED_DTYPES as SUPPORTED_DTYPES
from nsa_kernels.common.triton_inputs import (
    check_dtype,
    check_head_dims,
    check_triton_runs,
    max_shared_bytes,
)
from nsa_kernels.common.triton_inputs import dot_precision as dot_precision
from nsa_kernels.common.triton_inputs import num_sms as num_sms

# dk over 128 (the paper's 192): the forward walks dk in 64-wide chunks where 64 divides it, not
# one 256-wide tile padded from 192 (no padded columns loaded or multiplied), and dq runs on two
# stages; both measured faster, forward and forward+backward (docs/performance.md).
WIDE_DK_CHUNK = 64
WIDE_DQ_STAGES = 2
# Shared memory (bytes) the dq kernel asks at two stages with dk over 128 (one 256-wide tile),
# G = 16, float32, compiled for sm_89 (Triton 3.6, ci/compile_triton.py): a 99 KiB device takes
# one stage. 16-bit asks 63,488 B, which every device holds.
DQ_WIDE_STAGE_BYTES_FP32 = {2: 126_976}
# The dk/dv kernel with keys and values both 256 wide, 16 bits, G = 16, compiled for sm_89 (Triton
# 3.7.1, ci/compile_triton.py): 32 rows per dot ask 102,784 B on two stages (114,688 on one),
# past a 99 KiB device's 101,376; 16 rows fit (84,160 B at most).
DKV_WIDE_ROWS_BYTES = 102_784
DKV_WIDE_ROWS_SMALL = 16


# The forward's forced-block prologue (nsa_kernels.selected.forced), by default on TMA devices up
# to G = FORCED_MAX_GROUP, FORCED_TOKENS query rows a program: it paid at small G, and gained
# nothing at G = 16, where each program already serves many rows (docs/performance.md).
FORCED_TOKENS = 16
FORCED_MAX_GROUP = 4


@dataclass(frozen=True)
class SelConfig(TileConfig):
    """Tiles and launch parameters; 0 means "choose" (see :func:`resolve_config`).

    Attributes:
        block_l: keys per tile of dq and dk/dv, a power of two >= 16 (a selected block is
            walked in ceil(l' / block_l) tiles).
        fwd_block_l: keys per tile of the forward, as block_l (default: block_l; with TMA at
            most 32).
        block_d: dk per ``tl.dot`` in the forward (a power of two >= 16; < dk splits q.k).
        block_dv: dv per forward program (< dv splits the output over programs, each reloading K).
        heads_per_prog: query heads one program serves (default: the whole group, G).
        fwd_warps, fwd_stages: forward launch.
        dq_warps, dq_stages: dq launch.
        dkv_warps, dkv_stages: dk/dv launch.
        dkv_rows: rows (query tokens x G heads) per ``tl.dot`` of the dk/dv kernel.
        segment_tokens: most queries one dk/dv program takes from one block.
        rows_per_prog: query rows one forward / dq program walks in turn (consecutive rows share
            their forced blocks, found in L1 by the later rows).
        kv_hint: L2 eviction hint of the K/V loads of forward and dq: 1 "evict_last" (keep K/V
            over the streamed q and o), 2 none.
        tma: K/V loads of the forward and dq: 1 through TMA tensor descriptors (dk a power of
            two in one tile), 2 pointer loads; 0 chooses TMA on GPUs with SM >= 9.0 where it
            applies (docs/selection.md); :func:`resolve_config` resolves it to 1 or 2. With
            TMA, the forward loads K whole, and V whole too where dv is one power-of-two tile
            and every value is finite; dq loads both whole where every key and value is finite
            (``sel_fwd_kernel`` and ``sel_bwd_dq_kernel`` say why), else through masked
            pointer loads.
        forced_tokens: query rows a program of the forward's forced-block prologue serves
            (:mod:`nsa_kernels.selected.forced`, where V comes through TMA, the group is whole
            in a program, G <= 16 and forced_tokens <= l'; :func:`resolve_config` gives 1
            elsewhere): a power of two; 1: no prologue (default: FORCED_TOKENS where
            G <= FORCED_MAX_GROUP, else 1).
        forced_warps: the prologue's launch (default 4).
    """

    block_l: int = 0
    fwd_block_l: int = 0
    block_d: int = 0
    block_dv: int = 0
    heads_per_prog: int = 0
    fwd_warps: int = 0
    fwd_stages: int = 0
    dq_warps: int = 0
    dq_stages: int = 0
    dkv_warps: int = 0
    dkv_stages: int = 0
    dkv_rows: int = 0
    segment_tokens: int = 0
    rows_per_prog: int = 0
    kv_hint: int = 0
    tma: int = 0
    forced_tokens: int = 0
    forced_warps: int = 0


def parse_config(text: str) -> SelConfig:
    """``"block_l=64,fwd_warps=4"`` -> SelConfig (unnamed fields keep 0 = choose)."""
    return SelConfig.parse(text)


def resolve_config(
    config: SelConfig | None,
    group: int,
    dk: int,
    dv: int,
    sel_block: int,
    toggles: Toggles | None = None,
    *,
    shared_bytes: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | None = None,
    local: bool = False,
) -> SelConfig:
    """Fill the zeros of ``config`` with the defaults (``toggles`` default: :func:`get_toggles`).

    ``local``: the forward starts from the sliding branch's local softmax (forward's
    ``local``), which covers the forced blocks 0, jt-1 and jt: the forced-block prologue is
    off.

    Defaults (tuned on an H100 at the paper's shapes, docs/selection.md): one key tile per
    selected block up to 64 keys (larger blocks are walked 64 at a time), the whole dk and dv in
    one tile (next power of two, masked), the whole group per program (NSA_SEL_TRITON_GROUP=0:
    one head per program); forward: 4 warps, 2 pipeline stages (more stages cost occupancy);
    dq: 4 warps, 3 stages; dk/dv: 4 warps, 2 stages, 32 rows (query tokens x heads) per dot.
    dk over 128 that is not a power of two but a multiple of 64 (the paper's 192): the forward
    walks dk in WIDE_DK_CHUNK-wide chunks rather than one padded tile; any dk over 128 runs dq
    (one 256-wide tile, as at 192) on WIDE_DQ_STAGES stages.
    ``tma``: 1 where :func:`device_takes_tma` says so for ``device`` and dk is one power-of-two
    tile, else 2. With TMA the forward takes other defaults (measured on an H200 at the paper's
    shapes, docs/selection.md): one warp per program where it serves at most 32 rows (a warp then
    owns every key column of its rows, so p reaches the second dot without a trip through shared
    memory), 3 stages, 16-key tiles where it serves at most 16 rows (G <= 16) and 32 above;
    dq on 2 warps where it serves at most 16 rows. The walk leaves out the tiles of the causal
    block past the row (:func:`nsa_kernels.selected.row_walk.walk_steps`), so smaller tiles
    skip more of it: 16 keys beat 32 where a program serves at most 16 rows, and lost above
    (docs/performance.md).
    ``shared_bytes``: the device's shared memory per block (None: no limit); at dk over 128 a
    device with less than DQ_WIDE_STAGE_BYTES_FP32 runs a float32 dq on one stage (sm_86 and
    sm_89, 99 KiB), and with dk and dv both over 128 in 16 bits one with less than
    DKV_WIDE_ROWS_BYTES runs dk/dv on DKV_WIDE_ROWS_SMALL rows per dot.
    """
    cfg = config or SelConfig()
    toggles = get_toggles() if toggles is None else toggles
    cfg = replace(
        cfg, heads_per_prog=cfg.heads_per_prog or (group if toggles.sel_triton_group else 1)
    )
    check_pow2_tiles(cfg, ("block_l", "fwd_block_l", "block_d", "block_dv"))
    if cfg.forced_tokens & (cfg.forced_tokens - 1):
        raise ValueError(f"forced_tokens must be a power of two, got {cfg.forced_tokens}")
    heads = min(cfg.heads_per_prog, group)
    rows = max(32, pow2(min(group, 64)))
    dk_tile, dv_tile = pow2(max(dk, 16)), pow2(max(dv, 16))
    chunked = dk != dk_tile and dk > 128 and dk % WIDE_DK_CHUNK == 0
    block_d = min(cfg.block_d or (WIDE_DK_CHUNK if chunked else dk_tile), dk_tile)
    tma = resolve_tma(cfg.tma, dk, block_d, device)
    block_l = cfg.block_l or max(16, min(64, pow2(sel_block)))
    if tma == 1:
        fwd_block_l = min(16 if pow2(heads) <= 16 else 32, block_l)
        fwd_warps, fwd_stages = (1 if pow2(heads) <= 32 else 4), 3
        dq_warps = 2 if pow2(heads) <= 16 else 4
    else:
        fwd_block_l, fwd_warps, fwd_stages, dq_warps = block_l, 4, 2, 4
    wide_needs = DQ_WIDE_STAGE_BYTES_FP32 if dtype == torch.float32 else {}
    dq_stages = stages_within(WIDE_DQ_STAGES, wide_needs, shared_bytes) if dk_tile > 128 else 3
    small = shared_bytes is not None and shared_bytes < DKV_WIDE_ROWS_BYTES
    if dk_tile > 128 and dv_tile > 128 and dtype != torch.float32 and small:
        rows = DKV_WIDE_ROWS_SMALL
    block_dv = min(cfg.block_dv or dv_tile, dv_tile)
    # The prologue needs V through TMA (dv one power-of-two tile, values_fit_tma), the whole
    # group in a program, G <= 16, and at most l' rows a program; elsewhere it is off.
    prologue_fits = (
        tma == 1 and block_dv == dv == dv_tile and heads == group <= 16
    )  # fmt: skip
    forced_tokens = cfg.forced_tokens or (FORCED_TOKENS if group <= FORCED_MAX_GROUP else 1)
    if local or not prologue_fits or forced_tokens > sel_block:
        forced_tokens = 1
    return replace(
        cfg,
        block_l=block_l,
        fwd_block_l=cfg.fwd_block_l or fwd_block_l,
        block_d=block_d,
        block_dv=block_dv,
        heads_per_prog=heads,
        fwd_warps=cfg.fwd_warps or fwd_warps,
        fwd_stages=cfg.fwd_stages or fwd_stages,
        dq_warps=cfg.dq_warps or dq_warps,
        dq_stages=cfg.dq_stages or dq_stages,
        dkv_warps=cfg.dkv_warps or 4,
        dkv_stages=cfg.dkv_stages or 2,
        dkv_rows=max(cfg.dkv_rows or rows, pow2(max(group, 16))),
        rows_per_prog=cfg.rows_per_prog or 1,
        kv_hint=cfg.kv_hint or 1,
        tma=tma,
        forced_tokens=forced_tokens,
        forced_warps=cfg.forced_warps or 4,
    )


def kv_hint(cfg: SelConfig) -> str:
    """The ``eviction_policy`` of the forward's and dq's K/V loads for ``cfg.kv_hint``."""
    if cfg.kv_hint not in (1, 2):
        raise ValueError(f"kv_hint must be 1 (evict_last) or 2 (none), got {cfg.kv_hint}")
    return "evict_last" if cfg.kv_hint == 1 else ""


@dataclass(frozen=True)
class Launch:
    """The facts every launch of one call shares, its resolved tiles included."""

    sel_block: int
    cfg: SelConfig
    batch: int
    tq: int
    hq: int
    h: int
    dk: int
    dv: int
    group: int
    n: int
    num_blocks: int
    q_start: int
    scale: float
    seq_ids: torch.Tensor | None
    cu_seqlens: torch.Tensor | None

    @property
    def rows(self) -> int:
        return self.batch * self.tq


def prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_indices: torch.Tensor,
    sel_block: int,
    scale: float | None,
    q_start: int,
    cu_seqlens: torch.Tensor | None,
    config: SelConfig | None,
    toggles: Toggles | None,
    *,
    local: bool = False,
    validated: bool = False,
) -> Launch:
    """Validate like the reference op, resolve the tiles and collect the launch facts.

    q [B, Tq, HQ, dk], k [B, Tk, H, dk], v [B, Tk, H, dv], block_indices [B, Tq, H, n],
    cu_seqlens int32 [S+1] or None; ``config`` and ``local`` as :func:`resolve_config` takes
    them. ``validated``: nsa-core validated the call already (its ops, the attention core), so
    nothing is checked again and nothing is read back from the device.

    Unvalidated calls get the reference op's rules (nsa_core's ``check_selected_attention``),
    then the kernels' own: a SelConfig and Toggles (or None), a dtype and device Triton runs
    (not bfloat16 under ``TRITON_INTERPRET=1``), head dims up to 256. The range of the indices is
    read only where NSA_SEL_CHECK_INDICES asks (a device sync); without it, out-of-range entries
    become -1 on the device (``unique_block_rows``), so the kernels never address keys outside
    the sequence.
    """
    if not validated:
        check_call(q, k, v, block_indices, sel_block, scale, q_start, cu_seqlens, config, toggles)
        check_triton_runs("q", q)
    batch, tq, hq, dk = q.shape
    h, dv = k.shape[2], v.shape[3]
    seq_ids = None
    if cu_seqlens is not None:
        num_blocks = -(-max(tq, 1) // sel_block)
        rows = torch.arange(tq, device=q.device, dtype=torch.int32)
        seq_ids = torch.searchsorted(cu_seqlens[1:], rows, right=True).to(torch.int32)
    else:
        num_blocks = -(-k.shape[1] // sel_block)
    return Launch(
        sel_block=sel_block,
        cfg=resolve_config(
            config,
            hq // h,
            dk,
            dv,
            sel_block,
            toggles,
            shared_bytes=max_shared_bytes(q.device),
            dtype=q.dtype,
            device=q.device,
            local=local,
        ),
        batch=batch,
        tq=tq,
        hq=hq,
        h=h,
        dk=dk,
        dv=dv,
        group=hq // h,
        n=block_indices.shape[-1],
        num_blocks=num_blocks,
        q_start=q_start,
        scale=dk**-0.5 if scale is None else float(scale),
        seq_ids=seq_ids,
        cu_seqlens=cu_seqlens,
    )


def check_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_indices: torch.Tensor,
    sel_block: int,
    scale: float | None,
    q_start: int,
    cu_seqlens: torch.Tensor | None,
    config: SelConfig | None,
    toggles: Toggles | None,
) -> None:
    """The rules of a call's own arguments (:func:`prepare`'s, but whether Triton runs here:
    ``check_triton_runs``, which a caller checks after any arguments of its own)."""
    check_toggles(toggles)
    strict = (get_toggles() if toggles is None else toggles).sel_check_indices
    check_selected_attention(
        q, k, v, block_indices, sel_block, scale, q_start=q_start, cu_seqlens=cu_seqlens,
        check_range=strict,
    )  # fmt: skip
    check_config(config, SelConfig)
    check_dtype(q.dtype, "selected attention")
    check_head_dims(q.shape[3], v.shape[3])


def varlen_args(info: Launch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq_ids int32 [Tq], cu_seqlens int32 [S+1]) of a packed call, else two 1-element dummies
    (the kernels read them only when VARLEN)."""
    if info.seq_ids is None or info.cu_seqlens is None:
        dummy = torch.zeros(1, dtype=torch.int32, device=device)
        return dummy, dummy
    return info.seq_ids, info.cu_seqlens


def resolve_tma(tma: int, dk: int, block_d: int, device: torch.device | None) -> int:
    """``tma`` (0 = choose) resolved to 1 (TMA K/V loads) or 2 (pointer loads).

    0 chooses TMA where :func:`device_takes_tma` and dk is one power-of-two tile (``block_d``);
    1 on a triton without descriptors or a dk that does not fit is an error.
    """
    if tma not in (0, 1, 2):
        raise ValueError(f"tma must be 0 (choose), 1 (TMA loads) or 2 (pointer loads), got {tma}")
    misfit = tma_misfit(dk, block_d)
    if tma == 1:
        if not tma_available():
            raise RuntimeError(
                "tma=1 asks for TMA loads, but this triton has no triton.tools.tensor_descriptor "
                "(it arrived in triton 3.4)"
            )
        if misfit:
            raise ValueError(misfit)
        return 1
    if tma == 2:
        return 2
    return 1 if device is not None and device_takes_tma(device) and misfit is None else 2


def device_takes_tma(device: torch.device) -> bool:
    """Whether ``device`` is a GPU with SM >= 9.0 (Hopper or newer) and triton has host-side
    tensor descriptors: there TMA K/V loads are the default."""
    return (
        device.type == "cuda"
        and tma_available()
        and torch.cuda.get_device_capability(device)[0] >= 9
    )


def tma_available() -> bool:
    """Whether this triton has host-side tensor descriptors (triton >= 3.4)."""
    return importlib.util.find_spec("triton.tools.tensor_descriptor") is not None


def tma_misfit(dk: int, block_d: int) -> str | None:
    """Why TMA K loads cannot serve this head dim and tile, or None when they can."""
    if dk != block_d or dk & (dk - 1):
        return f"tma=1 needs dk a power of two in one tile, got dk={dk}"
    return None


def values_fit_tma(block_dv: int, info: Launch) -> bool:
    """Whether V tiles can come whole through a TMA descriptor: dv a power of two in one
    ``block_dv`` tile (where the config's ``tma`` is 1)."""
    return info.dv == block_dv and info.dv & (info.dv - 1) == 0


# Programs per SM of a strided launch (sel_fwd_kernel's and sel_bwd_dq_kernel's STRIDED): enough
# to fill the GPU where that launch does the work (values that are not all finite), few enough
# that it costs microseconds where it returns at once.
STRIDED_PROGRAMS_PER_SM = 8


def strided_grid(grid: tuple[int, ...], device: torch.device) -> tuple[int, ...]:
    """``grid`` with its row-block axis cut to STRIDED_PROGRAMS_PER_SM programs an SM (over the
    other axes), for a STRIDED launch whose programs stride over the row blocks."""
    others = 1
    for n in grid[1:]:
        others *= n
    cap = max(1, -(-STRIDED_PROGRAMS_PER_SM * num_sms(device) // others))
    return (min(grid[0], cap), *grid[1:])


def path_launches(tma: bool) -> tuple[tuple[bool, bool], ...]:
    """(TMA path, STRIDED) of each launch of a kernel with a TMA path for finite K/V and a masked
    one (sel_fwd_kernel's V_TMA, sel_bwd_dq_kernel's KV_TMA): with TMA both, the masked one
    strided (it returns at once wherever the values are finite); else the masked one alone."""
    return ((True, False), (False, True)) if tma else ((False, False),)
