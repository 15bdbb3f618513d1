"""The parity part: the random cases of a seed (``plan``), every non-reference backend of every op
that accepts a case pinned through the toggles, against the reference; the cases run in worker
processes that each own whole geometries, and the verdict counts checks per backend."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ci.robustness.children import Child, parse_shard, run_children, visible_gpus
from ci.robustness.common import GRAD_FACTOR, SCRIPT, first_line, is_fatal_cuda_error, log
from ci.robustness.plan import Geometry, ParityCase, ParityPlan, limits_for, make_plan
from ci.robustness.report import PartResult, load_parts
from ci.robustness.runtime import (
    Runtime,
    backprop,
    bound_for,
    environment,
    grads,
    leaves,
    make_cu_seqlens,
    op_context_for,
    pinned_toggles,
    randn,
    reference_dtype,
    rel_err,
    setup_runtime,
    torch_dtype,
)

if TYPE_CHECKING:
    import torch

    from nsa_core.registry import OpContext
    from nsa_core.toggles import Toggles


@dataclass
class Check:
    """One backend on one case: pass/fail (with its errors), declined (why) or skipped (why)."""

    op: str
    backend: str
    status: str
    detail: str = ""


@dataclass
class CaseData:
    """The inputs of one case, on the device: q [B, Tq, HQ, dk], k [B, Tk, H, dk], v [B, Tk, H,
    dv], their compressed blocks, cu_seqlens, and the upstream gradients."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cmp: torch.Tensor
    v_cmp: torch.Tensor
    cu: torch.Tensor | None
    do: torch.Tensor


def case_data(rt: Runtime, g: Geometry, c: ParityCase) -> CaseData:
    import torch

    from nsa_core.reference import compress

    dtype = torch_dtype(g.dtype)
    gen = torch.Generator(device=rt.device).manual_seed(c.data_seed)
    q = randn(gen, (c.batch, c.query_len, g.num_q_heads, g.head_dim_qk), dtype, rt.device)
    k = randn(gen, (c.batch, c.seq_len, g.num_kv_heads, g.head_dim_qk), dtype, rt.device)
    v = randn(gen, (c.batch, c.seq_len, g.num_kv_heads, g.head_dim_v), dtype, rt.device)
    cu = make_cu_seqlens(c.seqlens, rt.device) if c.seqlens is not None else None
    k_cmp = compress(k, g.cmp_block, g.cmp_stride, cu_seqlens=cu)
    v_cmp = compress(v, g.cmp_block, g.cmp_stride, cu_seqlens=cu)
    do = randn(gen, (c.batch, c.query_len, g.num_q_heads, g.head_dim_v), dtype, rt.device)
    return CaseData(q, k, v, k_cmp, v_cmp, cu, do)


def backend_decision(
    rt: Runtime, op: str, backend: Any, ctx: OpContext
) -> tuple[Toggles, str | None]:
    """(pinned toggles, None) when ``backend`` serves ``ctx`` pinned, else (toggles, the reason).

    Under the interpreter the Triton backends serve CPU tensors by name (their ``supports`` asks
    for CUDA); on CUDA the registry's own decision for the pinned toggles is what counts.
    """
    from nsa_core import registry

    toggles = pinned_toggles(op, backend.name)
    reason = backend.supports(ctx, toggles)
    if reason is not None and rt.interpreter and backend.name.startswith("triton"):
        return toggles, None
    if reason is None:
        chosen = registry.resolve(op, ctx, toggles).backend.name
        if chosen != backend.name:
            return toggles, f"pinned, yet the registry chose {chosen}"
    return toggles, reason


@dataclass
class ParityOptions:
    flex_geometries: int
    include: tuple[str, ...] = ()


def _gpu_backends(op: str) -> list[Any]:
    from nsa_core import registry

    return [b for b in registry.backends(op) if b.name != "reference"]


def _skip_reason(
    backend: Any, geometry_index: int, plan: ParityPlan, opts: ParityOptions
) -> str | None:
    if backend.name == "flex":
        eligible = [i for i, g in enumerate(plan.geometries) if not g.group & (g.group - 1)]
        if geometry_index not in eligible[: opts.flex_geometries]:
            return (
                f"compile budget: compiled FlexAttention runs on {opts.flex_geometries} "
                "geometries (--flex-geometries)"
            )
    return None


