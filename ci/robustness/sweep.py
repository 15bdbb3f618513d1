"""The sweep the sanitizer runs: small shapes that launch every Triton kernel of nsa_kernels, each
case checking its results against the reference.

It prints one protocol line per case (``SWEEP ok NAME``, ``SWEEP FAIL NAME: WHY``) and the kernels
it found and launched (``SWEEP kernels found=...``, ``launched=...``) on stdout, where the
sanitize part reads them back from each run's log.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from ci.robustness.children import shard_of
from ci.robustness.common import first_line, is_fatal_cuda_error
from ci.robustness.launches import kernel_launches
from ci.robustness.runtime import (
    CORE_TENSORS,
    Runtime,
    backprop,
    bound_for,
    call_op,
    check_close,
    check_pair,
    grads,
    leaves,
    make_cu_seqlens,
    non_finite,
    randn,
    reference_dtype,
    setup_runtime,
    sync,
)

if TYPE_CHECKING:
    import torch

    from nsa_core import NSAConfig


@dataclass(frozen=True)
class SweepShapes:
    """Small shapes for the sweep: every length ends inside a block and a tile."""

    dtype: torch.dtype
    head_dim: int
    tokens: int
    seqlens: tuple[int, ...]
    q_start: int
    cmp_block: int
    cmp_stride: int
    sel_block: int
    num_selected: int
    window: int
    kv_heads: int
    groups: tuple[int, ...]

    def config(self, group: int) -> NSAConfig:
        """The layer of the core and decode sweeps: G = ``group``, dk = dv = ``head_dim``."""
        from nsa_core import NSAConfig

        return NSAConfig(
            num_q_heads=self.kv_heads * group,
            num_kv_heads=self.kv_heads,
            head_dim_qk=self.head_dim,
            head_dim_v=self.head_dim,
            cmp_block=self.cmp_block,
            cmp_stride=self.cmp_stride,
            sel_block=self.sel_block,
            num_selected=self.num_selected,
            window=self.window,
        )


def sweep_shapes(rt: Runtime) -> SweepShapes:
    import torch

    if rt.interpreter:
        return SweepShapes(
            torch.float32, 16, 45, (1, 20, 0, 11, 13), 13, 8, 4, 16, 4, 24, 1, (1, 3, 16)
        )
    # 150 = 4*32 + 22 = 9*16 + 6: partial selection, compressed and kernel tiles everywhere.
    return SweepShapes(
        torch.bfloat16, 64, 150, (1, 70, 0, 33, 46), 37, 16, 8, 32, 4, 40, 2, (1, 3, 16)
    )


def _check_contract(
    idx: torch.Tensor,
    counts: torch.Tensor,
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    s: SweepShapes,
    q_start: int,
    cu: torch.Tensor | None,
) -> None:
    from nsa_core.reference import select_blocks
    from nsa_kernels.scoring.contract import assert_index_contract, reference_scores, row_positions

    geo = (s.cmp_block, s.cmp_stride, s.sel_block)
    ref_idx, _ = select_blocks(q, k_cmp, *geo, s.num_selected, q_start=q_start, cu_seqlens=cu)
    scores = reference_scores(q, k_cmp, *geo, q_start=q_start, cu_seqlens=cu)
    positions = row_positions(q.shape[1], q_start, None if cu is None else cu.cpu())
    assert_index_contract(idx, counts, ref_idx, scores, positions, s.sel_block)


def _sweep_branches(
    rt: Runtime,
    s: SweepShapes,
    group: int,
    *,
    varlen: bool = False,
    q_start: int = 0,
    dtype: torch.dtype | None = None,
    dims: tuple[int, int] | None = None,
) -> None:
    """select_blocks, compressed and selected branches (forward and backward) through the ops."""
    import torch

    from nsa_core.reference import compress, compressed_attention, selected_attention

    dtype = dtype or s.dtype
    dk, dv = dims or (s.head_dim, s.head_dim)
    gen = torch.Generator(device=rt.device).manual_seed(group * 1000 + q_start + 7 * varlen)
    batch, h = (1 if varlen else 2), s.kv_heads
    tk = s.tokens
    cu = make_cu_seqlens(s.seqlens, rt.device) if varlen else None
    q = randn(gen, (batch, tk - q_start, h * group, dk), dtype, rt.device)
    k = randn(gen, (batch, tk, h, dk), dtype, rt.device)
    v = randn(gen, (batch, tk, h, dv), dtype, rt.device)
    k_cmp = compress(k, s.cmp_block, s.cmp_stride, cu_seqlens=cu)
    v_cmp = compress(v, s.cmp_block, s.cmp_stride, cu_seqlens=cu)
    geo = (s.cmp_block, s.cmp_stride, s.sel_block, s.num_selected)
    idx, counts = call_op(
        rt, "select_blocks", ["triton_score"], q, k_cmp, *geo, q_start=q_start, cu_seqlens=cu
    )
    _check_contract(idx, counts, q, k_cmp, s, q_start, cu)
    do = randn(gen, (*q.shape[:3], dv), dtype, rt.device)
    kw: dict[str, Any] = {"q_start": q_start, "cu_seqlens": cu}
    check_pair(
        "compressed",
        lambda q, k, v: call_op(
            rt, "compressed_attention", ["triton_cmp"], q, k, v, *geo[:2], **kw
        ),
        lambda q, k, v: compressed_attention(q, k, v, *geo[:2], **kw),
        (q, k_cmp, v_cmp),
        do,
        ("dq", "dk_cmp", "dv_cmp"),
    )
    check_pair(
        "selected",
        lambda q, k, v: call_op(
            rt, "selected_attention", ["triton_sel"], q, k, v, idx, s.sel_block, **kw
        ),
        lambda q, k, v: selected_attention(q, k, v, idx, s.sel_block, **kw),
        (q, k, v),
        do,
        ("dq", "dk", "dv"),
    )


def _sweep_scoring_with_lse(rt: Runtime, s: SweepShapes, group: int, varlen: bool) -> None:
    """Block scoring fed the compressed branch's lse (its normaliser pass skipped)."""
    import torch

    from nsa_core.reference import compress
    from nsa_kernels.compressed.function import compressed_attention_triton_with_lse
    from nsa_kernels.scoring.function import select_blocks_triton

    gen = torch.Generator(device=rt.device).manual_seed(group + 11 * varlen)
    cu = make_cu_seqlens(s.seqlens, rt.device) if varlen else None
    batch = 1 if varlen else 2
    q_start = 0 if varlen else s.q_start
    q = randn(gen, (batch, s.tokens - q_start, s.kv_heads * group, s.head_dim), s.dtype, rt.device)
    k = randn(gen, (batch, s.tokens, s.kv_heads, s.head_dim), s.dtype, rt.device)
    k_cmp = compress(k, s.cmp_block, s.cmp_stride, cu_seqlens=cu)
    _, lse = compressed_attention_triton_with_lse(
        q, k_cmp, k_cmp, s.cmp_block, s.cmp_stride, q_start=q_start, cu_seqlens=cu
    )
    geo = (s.cmp_block, s.cmp_stride, s.sel_block, s.num_selected)
    idx, counts = select_blocks_triton(q, k_cmp, *geo, q_start=q_start, cu_seqlens=cu, lse=lse)
    _check_contract(idx, counts, q, k_cmp, s, q_start, cu)


