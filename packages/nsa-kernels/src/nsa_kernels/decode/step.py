"""One fused NSA decode step for B sequences: the launches, their tiles and the workspace.

A step at each sequence's own position ``t = cache_seqlens[b]`` (docs/spec.md, "Decode"):

1. ``append_kernel`` (update.py): the token's K/V go into every cache; a block completed by the
   token is folded (phi); the lengths advance on the device. One program per (sequence, kv
   head, keys or values); the last of a sequence to read its counters advances them.
2. ``cmp_window_kernel``: compressed attention split over chunks of compressed keys (leaving
   the band sums that score selection blocks) and sliding attention split over window chunks.
3. ``score_topn_kernel``: selection scores of chunks of selection blocks, each chunk's n best.
4. ``selected_kernel``: the n blocks (forced {0, jt-1, jt}, then the best, ties to the lower j)
   and the selected branch split over them.
5. ``combine_kernel``: partial states merged in a fixed order, gated combine, reads.

No host synchronisation, no host-side position: the launches and their arguments are the same
at every step, so one CUDA graph replays for every following token (graph.py).

Top-n contract: the indices equal the reference's (``nsa_core.reference.select_blocks`` at the
same position, on the same compressed keys) except in rows whose n-th and (n+1)-th best
non-forced scores differ by at most ``TOPN_REL_GAP`` times the n-th score: the kernel sums the
same probabilities in another order. Exact ties go to the lower block, as in the reference.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from nsa_core import NSAConfig, num_cmp_blocks
from nsa_core.checks import check_int
from nsa_kernels.common.launch_chain import launch_options, pdl_supported
from nsa_kernels.common.tile_config import check_config
from nsa_kernels.common.triton_inputs import (
    MAX_HEAD_DIM,
    check_dtype,
    check_triton_runs,
    dot_precision,
    num_sms,
)
from nsa_kernels.decode.attention_kernels import cmp_window_kernel, selected_kernel
from nsa_kernels.decode.combine_kernels import combine_kernel
from nsa_kernels.decode.state import BlockPhi, DecodeState, check_phi
from nsa_kernels.decode.topn_kernels import score_topn_kernel
from nsa_kernels.decode.update import append_token, page_args, page_size

LOG2E = 1.4426950408889634
TOPN_REL_GAP = 1e-4


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------------------------ inputs


@dataclass
class StepInputs:
    """The new token of each sequence, already projected (and q and keys rotated).

    q [B, HQ, dk]; per branch k_* [B, H, dk], v_* [B, H, dv] (``k_cmp``/``v_cmp``: the raw,
    unfolded compressed-branch K/V); gates [B, HQ, 3] in (0, 1), ordered (cmp, sel, win).
    """

    q: torch.Tensor
    k_cmp: torch.Tensor
    v_cmp: torch.Tensor
    k_sel: torch.Tensor
    v_sel: torch.Tensor
    k_win: torch.Tensor
    v_win: torch.Tensor
    gates: torch.Tensor

    @classmethod
    def zeros(cls, state: DecodeState) -> StepInputs:
        """Zero inputs shaped for ``state`` (static buffers to fill before each graph replay)."""
        cfg, batch = state.config, state.batch
        hq, h = cfg.num_q_heads, cfg.num_kv_heads
        dk, dv = cfg.head_dim_qk, cfg.head_dim_v

        def z(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, device=state.device, dtype=state.dtype)

        return cls(
            q=z(batch, hq, dk),
            k_cmp=z(batch, h, dk),
            v_cmp=z(batch, h, dv),
            k_sel=z(batch, h, dk),
            v_sel=z(batch, h, dv),
            k_win=z(batch, h, dk),
            v_win=z(batch, h, dv),
            gates=z(batch, hq, 3),
        )

    def copy_(self, other: StepInputs) -> None:
        """Fill these tensors in place from ``other`` (same shapes)."""
        for f in fields(self):
            getattr(self, f.name).copy_(getattr(other, f.name))

    def check(self, state: DecodeState) -> None:
        """Shapes, dtype and device against ``state`` (metadata only: no device sync)."""
        cfg, batch = state.config, state.batch
        hq, h = cfg.num_q_heads, cfg.num_kv_heads
        dk, dv = cfg.head_dim_qk, cfg.head_dim_v
        want = {
            "q": (batch, hq, dk),
            "k_cmp": (batch, h, dk),
            "v_cmp": (batch, h, dv),
            "k_sel": (batch, h, dk),
            "v_sel": (batch, h, dv),
            "k_win": (batch, h, dk),
            "v_win": (batch, h, dv),
            "gates": (batch, hq, 3),
        }
        for name, shape in want.items():
            x = getattr(self, name)
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
            if tuple(x.shape) != shape:
                raise ValueError(f"{name} {list(x.shape)} must be {list(shape)} for this state")
            if x.dtype != state.dtype:
                raise TypeError(f"{name} dtype {x.dtype} differs from the state's {state.dtype}")
            if x.device != state.device:
                raise ValueError(f"{name} is on {x.device} but the state on {state.device}")


@dataclass
class StepOutputs:
    """What one step produced, all on the device.

    o [B, HQ, dv] in the state's dtype; indices [B, H, n] int32 (ascending, -1 padded) the
    selected blocks; reads_cmp, reads_sel, reads_win [B, H] int32: the key tokens each branch's
    softmax covered, counted by the kernels.
    """

    o: torch.Tensor
    indices: torch.Tensor
    reads: torch.Tensor  # [3, B, H]: cmp, sel, win

    @property
    def reads_cmp(self) -> torch.Tensor:
        return self.reads[0]

    @property
    def reads_sel(self) -> torch.Tensor:
        return self.reads[1]

    @property
    def reads_win(self) -> torch.Tensor:
        return self.reads[2]

    @property
    def reads_total(self) -> torch.Tensor:
        """[B, H] tokens read by the whole step."""
        return self.reads.sum(0)


# ------------------------------------------------------------------------------------ tiles


@dataclass(frozen=True)
class DecodeKernelConfig:
    """Tiles and splits of the step; 0 means "choose" (see :class:`DecodePlan`).

    Attributes:
        key_tile: compressed or window keys per tile (a power of two >= 16 and >= l'/d).
        cmp_chunk_tiles: tiles per compressed program (the split-K chunk).
        window_chunk: window keys per window program (a multiple of ``key_tile``).
        sel_tile: selected keys per tile (a power of two >= 16).
        sel_splits: selected-branch programs per (sequence, kv head), each taking
            ceil(n / sel_splits) blocks.
        score_chunk: selection blocks per scoring program (a power of two >= 16).
        combine_tile: partial states merged per step of the combine loop (a power of two).
        combine_heads: query heads per combine program.
        program_slots: programs the device runs at once, for the split choices (default: the
            SM count on CUDA).
        warps: warps of the attention programs.
        stages: pipeline stages of the attention loops (0: 3 for 16-bit tiles up to 128 + 128
            columns when B*H >= 64, 1 for float32 tiles wider than that, which need too much
            shared memory on sm_86/sm_89 with 2, else 2).
        pdl: the five launches chained by programmatic dependent launch (each starts while the
            one before ends and waits for it on the device; nsa_kernels.common.launch_chain):
            1 on (refused where unsupported), 2 off, 0 on where the device supports it (sm_90+).
    """

    key_tile: int = 0
    cmp_chunk_tiles: int = 0
    window_chunk: int = 0
    sel_tile: int = 0
    sel_splits: int = 0
    score_chunk: int = 0
    combine_tile: int = 0
    combine_heads: int = 0
    program_slots: int = 0
    warps: int = 0
    stages: int = 0
    pdl: int = 0


def _check_pow2(name: str, value: int, least: int) -> None:
    if value and (value < least or value & (value - 1)):
        raise ValueError(f"{name}={value} must be 0 or a power of two >= {least}")


class DecodePlan:
    """Resolved tiles, launch grids and the workspace for one state's geometry.

    The workspace (partial states, tile maxima, band sums, top-n candidates) is reused by every
    step run with this plan; steps on one stream run in order, so sharing it is safe there.

    ``tokens``: the tokens the batch holds in total, where the caller knows it (a ragged batch
    sized for its longest sequence). The split-K chunks of the compressed keys and of scoring
    are then sized for the mean length rather than for the capacity: each chunk is a fixed
    share of work, a long sequence takes more chunks, and no program of the step's longest
    sequence runs twice as long as the others'. The grids still cover the capacity.
    """

    def __init__(
        self,
        state: DecodeState,
        config: DecodeKernelConfig | None = None,
        *,
        tokens: int | None = None,
    ) -> None:
        check_state(state)
        check_config(config, DecodeKernelConfig)
        if tokens is not None:
            check_int("tokens", tokens, 1, state.batch * state.capacity)
        cfg = state.config
        kc = config or DecodeKernelConfig()
        for name, least in (
            ("key_tile", 16),
            ("sel_tile", 16),
            ("score_chunk", 16),
            ("combine_tile", 1),
        ):
            _check_pow2(name, getattr(kc, name), least)
        _check_geometry(cfg)
        check_dtype(state.dtype, "decode", "state")
        self.config = cfg
        self.batch = state.batch
        self.capacity = state.capacity
        self.device = state.device
        self.dtype = state.dtype
        device = state.device
        slots = kc.program_slots or num_sms(device)
        bh = state.batch * cfg.num_kv_heads
        self.group = cfg.group_size
        self.block_g = max(16, _pow2(self.group))
        self.block_k = max(16, _pow2(cfg.head_dim_qk))
        self.block_v = max(16, _pow2(cfg.head_dim_v))

        wide = 64 if cfg.head_dim_qk <= 128 else 32  # default key tile

        # Window: chunks of window_chunk keys, walked in tiles of key_tile.
        self.key_tile = max(kc.key_tile or wide, cfg.sel_block // cfg.cmp_stride)
        self.window_chunk = kc.window_chunk or max(self.key_tile, 128)
        if self.window_chunk % self.key_tile:
            raise ValueError(
                f"window_chunk={self.window_chunk} must be a multiple of key_tile={self.key_tile}"
            )
        self.window_chunks = _cdiv(cfg.window, self.window_chunk)

        # Compressed branch: tiles of key_tile blocks, chunks of cmp_chunk_tiles tiles. With the
        # window programs, about two programs per SM in one wave (no partial second wave), and
        # at least eight chunks per (sequence, kv head): at large batches several waves of short
        # chunks keep more loads in flight than one wave of long ones (docs/results).
        # Tiles of 32 keys above dk = 128 keep a program's registers from spilling (sm_90).
        self.ranges_per_sel = cfg.sel_block // cfg.cmp_stride  # R: blocks starting in one l'
        self.extra = (cfg.sel_block - cfg.cmp_stride + cfg.cmp_block - 1) // cfg.sel_block
        tiles = max(1, _cdiv(state.cmp_capacity, self.key_tile))
        per_seq = max(8, (2 * slots) // bh - self.window_chunks)
        # The length the chunks are sized for: the capacity, or the mean the caller gave.
        sized = state.capacity if tokens is None else _cdiv(tokens, state.batch)
        sized_blocks = num_cmp_blocks(sized, cfg.cmp_block, cfg.cmp_stride)
        sized_tiles = max(1, _cdiv(sized_blocks, self.key_tile))
        self.cmp_chunk_tiles = kc.cmp_chunk_tiles or max(1, _cdiv(sized_tiles, per_seq))
        self.cmp_chunks = _cdiv(state.cmp_capacity, self.key_tile * self.cmp_chunk_tiles)
        self.cmp_chunk = self.key_tile * self.cmp_chunk_tiles
        self.tiles = tiles
        self.ranges = tiles * self.key_tile // self.ranges_per_sel

        # Selected branch: the n blocks split over sel_splits programs.
        n = cfg.num_selected
        self.sel_tile = kc.sel_tile or min(wide, max(16, _pow2(cfg.sel_block)))
        self.sel_sub = _cdiv(cfg.sel_block, self.sel_tile)
        splits = kc.sel_splits or max(1, min(n, _cdiv(2 * slots, bh)))
        self.blocks_per_split = _cdiv(n, min(splits, n))
        self.sel_splits = _cdiv(n, self.blocks_per_split)

        # Scoring: 16 to 32 chunks of selection blocks a sequence (the power of two at or above
        # 1/32 of its blocks), at least 64 blocks each: the lengths measured fastest
        # (docs/results). Longer chunks leave fewer candidates for the selected kernel to merge;
        # too long, and scoring takes longer than the merge saves.
        num_sel = _cdiv(state.capacity, cfg.sel_block)
        sized_sel = _cdiv(sized, cfg.sel_block)
        self.score_chunk = kc.score_chunk or max(64, _pow2(_cdiv(sized_sel, 32)))
        # A chunk's [G, chunk] float32 tiles of band sums and maxima fit four warps' registers
        # up to 256 blocks.
        self.score_warps = 4 if self.score_chunk <= 256 else 8
        self.score_chunks = _cdiv(num_sel, self.score_chunk)
        self.n_pad = _pow2(n)

        self.slots = self.cmp_chunks + self.window_chunks + self.sel_splits
        # All slots in one tile where that fits (the combine is two rounds of loads then).
        self.combine_tile = kc.combine_tile or min(64, _pow2(self.slots))
        self.combine_heads = min(kc.combine_heads or 1, self.group)
        combine_floats = self.combine_tile * _pow2(self.combine_heads) * self.block_v
        self.combine_warps = 4 if combine_floats > 4096 else 2
        self.warps = kc.warps or 4
        # Two stages of float32 K/V tiles wider than 128 + 128 ask for up to 116 KiB of shared
        # memory in the compressed/window kernel: more than an sm_86/sm_89 SM has (99 KiB).
        # One stage fits every supported architecture.
        # A large batch is bound by bytes, and a third buffer keeps more loads in flight; a
        # small one is bound by latency, where the third buffer measured slower (docs/results).
        narrow = self.block_k + self.block_v <= 256
        if state.dtype == torch.float32:
            default_stages = 2 if narrow else 1
        else:
            default_stages = 3 if narrow and bh >= 64 else 2
        self.stages = kc.stages or default_stages
        self.dot_precision = dot_precision(state.dtype)
        if kc.pdl not in (0, 1, 2):
            raise ValueError(f"pdl={kc.pdl} must be 0 (choose), 1 (on) or 2 (off)")
        supported = pdl_supported(device)
        if kc.pdl == 1 and not supported:
            raise ValueError(
                "pdl=1: programmatic dependent launch needs a CUDA device of compute capability"
                " 9.0 or more, compiled kernels (not the interpreter) and triton >= 3.4"
            )
        self.pdl = supported if kc.pdl == 0 else kc.pdl == 1
        # Every launch of the step takes these: the kernels' PDL constexpr and the launch flag.
        self.chain: dict[str, bool] = {"PDL": self.pdl, **launch_options(self.pdl)}

        g, dv = self.group, cfg.head_dim_v

        def f32(*shape: int) -> torch.Tensor:
            return torch.empty(*shape, device=device, dtype=torch.float32)

        self.part_m = f32(bh, self.slots, g)
        self.part_l = f32(bh, self.slots, g)
        self.part_acc = f32(bh, self.slots, g, dv)
        self.part_n = torch.empty(bh, self.slots, device=device, dtype=torch.int32)
        self.tile_m = f32(bh, tiles, g)
        self.band = f32(bh, self.extra + 1, g, self.ranges)
        self.cand = torch.empty(bh, self.score_chunks, self.n_pad, device=device, dtype=torch.int64)
        # The append kernel's per-sequence tickets: zero between steps (it resets them).
        self.tickets = torch.zeros(state.batch, device=device, dtype=torch.int32)

    def matches(self, state: DecodeState) -> bool:
        return (
            state.config == self.config
            and state.batch == self.batch
            and state.capacity == self.capacity
            and state.device == self.device
            and state.dtype == self.dtype
        )

    def describe(self) -> str:
        """The resolved tiles and splits, for logs and benches."""
        return (
            f"key_tile={self.key_tile},cmp_chunk_tiles={self.cmp_chunk_tiles},"
            f"cmp_chunks={self.cmp_chunks},window_chunk={self.window_chunk},"
            f"window_chunks={self.window_chunks},sel_tile={self.sel_tile},"
            f"sel_splits={self.sel_splits},score_chunk={self.score_chunk},"
            f"score_chunks={self.score_chunks},warps={self.warps},stages={self.stages},"
            f"pdl={1 if self.pdl else 2}"
        )


def check_state(state: object) -> None:
    if not isinstance(state, DecodeState):
        raise TypeError(f"state must be a DecodeState, got {type(state).__name__}")


def _check_geometry(cfg: NSAConfig) -> None:
    if max(cfg.head_dim_qk, cfg.head_dim_v) > MAX_HEAD_DIM:
        raise ValueError(
            f"head dims dk={cfg.head_dim_qk}, dv={cfg.head_dim_v} exceed {MAX_HEAD_DIM}"
        )
    ranges = cfg.sel_block // cfg.cmp_stride
    if ranges & (ranges - 1):
        raise ValueError(
            f"decode scores need sel_block / cmp_stride a power of two, got "
            f"{cfg.sel_block} / {cfg.cmp_stride} = {ranges}"
        )


# ------------------------------------------------------------------------------------ step


def decode_step(
    state: DecodeState,
    inputs: StepInputs,
    *,
    phi_k: BlockPhi | None = None,
    phi_v: BlockPhi | None = None,
    plan: DecodePlan | None = None,
) -> StepOutputs:
    """Append each sequence's token at its own position and attend from it; advances ``state``.

    Args:
        state: the caches; ``cache_seqlens[b]`` is the position of sequence b's token.
        inputs: the token's q, per-branch K/V and gates (see :class:`StepInputs`).
        phi_k, phi_v: for ``config.phi == "mlp"``, blocks [B, H, l, D] -> [B, H, D] (see
            ``state.block_phi``), run on the device every step, written where a block completes.
        plan: tiles and workspace from ``DecodePlan(state)``; built here when None (the
            workspace is then allocated per call).

    Returns:
        :class:`StepOutputs`: o [B, HQ, dv], indices [B, H, n], reads [3, B, H].
    """
    check_state(state)
    if not isinstance(inputs, StepInputs):
        raise TypeError(f"inputs must be a StepInputs, got {type(inputs).__name__}")
    cfg = state.config
    check_phi(cfg, phi_k, phi_v)
    inputs.check(state)
    if plan is not None and not isinstance(plan, DecodePlan):
        raise TypeError(f"plan must be a DecodePlan or None, got {type(plan).__name__}")
    if plan is not None and not plan.matches(state):
        raise ValueError("plan was built for another state geometry (config, batch, capacity)")
    # Last, so that a call's own mistakes show first on any device.
    check_triton_runs("state", state.k_sel)
    if plan is None:
        plan = DecodePlan(state)
    batch, h, hq = state.batch, cfg.num_kv_heads, cfg.num_q_heads
    dk, dv, n = cfg.head_dim_qk, cfg.head_dim_v, cfg.num_selected
    x = {f.name: getattr(inputs, f.name).contiguous() for f in fields(inputs)}
    append_token(
        state,
        {"cmp": x["k_cmp"], "sel": x["k_sel"], "win": x["k_win"]},
        {"cmp": x["v_cmp"], "sel": x["v_sel"], "win": x["v_win"]},
        plan.tickets,
        phi_k=phi_k,
        phi_v=phi_v,
        chain=plan.chain,
    )
    q = x["q"]
    o = torch.empty(batch, hq, dv, device=state.device, dtype=state.dtype)
    indices = torch.empty(batch, h, n, device=state.device, dtype=torch.int32)
    reads = torch.empty(3, batch, h, device=state.device, dtype=torch.int32)
    qk_scale = cfg.softmax_scale * LOG2E
    p = plan
    # Sizes that vary with the capacity go in as runtime integers (one compiled kernel serves
    # every capacity); only tile shapes are compile-time constants.
    common = {"H": h, "G": p.group, "BG": p.block_g, "slots": p.slots}
    cmp_window_kernel[(batch * h, p.cmp_chunks + p.window_chunks)](
        q, state.k_cmp, state.v_cmp, state.k_win, state.v_win,
        state.cache_seqlens, state.num_cmp,
        p.tile_m, p.band, p.part_m, p.part_l, p.part_acc, p.part_n,
        state.k_cmp.shape[1], qk_scale,
        cmp_chunks=p.cmp_chunks, chunk_tiles=p.cmp_chunk_tiles, tiles=p.tiles, ranges=p.ranges,
        HQ=hq, DK=dk, BK=p.block_k, DV=dv, BV=p.block_v, BN=p.key_tile,
        R=p.ranges_per_sel, EXTRA=p.extra, LCMP=cfg.cmp_block, DSTRIDE=cfg.cmp_stride,
        SEL=cfg.sel_block, WINDOW=cfg.window, WC=p.window_chunk,
        DOT_PREC=p.dot_precision, num_warps=p.warps, num_stages=p.stages, **common, **p.chain,
    )  # fmt: skip
    score_topn_kernel[(batch * h, p.score_chunks)](
        p.band, p.tile_m, p.part_m, p.part_l, state.cache_seqlens, state.num_cmp, p.cand,
        cmp_chunk=p.cmp_chunk, tiles=p.tiles, ranges=p.ranges, score_chunks=p.score_chunks,
        NCP=_pow2(max(p.cmp_chunks, 1)), BN=p.key_tile, R=p.ranges_per_sel, EXTRA=p.extra,
        SEL=cfg.sel_block, JS=p.score_chunk, N=n, NP=p.n_pad, num_warps=p.score_warps,
        **common, **p.chain,
    )  # fmt: skip
    selected_kernel[(batch * h, p.sel_splits)](
        q, state.k_sel, state.v_sel, p.cand, state.cache_seqlens, indices,
        p.part_m, p.part_l, p.part_acc, p.part_n,
        *page_args(state), state.capacity, qk_scale,
        PAGE=page_size(state), sel_slot0=p.cmp_chunks + p.window_chunks,
        score_chunks=p.score_chunks,
        HQ=hq, DK=dk, BK=p.block_k, DV=dv, BV=p.block_v,
        SEL=cfg.sel_block, BL=p.sel_tile, NSUB=p.sel_sub, BPS=p.blocks_per_split,
        BPSP=_pow2(p.blocks_per_split),
        NSCP=_pow2(p.score_chunks), N=n, NP=p.n_pad,
        DOT_PREC=p.dot_precision, num_warps=p.warps, num_stages=p.stages, **common, **p.chain,
    )  # fmt: skip
    combine_kernel[(batch * h, _cdiv(p.group, p.combine_heads))](
        p.part_m, p.part_l, p.part_acc, p.part_n, x["gates"], o, state.num_cmp, reads,
        batch, cmp_chunks=p.cmp_chunks, win_chunks=p.window_chunks,
        cmp_chunk=p.cmp_chunk, HQ=hq, HPC=p.combine_heads, HB=_pow2(p.combine_heads),
        DV=dv, BV=p.block_v, KT=p.combine_tile, num_warps=p.combine_warps,
        H=h, G=p.group, slots=p.slots, **p.chain,
    )  # fmt: skip
    return StepOutputs(o=o, indices=indices, reads=reads)