def _check_select_blocks(
    rt: Runtime, plan: ParityPlan, c: ParityCase, d: CaseData, opts: ParityOptions
) -> list[Check]:
    """Every GPU backend of select_blocks under the index contract, without and with the
    compressed branch's lse (what the attention core hands it)."""
    from nsa_core.reference import select_blocks
    from nsa_kernels.compressed.function import compressed_attention_fwd
    from nsa_kernels.scoring.contract import check_index_contract, reference_scores, row_positions

    g = plan.geometries[c.geometry]
    geo = (g.cmp_block, g.cmp_stride, g.sel_block)
    kw: dict[str, Any] = {"q_start": c.q_start, "cu_seqlens": d.cu}
    ref_idx, _ = select_blocks(d.q, d.k_cmp, *geo, g.num_selected, **kw)
    scores = reference_scores(d.q, d.k_cmp, *geo, **kw)
    positions = row_positions(c.query_len, c.q_start, None if d.cu is None else d.cu.cpu())
    ctx = op_context_for("select_blocks", (d.q, d.k_cmp), kw)
    _, lse = compressed_attention_fwd(d.q, d.k_cmp, d.v_cmp, g.cmp_block, g.cmp_stride, **kw)
    checks = []
    for backend in _gpu_backends("select_blocks"):
        toggles, reason = backend_decision(rt, "select_blocks", backend, ctx)
        skip = _skip_reason(backend, c.geometry, plan, opts)
        if reason is not None or skip is not None:
            status = "declined" if reason else "skipped"
            checks.append(Check("select_blocks", backend.name, status, reason or skip or ""))
            continue
        for label, extra in ((backend.name, {}), (f"{backend.name}+lse", {"lse": lse})):
            try:
                idx, counts = backend.fn(
                    d.q, d.k_cmp, *geo, g.num_selected, None, toggles=toggles, **kw, **extra
                )
                report = check_index_contract(idx, counts, ref_idx, scores, positions, g.sel_block)
                status = "fail" if report.broken_rows else "pass"
                detail = (
                    f"{report.broken_rows} broken, {report.tolerance_rows} tolerance rows of "
                    f"{report.rows}"
                    + (f"; first: {report.first_broken}" if report.broken_rows else "")
                )
            except Exception as exc:
                if is_fatal_cuda_error(exc):
                    raise
                status, detail = "fail", first_line(exc)
            checks.append(Check("select_blocks", label, status, detail))
    return checks


def _check_attention_op(
    rt: Runtime,
    plan: ParityPlan,
    c: ParityCase,
    op: str,
    inputs: Sequence[torch.Tensor],
    call: Callable[..., torch.Tensor],
    reference: Callable[..., torch.Tensor],
    kw: dict[str, Any],
    do: torch.Tensor,
    opts: ParityOptions,
    grad_names: Sequence[str] = ("dq", "dk", "dv"),
) -> list[Check]:
    """Every GPU backend of ``op`` against the reference on ``inputs`` (and their gradients,
    named ``grad_names``, when the geometry asks for them)."""
    g = plan.geometries[c.geometry]
    dtype = inputs[0].dtype
    bound, up = bound_for(dtype), reference_dtype(dtype)
    ref_leaves = leaves(inputs, up) if g.grad else [t.to(up) for t in inputs]
    ref = reference(*ref_leaves, **kw)
    if g.grad:
        backprop(ref, do.to(up))
    ref_grads = grads(ref_leaves) if g.grad else []
    ctx = dataclasses.replace(op_context_for(op, inputs, kw), requires_grad=g.grad)
    checks = []
    for backend in _gpu_backends(op):
        toggles, reason = backend_decision(rt, op, backend, ctx)
        skip = _skip_reason(backend, c.geometry, plan, opts)
        if reason is not None or skip is not None:
            checks.append(
                Check(op, backend.name, "declined" if reason else "skipped", reason or skip or "")
            )
            continue
        try:
            kern = leaves(inputs) if g.grad else list(inputs)
            out = call(backend.fn, *kern, toggles=toggles, **kw)
            errors = [("o", rel_err(out, ref), bound)]
            if g.grad and not out.requires_grad:
                # The reference stays connected (zero gradients where nothing is visible); a
                # detached output breaks backward() for a caller whose loss is this output.
                raise RuntimeError(
                    "the output is detached from q, k, v (no grad_fn), so backward cannot "
                    "reach them; the reference returns zero gradients here"
                )
            if g.grad:
                backprop(out, do)
                errors += [
                    (n, rel_err(a, b), GRAD_FACTOR * bound)
                    for n, a, b in zip(grad_names, grads(kern), ref_grads, strict=True)
                ]
            bad = [f"{n} {e:.3e} > {b:.0e}" for n, e, b in errors if not e <= b]
            detail = ", ".join(f"{n} {e:.2e}" for n, e, _ in errors)
            checks.append(
                Check(
                    op, backend.name, "fail" if bad else "pass", "; ".join(bad) if bad else detail
                )
            )
        except Exception as exc:
            if is_fatal_cuda_error(exc):
                raise
            checks.append(Check(op, backend.name, "fail", first_line(exc)))
    return checks