def _sweep_split_backwards(rt: Runtime, s: SweepShapes) -> None:
    """Backwards split over query segments (their reduce kernels) and other tile choices."""
    import torch

    from nsa_core.reference import compress, compressed_attention, select_blocks, selected_attention
    from nsa_kernels.compressed.function import CmpConfig, compressed_attention_triton
    from nsa_kernels.selected.function import SelConfig, selected_attention_triton

    gen = torch.Generator(device=rt.device).manual_seed(5)
    group, h, dk = 3, s.kv_heads, s.head_dim
    q = randn(gen, (1, s.tokens, h * group, dk), s.dtype, rt.device)
    k = randn(gen, (1, s.tokens, h, dk), s.dtype, rt.device)
    v = randn(gen, (1, s.tokens, h, dk), s.dtype, rt.device)
    do = randn(gen, q.shape, s.dtype, rt.device)
    geo = (s.cmp_block, s.cmp_stride)
    k_cmp, v_cmp = compress(k, *geo), compress(v, *geo)
    check_pair(
        "compressed dkv_segment=16",
        lambda q, k, v: compressed_attention_triton(
            q, k, v, *geo, config=CmpConfig(dkv_segment=16)
        ),
        lambda q, k, v: compressed_attention(q, k, v, *geo),
        (q, k_cmp, v_cmp),
        do,
        ("dq", "dk_cmp", "dv_cmp"),
    )
    idx, _ = select_blocks(q, k_cmp, *geo, s.sel_block, s.num_selected)
    configs = [
        SelConfig(heads_per_prog=1, segment_tokens=16, rows_per_prog=2, block_l=16),
        SelConfig(tma=2, block_dv=16, block_d=16),
    ]
    for config in configs:
        check_pair(
            f"selected {config.describe()}",
            lambda q, k, v, config=config: selected_attention_triton(
                q, k, v, idx, s.sel_block, config=config
            ),
            lambda q, k, v: selected_attention(q, k, v, idx, s.sel_block),
            (q, k, v),
            do,
            ("dq", "dk", "dv"),
        )


