"""Selected attention on Triton: tile choice, the launches, and the autograd Function.

:func:`selected_attention_triton` has the reference op's signature and semantics
(``nsa_core.reference.selected_attention``); docs/selection.md gives the design and arithmetic.
Requirements beyond the reference: CUDA tensors (or CPU under ``TRITON_INTERPRET=1``), dtype
float16, bfloat16 or float32. Repeated block indices in one row are honoured as a set, as in the
reference (the kernels skip a repeat; nsa_core's ``select_blocks`` never emits one).

float32 inputs run every ``tl.dot`` with ``input_precision="ieee"`` (no TF32): slower, but held to
the float32 bound of docs/spec.md. float16/bfloat16 inputs multiply on tensor cores with float32
accumulation, the softmax statistics and all accumulators in float32.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace
from typing import Any

import torch

from nsa_core.checks import (
    check_attention_args,
    check_block_indices,
    check_cu_seqlens,
    check_q_start,
)
from nsa_core.toggles import Toggles, get_toggles
from nsa_kernels.selected.csr import (
    BlockCSR,
    build_block_csr,
    build_dkv_work,
    default_segment_tokens,
)
from nsa_kernels.selected.kernels import (
    LOG2E,
    RED_FIELDS,
    SEG_FIELDS,
    block_set_kernel,
    sel_bwd_dkv_kernel,
    sel_bwd_dq_kernel,
    sel_dkv_reduce_kernel,
    sel_fwd_kernel,
)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class SelConfig:
    """Tiles and launch parameters; 0 means "choose" (see :func:`resolve_config`).

    Attributes:
        block_l: keys per tile, a power of two >= 16 (a selected block is walked in
            ceil(l' / block_l) tiles).
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
        tma: forward K/V loads: 1 through TMA tensor descriptors (dk and dv powers of two in one
            tile each), 2 pointer loads; 0 chooses TMA on GPUs with SM >= 9.0 where it applies
            (3-6% faster at the paper's shapes on an H100, docs/selection.md).
    """

    block_l: int = 0
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

    def describe(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.__dict__.items())


def parse_config(text: str) -> SelConfig:
    """``"block_l=64,fwd_warps=4"`` -> SelConfig (unnamed fields keep 0 = choose)."""
    values: dict[str, int] = {}
    names = set(SelConfig.__dataclass_fields__)
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, raw = item.partition("=")
        if name not in names:
            raise ValueError(
                f"unknown SelConfig field {name!r} in {text!r}; known: {sorted(names)}"
            )
        values[name] = int(raw)
    return SelConfig(**values)


def _pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _check_block(name: str, value: int) -> None:
    if value and (value < 16 or value & (value - 1)):
        raise ValueError(f"{name}={value} must be 0 or a power of two >= 16")


def resolve_config(
    config: SelConfig | None,
    group: int,
    dk: int,
    dv: int,
    sel_block: int,
    toggles: Toggles | None = None,
) -> SelConfig:
    """Fill the zeros of ``config`` with the defaults (``toggles`` default: :func:`get_toggles`).

    Defaults (tuned on an H100 at the paper's shapes, docs/selection.md): one key tile per
    selected block up to 64 keys (larger blocks are walked 64 at a time), the whole dk and dv in
    one tile (next power of two, masked), the whole group per program (NSA_SEL_TRITON_GROUP=0:
    one head per program); forward: 4 warps, 2 pipeline stages (more stages cost occupancy);
    dq: 4 warps, 3 stages; dk/dv: 4 warps, 2 stages, 32 rows (query tokens x heads) per dot.
    ``tma`` stays 0 here: the launch decides it from the device (:func:`_use_tma`).
    """
    cfg = config or SelConfig()
    toggles = get_toggles() if toggles is None else toggles
    cfg = replace(
        cfg, heads_per_prog=cfg.heads_per_prog or (group if toggles.sel_triton_group else 1)
    )
    for name in ("block_l", "block_d", "block_dv"):
        _check_block(name, getattr(cfg, name))
    heads = min(cfg.heads_per_prog, group)
    rows = max(32, _pow2(min(group, 64)))
    return replace(
        cfg,
        block_l=cfg.block_l or max(16, min(64, _pow2(sel_block))),
        block_d=min(cfg.block_d or _pow2(max(dk, 16)), _pow2(max(dk, 16))),
        block_dv=min(cfg.block_dv or _pow2(max(dv, 16)), _pow2(max(dv, 16))),
        heads_per_prog=heads,
        fwd_warps=cfg.fwd_warps or 4,
        fwd_stages=cfg.fwd_stages or 2,
        dq_warps=cfg.dq_warps or 4,
        dq_stages=cfg.dq_stages or 3,
        dkv_warps=cfg.dkv_warps or 4,
        dkv_stages=cfg.dkv_stages or 2,
        dkv_rows=max(cfg.dkv_rows or rows, _pow2(max(group, 16))),
        rows_per_prog=cfg.rows_per_prog or 1,
        kv_hint=cfg.kv_hint or 1,
    )


def _kv_hint(cfg: SelConfig) -> str:
    if cfg.kv_hint not in (1, 2):
        raise ValueError(f"kv_hint must be 1 (evict_last) or 2 (none), got {cfg.kv_hint}")
    return "evict_last" if cfg.kv_hint == 1 else ""


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


@dataclass(frozen=True)
class _Launch:
    """The facts every launch of one call shares."""

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


def _prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_indices: torch.Tensor,
    sel_block: int,
    scale: float | None,
    q_start: int,
    cu_seqlens: torch.Tensor | None,
    toggles: Toggles | None,
) -> _Launch:
    """Validate like the reference op and collect the launch facts."""
    batch, tq, hq, h, dk, dv = check_attention_args(q, k, v)
    if sel_block < 1:
        raise ValueError(f"sel_block must be >= 1, got {sel_block}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"Triton selected attention supports {SUPPORTED_DTYPES}, got {q.dtype}")
    if max(dk, dv) > MAX_HEAD_DIM:
        raise ValueError(f"head dims dk={dk}, dv={dv} exceed {MAX_HEAD_DIM}")
    seq_ids = None
    # The range check costs a device sync; without it, out-of-range entries become -1 on the
    # device (unique_block_rows), so the kernels never address keys outside the sequence.
    strict = (get_toggles() if toggles is None else toggles).sel_check_indices
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, tq, batch, q.device)
        if q_start != 0 or k.shape[1] != tq:
            raise ValueError("varlen selected_attention needs q_start == 0 and k with q's tokens")
        num_blocks = -(-max(tq, 1) // sel_block)
        rows = torch.arange(tq, device=q.device, dtype=torch.int32)
        seq_ids = torch.searchsorted(cu_seqlens[1:], rows, right=True).to(torch.int32)
    else:
        check_q_start(q_start, tq, k.shape[1])
        num_blocks = -(-k.shape[1] // sel_block)
    check_block_indices(block_indices, batch, tq, h, num_blocks, q.device, check_range=strict)
    return _Launch(
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


def _varlen_args(info: _Launch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if info.seq_ids is None or info.cu_seqlens is None:
        dummy = torch.zeros(1, dtype=torch.int32, device=device)
        return dummy, dummy
    return info.seq_ids, info.cu_seqlens


def _fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor,
    sel_block: int,
    info: _Launch,
    cfg: SelConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    o = torch.empty(info.batch, info.tq, info.hq, info.dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(info.batch, info.tq, info.hq, dtype=torch.float32, device=q.device)
    if info.rows == 0:
        return o, lse
    if info.n == 0:
        o.zero_()
        lse.fill_(float("-inf"))
        return o, lse
    seq_ids, cu = _varlen_args(info, q.device)
    hpp = cfg.heads_per_prog
    nch = -(-info.group // hpp)
    nv = -(-info.dv // cfg.block_dv)
    nsub = -(-sel_block // cfg.block_l)
    grid = (-(-info.rows // cfg.rows_per_prog), info.h * nch, nv)
    tma = _use_tma(cfg, info, q.device)
    k_desc: Any = k
    v_desc: Any = v
    if tma:
        k_desc, v_desc = _kv_descriptors(k, v, cfg, info)
    sel_fwd_kernel[grid](
        q, k, v, o, lse, idx, seq_ids, cu, k_desc, v_desc,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        lse.stride(0), lse.stride(1),
        idx.stride(0), idx.stride(1), idx.stride(2),
        info.rows, info.tq, k.shape[1], info.q_start, info.n, info.scale * LOG2E,
        G=info.group, HPP=hpp, BG=max(16, _pow2(hpp)),
        DK=info.dk, BK=cfg.block_d, NK=-(-info.dk // cfg.block_d),
        DV=info.dv, BV=cfg.block_dv,
        SEL=sel_block, BL=cfg.block_l, NSUB=nsub,
        RPP=cfg.rows_per_prog, KV_HINT=_kv_hint(cfg),
        VARLEN=info.seq_ids is not None, DOT_PREC=_dot_precision(q.dtype), TMA=tma,
        num_warps=cfg.fwd_warps, num_stages=cfg.fwd_stages,
    )  # fmt: skip
    return o, lse


def _use_tma(cfg: SelConfig, info: _Launch, device: torch.device) -> bool:
    """cfg.tma, or for 0 whether TMA serves this call (Hopper or newer, one pow-2 tile each)."""
    if cfg.tma not in (0, 1, 2):
        raise ValueError(
            f"tma must be 0 (choose), 1 (TMA loads) or 2 (pointer loads), got {cfg.tma}"
        )
    if cfg.tma == 1 and not tma_available():
        raise RuntimeError(
            "tma=1 asks for TMA loads, but this triton has no triton.tools.tensor_descriptor "
            "(it arrived in triton 3.4)"
        )
    if cfg.tma:
        return cfg.tma == 1
    return (
        device.type == "cuda"
        and tma_available()
        and torch.cuda.get_device_capability(device)[0] >= 9
        and _tma_misfit(cfg, info) is None
    )


def tma_available() -> bool:
    """Whether this triton has host-side tensor descriptors (triton >= 3.4)."""
    return importlib.util.find_spec("triton.tools.tensor_descriptor") is not None


def _tma_misfit(cfg: SelConfig, info: _Launch) -> str | None:
    """Why TMA loads cannot serve these head dims and tiles, or None when they can."""
    for name, d, tile in (("dk", info.dk, cfg.block_d), ("dv", info.dv, cfg.block_dv)):
        if d != tile or d & (d - 1):
            return f"tma=1 needs {name} a power of two in one tile, got {name}={d}"
    return None


def _kv_descriptors(
    k: torch.Tensor, v: torch.Tensor, cfg: SelConfig, info: _Launch
) -> tuple[Any, Any]:
    """TMA descriptors over k [B, Tk, H, dk] and v as [B * Tk, H * d] with [block_l, d] boxes."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    misfit = _tma_misfit(cfg, info)
    if misfit:
        raise ValueError(misfit)
    out = []
    for x, d in ((k, info.dk), (v, info.dv)):
        flat = x.reshape(x.shape[0] * x.shape[1], x.shape[2] * d)
        out.append(TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [cfg.block_l, d]))
    return out[0], out[1]


def _bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    idx: torch.Tensor,
    sel_block: int,
    info: _Launch,
    cfg: SelConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    if info.rows == 0 or info.n == 0:
        return dq, dk, dv
    do = do.contiguous()
    o = o.contiguous()
    seq_ids, cu = _varlen_args(info, q.device)
    prec = _dot_precision(q.dtype)
    bk = _pow2(max(info.dk, 16))
    bv = _pow2(max(info.dv, 16))
    nsub = -(-sel_block // cfg.block_l)
    hpp = cfg.heads_per_prog
    nch = -(-info.group // hpp)
    delta = torch.empty_like(lse)
    sel_bwd_dq_kernel[(-(-info.rows // cfg.rows_per_prog), info.h * nch)](
        q, k, v, o, do, lse, delta, dq, idx, seq_ids, cu,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2),
        lse.stride(0), lse.stride(1),
        idx.stride(0), idx.stride(1), idx.stride(2),
        info.rows, info.tq, info.q_start, info.n, info.scale * LOG2E, info.scale,
        G=info.group, HPP=hpp, BG=max(16, _pow2(hpp)),
        DK=info.dk, BK=bk, DV=info.dv, BV=bv,
        SEL=sel_block, BL=cfg.block_l, NSUB=nsub,
        RPP=cfg.rows_per_prog, KV_HINT=_kv_hint(cfg),
        VARLEN=info.seq_ids is not None, DOT_PREC=prec,
        num_warps=cfg.dq_warps, num_stages=cfg.dq_stages,
    )  # fmt: skip
    csr = build_block_csr(
        idx, sel_block, k.shape[1], q_start=info.q_start, cu_seqlens=info.cu_seqlens
    )
    dkv_backward(q, k, v, do, lse, delta, dk, dv, csr, sel_block, info.scale, cfg, prec)
    return dq, dk, dv


def dkv_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    delta: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    csr: BlockCSR,
    sel_block: int,
    scale: float,
    cfg: SelConfig,
    prec: str,
) -> None:
    """Write dk [B, Tk, H, dk] and dv [B, Tk, H, dv] (zero-filled by the caller) from the CSR."""
    group = q.shape[2] // k.shape[2]
    num_pairs = int(csr.rows.numel())
    if num_pairs == 0:
        return
    seg_tokens = cfg.segment_tokens or default_segment_tokens(num_pairs, _num_sms(q.device))
    work = build_dkv_work(csr, seg_tokens)
    bk = _pow2(max(k.shape[3], 16))
    bv = _pow2(max(v.shape[3], 16))
    nsub = -(-sel_block // cfg.block_l)
    selp = nsub * cfg.block_l
    parts = max(work.num_parts, 1)
    dk_part = torch.empty(parts, selp, bk, dtype=torch.float32, device=q.device)
    dv_part = torch.empty(parts, selp, bv, dtype=torch.float32, device=q.device)
    rows = cfg.dkv_rows
    sel_bwd_dkv_kernel[(work.segments.shape[0], nsub)](
        q, k, v, do, lse, delta, dk, dv, dk_part, dv_part, work.segments, csr.rows,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        do.stride(0), do.stride(1), do.stride(2),
        lse.stride(0), lse.stride(1),
        scale * LOG2E, scale,
        G=group, R=rows, TPI=rows // group,
        DK=k.shape[3], BK=bk, DV=v.shape[3], BV=bv,
        SEL=sel_block, BL=cfg.block_l, SELP=selp, SEG_FIELDS=SEG_FIELDS,
        DOT_PREC=prec, num_warps=cfg.dkv_warps, num_stages=cfg.dkv_stages,
    )  # fmt: skip
    if work.reductions.shape[0]:
        sel_dkv_reduce_kernel[(work.reductions.shape[0], nsub)](
            dk, dv, dk_part, dv_part, work.reductions,
            dk.stride(0), dk.stride(1), dk.stride(2),
            dv.stride(0), dv.stride(1), dv.stride(2),
            DK=k.shape[3], BK=bk, DV=v.shape[3], BV=bv,
            SEL=sel_block, BL=cfg.block_l, SELP=selp, RED_FIELDS=RED_FIELDS,
            num_warps=8,
        )  # fmt: skip


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 4


def unique_block_rows(block_indices: torch.Tensor, num_blocks: int | None = None) -> torch.Tensor:
    """block_indices [..., n] -> int32 [..., n]: each row's distinct blocks ascending, then -1.

    The kernels walk every slot of a row, so a block listed twice would count twice; the
    reference treats a row as a set. One kernel (``block_set_kernel``: two sorts of each row in
    registers) restores that contract. Entries outside [0, num_blocks) (when given; else
    [0, 2**31 - 1)) become -1: they select nothing.
    """
    n = block_indices.shape[-1]
    out = torch.empty(block_indices.shape, dtype=torch.int32, device=block_indices.device)
    rows = out.numel() // n if n else 0
    if rows == 0:
        return out
    limit = torch.iinfo(torch.int32).max if num_blocks is None else num_blocks
    np_ = max(2, _pow2(n))
    per_prog = max(1, 4096 // np_)
    block_set_kernel[(-(-rows // per_prog),)](
        block_indices.contiguous(), out, rows, n, limit, NP=np_, ROWS=per_prog
    )
    return out


def _prepare_tensors(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_indices: torch.Tensor, info: _Launch
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # dq/dk/dv are allocated like q/k/v and the kernels give them the same strides.
    idx = unique_block_rows(block_indices, info.num_blocks)
    return q.contiguous(), k.contiguous(), v.contiguous(), idx


def selected_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_indices: torch.Tensor,
    sel_block: int,
    scale: float | None = None,
    *,
    q_start: int = 0,
    cu_seqlens: torch.Tensor | None = None,
    config: SelConfig | None = None,
    toggles: Toggles | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward only: o [B, Tq, HQ, dv] in q's dtype and lse [B, Tq, HQ] float32 (natural log).

    Arguments as :func:`selected_attention_triton`. ``lse`` is -inf on rows that see no token.
    """
    info = _prepare(q, k, v, block_indices, sel_block, scale, q_start, cu_seqlens, toggles)
    q, k, v, idx = _prepare_tensors(q, k, v, block_indices, info)
    cfg = resolve_config(config, info.group, info.dk, info.dv, sel_block, toggles)
    return _fwd(q, k, v, idx, sel_block, info, cfg)


def selected_attention_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    block_indices: torch.Tensor,
    sel_block: int,
    scale: float | None = None,
    *,
    q_start: int = 0,
    cu_seqlens: torch.Tensor | None = None,
    config: SelConfig | None = None,
    toggles: Toggles | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv for the upstream gradient ``do [B, Tq, HQ, dv]`` (o, lse from the forward)."""
    info = _prepare(q, k, v, block_indices, sel_block, scale, q_start, cu_seqlens, toggles)
    q, k, v, idx = _prepare_tensors(q, k, v, block_indices, info)
    cfg = resolve_config(config, info.group, info.dk, info.dv, sel_block, toggles)
    return _bwd(do, q, k, v, o, lse, idx, sel_block, info, cfg)


class SelectedAttentionFunction(torch.autograd.Function):
    """o = selected_attention(q, k, v); backward gives dq, dk, dv without atomics."""

    @staticmethod
    def forward(
        ctx: Any,
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
    ) -> torch.Tensor:
        info = _prepare(q, k, v, block_indices, sel_block, scale, q_start, cu_seqlens, toggles)
        q, k, v, idx = _prepare_tensors(q, k, v, block_indices, info)
        cfg = resolve_config(config, info.group, info.dk, info.dv, sel_block, toggles)
        o, lse = _fwd(q, k, v, idx, sel_block, info, cfg)
        ctx.save_for_backward(q, k, v, o, lse, idx)
        ctx.info = info
        ctx.cfg = cfg
        ctx.sel_block = sel_block
        return o

    @staticmethod
    def backward(ctx: Any, do: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, o, lse, idx = ctx.saved_tensors
        dq, dk, dv = _bwd(do, q, k, v, o, lse, idx, ctx.sel_block, ctx.info, ctx.cfg)
        return dq, dk, dv, None, None, None, None, None, None, None


def selected_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_indices: torch.Tensor,
    sel_block: int,
    scale: float | None = None,
    *,
    q_start: int = 0,
    cu_seqlens: torch.Tensor | None = None,
    config: SelConfig | None = None,
    toggles: Toggles | None = None,
) -> torch.Tensor:
    """Selected attention (docs/spec.md), the Triton kernels; same contract as the reference.

    Query row r sits at position ``t = q_start + r``; its head h (group ``h // G``) attends in one
    softmax to every token p with ``p // sel_block`` in ``block_indices[b, r, h // G]`` and
    ``p <= t``. -1 is padding, a repeated index counts once, a row that sees nothing gives 0.

    Args:
        q: [B, Tq, HQ, dk]; k: [B, Tk, H, dk]; v: [B, Tk, H, dv]; float16, bfloat16 or float32.
        block_indices: [B, Tq, H, n] int32/int64 in [-1, ceil(Tk / sel_block)).
        sel_block: l'.
        scale: softmax scale, default dk ** -0.5.
        q_start: position of q[:, 0].
        cu_seqlens: int32 [S+1] for packed sequences (B == 1, q_start == 0, Tk == Tq).
        config: tiles and launch parameters (default: :func:`resolve_config`).
        toggles: the toggles the routing decision was made with (NSA_SEL_TRITON_GROUP,
            NSA_SEL_CHECK_INDICES); default :func:`nsa_core.toggles.get_toggles`.

    Returns:
        o [B, Tq, HQ, dv] in q's dtype; differentiable in q, k and v.
    """
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out = SelectedAttentionFunction.apply(  # type: ignore[no-untyped-call]
            q, k, v, block_indices, sel_block, scale, q_start, cu_seqlens, config, toggles
        )
        assert isinstance(out, torch.Tensor)
        return out
    return selected_attention_fwd(
        q,
        k,
        v,
        block_indices,
        sel_block,
        scale,
        q_start=q_start,
        cu_seqlens=cu_seqlens,
        config=config,
        toggles=toggles,
    )[0]


def kv_bytes_read(
    batch: int, tq: int, h: int, n: int, sel_block: int, dk: int, dv: int, itemsize: int
) -> int:
    """Bytes of K/V the forward loads when every slot holds a full block: B*Tq*H*n*l'*(dk+dv)."""
    return batch * tq * h * n * sel_block * (dk + dv) * itemsize


def attention_flops(batch: int, tq: int, hq: int, n: int, sel_block: int, dk: int, dv: int) -> int:
    """Matmul FLOPs of the forward with full blocks: 2 * B*Tq*HQ*n*l' * (dk + dv)."""
    return 2 * batch * tq * hq * n * sel_block * (dk + dv)


__all__ = [
    "SelConfig",
    "SelectedAttentionFunction",
    "attention_flops",
    "kv_bytes_read",
    "parse_config",
    "resolve_config",
    "selected_attention_bwd",
    "selected_attention_fwd",
    "selected_attention_triton",
]