def run_parity_case(
    rt: Runtime, plan: ParityPlan, c: ParityCase, opts: ParityOptions
) -> list[Check]:
    import torch

    from nsa_core import registry
    from nsa_core.reference import (
        compressed_attention,
        gated_combine,
        select_blocks,
        selected_attention,
        sliding_attention,
    )

    g = plan.geometries[c.geometry]
    d = case_data(rt, g, c)
    kw: dict[str, Any] = {"q_start": c.q_start, "cu_seqlens": d.cu}
    checks = _check_select_blocks(rt, plan, c, d, opts)
    checks += _check_attention_op(
        rt, plan, c, "compressed_attention", (d.q, d.k_cmp, d.v_cmp),
        lambda fn, q, k, v, **kw: fn(q, k, v, g.cmp_block, g.cmp_stride, None, **kw),
        lambda q, k, v, **kw: compressed_attention(q, k, v, g.cmp_block, g.cmp_stride, **kw),
        kw, d.do, opts,
    )  # fmt: skip
    idx, _ = select_blocks(
        d.q, d.k_cmp, g.cmp_block, g.cmp_stride, g.sel_block, g.num_selected, **kw
    )
    checks += _check_attention_op(
        rt, plan, c, "selected_attention", (d.q, d.k, d.v),
        lambda fn, q, k, v, **kw: fn(q, k, v, idx, g.sel_block, None, **kw),
        lambda q, k, v, **kw: selected_attention(q, k, v, idx, g.sel_block, **kw),
        kw, d.do, opts,
    )  # fmt: skip
    checks += _check_attention_op(
        rt, plan, c, "sliding_attention", (d.q, d.k, d.v),
        lambda fn, q, k, v, **kw: fn(q, k, v, g.window, None, **kw),
        lambda q, k, v, **kw: sliding_attention(q, k, v, g.window, **kw),
        kw, d.do, opts,
    )  # fmt: skip
    if "gated_combine" in registry.OPS:
        gen = torch.Generator(device=rt.device).manual_seed(c.data_seed + 1)
        shape = d.do.shape
        branch_outs = [randn(gen, shape, d.q.dtype, rt.device) for _ in range(3)]
        gates = torch.sigmoid(randn(gen, (*shape[:3], 3), torch.float32, rt.device)).to(d.q.dtype)
        checks += _check_attention_op(
            rt, plan, c, "gated_combine", (*branch_outs, gates),
            lambda fn, o_cmp, o_sel, o_win, gates, **kw: fn(o_cmp, o_sel, o_win, gates, **kw),
            lambda o_cmp, o_sel, o_win, gates: gated_combine(o_cmp, o_sel, o_win, gates),
            {}, d.do, opts, grad_names=("do_cmp", "do_sel", "do_win", "dgates"),
        )  # fmt: skip
    covered = {"select_blocks", "compressed_attention", "selected_attention", "sliding_attention"}
    covered.add("gated_combine")
    for op in registry.OPS:
        if op not in covered:
            checks += [
                Check(op, b.name, "skipped", "op not covered by this script")
                for b in _gpu_backends(op)
            ]
    return checks


@dataclass
class BackendTally:
    passed: int = 0
    failed: int = 0
    declined: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)

    def line(self, name: str) -> str:
        parts = [f"{name}: {self.passed + self.failed} run, {self.failed} failed"]
        if self.declined:
            top = "; ".join(f"{n}x {r}" for r, n in self.declined.most_common(3))
            parts.append(f"declined {sum(self.declined.values())} ({top})")
        if self.skipped:
            top = "; ".join(f"{n}x {r}" for r, n in self.skipped.most_common(2))
            parts.append(f"skipped {sum(self.skipped.values())} ({top})")
        return ", ".join(parts)