def _sweep_quick(rt: Runtime, s: SweepShapes) -> None:
    """The quick-sanity selection entry points, dense and varlen (an empty range included)."""
    import torch

    from nsa_kernels.selected.quick import sel_attn_fwd_dense, sel_attn_fwd_varlen

    gen = torch.Generator(device=rt.device).manual_seed(3)
    rows, heads, d, keys = 5, 3, s.head_dim, 37
    q = randn(gen, (rows, heads, d), s.dtype, rt.device)
    k = randn(gen, (rows, keys, d), s.dtype, rt.device)
    v = randn(gen, (rows, keys, d), s.dtype, rt.device)
    up = reference_dtype(s.dtype)
    probs = torch.softmax(torch.einsum("nhd,nld->nhl", q.to(up), k.to(up)) * d**-0.5, dim=-1)
    check_close(
        "quick dense",
        sel_attn_fwd_dense(q, k, v),
        torch.einsum("nhl,nld->nhd", probs, v.to(up)),
        bound_for(s.dtype),
    )
    lengths = [9, 0, 30, 1, 7]
    cu = make_cu_seqlens(lengths, rt.device)
    kp = randn(gen, (sum(lengths), d), s.dtype, rt.device)
    vp = randn(gen, (sum(lengths), d), s.dtype, rt.device)
    want = []
    for r, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        if a == b:
            want.append(torch.zeros(heads, d, dtype=up, device=rt.device))
            continue
        p = torch.softmax(q[r].to(up) @ kp[a:b].to(up).T * d**-0.5, dim=-1)
        want.append(p @ vp[a:b].to(up))
    check_close(
        "quick varlen", sel_attn_fwd_varlen(q, kp, vp, cu), torch.stack(want), bound_for(s.dtype)
    )


def _sweep_core(rt: Runtime, s: SweepShapes, group: int, varlen: bool) -> None:
    """The attention core, forward and backward, on its default routes (whatever kernels it
    uses now, a Triton combine included)."""
    import torch

    from nsa_core import nsa_attention

    gen = torch.Generator(device=rt.device).manual_seed(17 + group)
    cfg = s.config(group)
    batch = 1 if varlen else 2
    cu = make_cu_seqlens(s.seqlens, rt.device) if varlen else None
    shape_k = (batch, s.tokens, s.kv_heads, s.head_dim)
    q = randn(gen, (batch, s.tokens, cfg.num_q_heads, s.head_dim), s.dtype, rt.device)
    kv = [randn(gen, shape_k, s.dtype, rt.device) for _ in range(6)]
    gates = torch.sigmoid(randn(gen, (*q.shape[:3], 3), torch.float32, rt.device)).to(s.dtype)
    xs = leaves([q, *kv, gates])
    k = {"cmp": xs[1], "sel": xs[2], "win": xs[3]}
    v = {"cmp": xs[4], "sel": xs[5], "win": xs[6]}
    o = nsa_attention(xs[0], k, v, xs[7], cfg, cu_seqlens=cu)
    backprop(o, torch.ones_like(o))
    bad = non_finite(zip(CORE_TENSORS, [o, *grads(xs)], strict=True))
    if bad:
        raise AssertionError(f"core {bad[0]} holds non-finite values")