def tally(checks_by_case: dict[int, list[Check]]) -> dict[str, BackendTally]:
    out: dict[str, BackendTally] = {}
    for checks in checks_by_case.values():
        for ch in checks:
            t = out.setdefault(f"{ch.op}/{ch.backend}", BackendTally())
            if ch.status == "pass":
                t.passed += 1
            elif ch.status == "fail":
                t.failed += 1
            elif ch.status == "declined":
                t.declined[ch.detail[:120]] += 1
            else:
                t.skipped[ch.detail[:120]] += 1
    return out


# Backends every parity run must have exercised on a GPU (and any other Triton backend it met):
# a run where they all declined (a toggle turned them off) would pass without testing them.
REQUIRED_BACKENDS = (
    "select_blocks/triton_score",
    "compressed_attention/triton_cmp",
    "selected_attention/triton_sel",
)


def _parity_plan(args: argparse.Namespace) -> tuple[ParityPlan, tuple[ParityCase, ...], str]:
    """The plan, the cases this call runs, and the command that replays one of them."""
    limits = limits_for(args.device)
    if args.dtype:
        limits = dataclasses.replace(limits, dtypes=tuple(args.dtype))
    count = args.cases if args.case is None else args.case + 1
    plan = make_plan(args.seed, count, limits)
    cases = plan.cases if args.case is None else (plan.cases[args.case],)
    # Everything that shapes the plan: case N of these arguments is the same for any --cases.
    replay = f"python ci/gpu_robustness.py parity --seed {args.seed}"
    replay += " --device cpu" if args.device == "cpu" else ""
    replay += f" --dtype {' '.join(args.dtype)}" if args.dtype else ""
    return plan, cases, replay + " --case N"


def _run_cases(
    args: argparse.Namespace, plan: ParityPlan, cases: Sequence[ParityCase], start: float
) -> tuple[dict[int, list[Check]], str]:
    """Run ``cases`` in this process: their checks by case index, and why it stopped early."""
    rt = setup_runtime(args.device)
    opts = ParityOptions(args.flex_geometries)
    results: dict[int, list[Check]] = {}
    failed = 0
    for n, c in enumerate(cases):
        elapsed = time.perf_counter() - start
        if args.time_limit and elapsed > args.time_limit:
            return results, (
                f"stopped by --time-limit {args.time_limit:.0f} s after {n} of {len(cases)} cases"
            )
        try:
            results[c.index] = run_parity_case(rt, plan, c, opts)
        except Exception as exc:
            results[c.index] = [Check("case", "-", "fail", first_line(exc))]
            if is_fatal_cuda_error(exc):
                return results, f"stopped after case {c.index}: the CUDA context is lost"
        failed += any(ch.status == "fail" for ch in results[c.index])
        if n % 10 == 0 or n == len(cases) - 1:
            log(
                "parity",
                f"case {c.index} ({n + 1}/{len(cases)}, {elapsed:.0f} s): geometry "
                f"{c.geometry}, {c.describe()}; {failed} failed cases so far",
            )
    return results, ""


def _run_workers(
    args: argparse.Namespace, plan: ParityPlan, out: Path
) -> tuple[dict[int, list[Check]], list[str], dict[str, str]]:
    """The cases in ``args.workers`` processes, each owning whole geometries (so each compiles
    only its own kernels, side by side with the others): merged results, stops, environment."""
    workers = min(args.workers, len(plan.geometries))
    command = [sys.executable, str(SCRIPT), "parity", "--out", str(out)]
    command += ["--device", args.device, "--seed", str(args.seed), "--cases", str(args.cases)]
    command += ["--flex-geometries", str(args.flex_geometries)]
    command += ["--time-limit", str(args.time_limit)] + (
        ["--dtype", *args.dtype] if args.dtype else []
    )
    # Workers stop themselves between cases at --time-limit; a case in flight gets a margin.
    limit = args.time_limit + 30 if args.time_limit else 3600.0
    children = [
        Child(
            f"worker {i}", [*command, "--shard", f"{i}/{workers}"], out / f"parity_{i}.log", limit
        )
        for i in range(workers)
    ]
    for i in range(workers):
        (out / f"parity_shard_{i}.json").unlink(missing_ok=True)
    worker_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    run_children(children, worker_env, "parity", visible_gpus(args.device, worker_env))
    results: dict[int, list[Check]] = {}
    stops: list[str] = []
    env: dict[str, str] = {}
    for i, part in enumerate(load_parts(out, [f"parity_shard_{i}" for i in range(workers)])):
        if part.status != "PASS":
            stops.append(f"worker {i}: no result (it crashed or timed out); see parity_{i}.log")
            continue
        env = env or part.env
        for index, checks in part.details["results"].items():
            results[int(index)] = [Check(**ch) for ch in checks]
        if part.details["stopped"]:
            stops.append(f"worker {i}: {part.details['stopped']}")
    return results, stops, env


def run_parity(args: argparse.Namespace) -> PartResult:
    start = time.perf_counter()
    plan, cases, replay = _parity_plan(args)
    out = Path(args.out)
    if args.shard:  # one worker of a parallel run: its geometries, its results only
        index, count = parse_shard(args.shard)
        mine = [c for c in cases if c.geometry % count == index]
        log("parity", f"worker {index}: {len(mine)} cases of geometries {index}::{count}")
        results, stopped = _run_cases(args, plan, mine, start)
        raw = {i: [dataclasses.asdict(ch) for ch in checks] for i, checks in results.items()}
        return PartResult(
            f"parity_shard_{index}",
            "PASS",  # ran; the parent judges the checks
            f"{len(results)} of {len(mine)} cases run",
            time.perf_counter() - start,
            {"results": raw, "stopped": stopped},
            [],
            environment(),
        )
    setup_runtime(args.device)  # fail here, with the reason, rather than in every worker
    log(
        "parity",
        f"seed {args.seed}, {len(cases)} cases over {len(plan.geometries)} geometries; "
        f"replay one with `{replay}`",
    )
    for i, geometry in enumerate(plan.geometries):
        log("parity", f"geometry {i}: {geometry.describe()}")
    if args.workers > 1 and args.case is None:
        results, stops, env = _run_workers(args, plan, out)
    else:
        results, stopped = _run_cases(args, plan, cases, start)
        stops, env = [stopped] if stopped else [], environment()
    return parity_verdict(args, plan, cases, results, stops, env, replay, start)


def parity_verdict(
    args: argparse.Namespace,
    plan: ParityPlan,
    cases: Sequence[ParityCase],
    results: dict[int, list[Check]],
    stops: Sequence[str],
    env: dict[str, str],
    replay: str,
    start: float,
) -> PartResult:
    by_index = {c.index: c for c in cases}
    failures = []
    for index in sorted(results):
        c = by_index[index]
        for ch in results[index]:
            if ch.status == "fail":
                failures.append(
                    f"case {c.index} (seed {args.seed}; geometry {c.geometry}: "
                    f"{plan.geometries[c.geometry].describe()}; {c.describe()}): "
                    f"{ch.op}/{ch.backend}: {ch.detail}"
                )
    tallies = tally(results)
    if args.device == "cuda" and args.case is None:
        triton = {n for n in tallies if n.split("/")[1].startswith("triton")}
        for name in sorted(triton | set(REQUIRED_BACKENDS)):
            ran = tallies.get(name, BackendTally())
            if ran.passed + ran.failed == 0:
                failures.append(f"{name} never ran: {ran.line(name)}")
    failures += stops
    if len(results) < len(cases):
        failures.append(f"{len(cases) - len(results)} of {len(cases)} cases did not run")
    per_backend = [t.line(name) for name, t in sorted(tallies.items())]
    for line in per_backend:
        log("parity", line)
    checks_run = sum(t.passed + t.failed for t in tallies.values())
    failed_cases = sorted(
        i for i, checks in results.items() if any(c.status == "fail" for c in checks)
    )
    headline = (
        f"{len(results) - len(failed_cases)}/{len(cases)} cases pass (seed {args.seed}), "
        f"{checks_run} backend checks, {sum(t.failed for t in tallies.values())} failed"
    )
    details = {
        "seed": args.seed,
        "replay": replay,
        "geometries": [f"{i}: {g.describe()}" for i, g in enumerate(plan.geometries)],
        "backends": per_backend,
        "failed_cases": ", ".join(map(str, failed_cases)) or "none",
    }
    status = "FAIL" if failures else "PASS"
    wall = time.perf_counter() - start
    return PartResult("parity", status, headline, wall, details, failures, env)