def _sweep_decode(rt: Runtime, s: SweepShapes, group: int, thin: bool) -> None:
    """The fused decode step: ragged lengths (0, 1, partial blocks), a few tokens each."""
    import torch

    from nsa_kernels.decode import (
        DecodeKernelConfig,
        DecodePlan,
        DecodeState,
        StepInputs,
        decode_step,
    )

    gen = torch.Generator(device=rt.device).manual_seed(23 + group)
    cfg = s.config(group)
    lengths = [0, 1, s.tokens // 3, s.tokens - 5]
    steps = 4
    total = max(lengths) + steps
    h, hq, d = cfg.num_kv_heads, cfg.num_q_heads, s.head_dim
    branches = ("cmp", "sel", "win")
    k = {b: randn(gen, (len(lengths), total, h, d), s.dtype, rt.device) for b in branches}
    v = {b: randn(gen, (len(lengths), total, h, d), s.dtype, rt.device) for b in branches}
    q = randn(gen, (len(lengths), total, hq, d), s.dtype, rt.device)
    gates = torch.rand(len(lengths), total, hq, 3, generator=gen, device=rt.device).to(s.dtype)
    state = DecodeState.from_prefixes(cfg, k, v, lengths, total + 2)
    config = (
        DecodeKernelConfig(
            key_tile=16,
            cmp_chunk_tiles=1,
            window_chunk=16,
            sel_tile=16,
            sel_splits=4,
            score_chunk=16,
            combine_tile=2,
            combine_heads=1,
        )
        if thin
        else None
    )
    plan = DecodePlan(state, config)
    seq = torch.arange(len(lengths), device=rt.device)
    for step in range(steps):
        pos = torch.tensor([n + step for n in lengths], device=rt.device)
        inputs = StepInputs(
            q=q[seq, pos],
            k_cmp=k["cmp"][seq, pos],
            v_cmp=v["cmp"][seq, pos],
            k_sel=k["sel"][seq, pos],
            v_sel=v["sel"][seq, pos],
            k_win=k["win"][seq, pos],
            v_win=v["win"][seq, pos],
            gates=gates[seq, pos],
        )
        out = decode_step(state, inputs, plan=plan)
        if not bool(torch.isfinite(out.o).all()):
            raise AssertionError(f"decode step {step}: non-finite output")
    if state.lengths() != [n + steps for n in lengths]:
        raise AssertionError(f"decode lengths {state.lengths()} after {steps} steps from {lengths}")


def _sweep_combine(rt: Runtime, s: SweepShapes, expected: Sequence[str]) -> None:
    """The gated combine op on its GPU backend, forward and backward."""
    import torch

    from nsa_core.reference import gated_combine

    gen = torch.Generator(device=rt.device).manual_seed(29)
    shape = (2, s.tokens, 3 * s.kv_heads, s.head_dim + 8)  # dv off the power-of-two tiles
    outs = [randn(gen, shape, s.dtype, rt.device) for _ in range(3)]
    gates = torch.sigmoid(randn(gen, (*shape[:3], 3), torch.float32, rt.device)).to(s.dtype)
    do = randn(gen, shape, s.dtype, rt.device)
    check_pair(
        "combine",
        lambda *xs: call_op(rt, "gated_combine", expected, *xs),
        gated_combine,
        (*outs, gates),
        do,
        ("do_cmp", "do_sel", "do_win", "dgates"),
    )


def sweep_cases(rt: Runtime) -> list[tuple[str, Callable[[], None]]]:
    """The sanitizer sweep: (name, run) pairs, each a few small launches and their checks."""
    import torch

    s = sweep_shapes(rt)
    cases: list[tuple[str, Callable[[], None]]] = []
    for g in s.groups:
        cases.append((f"branches/g{g}/dense", partial(_sweep_branches, rt, s, g)))
        cases.append((f"branches/g{g}/varlen", partial(_sweep_branches, rt, s, g, varlen=True)))
    cases.append(("branches/g3/q_start", lambda: _sweep_branches(rt, s, 3, q_start=s.q_start)))
    wide = (48, 32) if rt.interpreter else (192, 128)
    cases.append(
        (f"branches/g16/dk{wide[0]}_dv{wide[1]}", lambda: _sweep_branches(rt, s, 16, dims=wide))
    )
    if not rt.interpreter:
        cases.append(
            (
                "branches/g3/float32_dk48_dv32",
                lambda: _sweep_branches(rt, s, 3, dtype=torch.float32, dims=(48, 32)),
            )
        )
        cases.append(
            (
                "branches/g16/float16_varlen",
                lambda: _sweep_branches(rt, s, 16, varlen=True, dtype=torch.float16),
            )
        )
    cases.append(("scoring/lse/g16/dense", lambda: _sweep_scoring_with_lse(rt, s, 16, False)))
    cases.append(("scoring/lse/g3/varlen", lambda: _sweep_scoring_with_lse(rt, s, 3, True)))
    cases.append(("split_backwards/g3", lambda: _sweep_split_backwards(rt, s)))
    cases.append(("quick/dense_varlen", lambda: _sweep_quick(rt, s)))
    from nsa_core import registry

    if "gated_combine" in registry.OPS:
        names = [b.name for b in registry.backends("gated_combine") if b.name.startswith("triton")]
        if names:
            cases.append(("combine/dense", lambda: _sweep_combine(rt, s, names)))
    cases.append(("core/g3/dense", lambda: _sweep_core(rt, s, 3, False)))
    cases.append(("core/g16/varlen", lambda: _sweep_core(rt, s, 16, True)))
    for g in s.groups:
        cases.append((f"decode/g{g}", partial(_sweep_decode, rt, s, g, thin=False)))
    cases.append(("decode/g3/thin_splits", lambda: _sweep_decode(rt, s, 3, thin=True)))
    return cases


def run_sweep(device: str, only: str | None, shard: tuple[int, int] = (0, 1)) -> int:
    """The sanitizer's target: run the sweep (or one shard of it), print one protocol line per
    case and the kernels found and launched on stdout; exit 1 if a case failed."""
    rt = setup_runtime(device)
    with kernel_launches() as (kernels, launched):
        cases = [(n, f) for n, f in sweep_cases(rt) if only is None or only in n]
        failed = _run_sweep_cases(rt, shard_of(cases, *shard))
    if failed < 0:
        return 1
    if only is None:  # coverage means something only for the whole sweep
        print(f"SWEEP kernels found={','.join(sorted(kernels))}", flush=True)
    print(f"SWEEP kernels launched={','.join(sorted(launched))}", flush=True)
    return 1 if failed else 0


def _run_sweep_cases(rt: Runtime, cases: Sequence[tuple[str, Callable[[], None]]]) -> int:
    """Run the cases, one protocol line each; the number that failed, -1 if the CUDA context
    was lost (nothing after it can run)."""
    failed = 0
    for name, run in cases:
        start = time.perf_counter()
        try:
            run()
            sync(rt)
        except Exception as exc:  # one case's failure must not hide the others'
            failed += 1
            print(f"SWEEP FAIL {name}: {first_line(exc)}", flush=True)
            if is_fatal_cuda_error(exc):
                print(
                    "SWEEP FAIL context: the CUDA context is lost; later cases cannot run",
                    flush=True,
                )
                return -1
            continue
        print(f"SWEEP ok {name} ({time.perf_counter() - start:.1f} s)", flush=True)
    return failed
