"""The long part: 128k and 256k tokens through the Triton selected branch and the whole attention
core, forward and backward; sampled rows against a float32 recomputation of those rows with the
reference ops, block indices under the index contract, every gradient finite."""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ci.robustness.common import GRAD_FACTOR, first_line, is_fatal_cuda_error, log
from ci.robustness.report import PartResult
from ci.robustness.runtime import (
    CORE_TENSORS,
    Runtime,
    backprop,
    bound_for,
    call_op,
    environment,
    grads,
    leaves,
    non_finite,
    randn,
    rel_err,
    setup_runtime,
    sync,
    torch_dtype,
)

if TYPE_CHECKING:
    import torch


def parse_lengths(text: str) -> list[int]:
    """``"128k,256k,3000"`` -> [131072, 262144, 3000] (k = 1024)."""
    out = []
    for item in filter(None, (part.strip().lower() for part in text.split(","))):
        scale = 1024 if item.endswith("k") else 1
        digits = item[:-1] if item.endswith("k") else item
        if not digits.isdigit() or int(digits) < 1:
            raise ValueError(f"{item!r} is not a length like 4096 or 128k")
        out.append(int(digits) * scale)
    if not out:
        raise ValueError(f"no lengths in {text!r}")
    return out


def sample_rows(seq_len: int, count: int, *, last: int = 8) -> list[int]:
    """``count`` distinct rows of a sequence, ascending: row 0, the ``last`` final rows (where
    int32 offsets overflow first), and the rest evenly spread with a deterministic jitter."""
    count = min(count, seq_len)
    rows = set(range(max(0, seq_len - min(last, count)), seq_len))
    if count > len(rows):
        rows.add(0)
    rng = random.Random(seq_len)
    spread = count - len(rows)
    for i in range(spread):
        lo = (i * (seq_len - last)) // max(spread, 1)
        hi = ((i + 1) * (seq_len - last)) // max(spread, 1)
        rows.add(rng.randrange(lo, max(hi, lo + 1)))
    candidate = 1
    while len(rows) < count:  # collisions on short sequences: fill with the first free rows
        rows.add(candidate)
        candidate += 1
    return sorted(rows)[:count]


@dataclass
class Measure:
    """One compared quantity: its error against the reference and its bound (or a failure)."""

    name: str
    error: float | None
    bound: float | None
    note: str = ""

    @property
    def passed(self) -> bool:
        return self.error is not None and self.bound is not None and self.error <= self.bound

    def line(self) -> str:
        if self.error is None:
            return f"{self.name}: {self.note}"
        verdict = "ok" if self.passed else "FAIL"
        extra = f" ({self.note})" if self.note else ""
        return f"{self.name}: {self.error:.3e} <= {self.bound:.0e} {verdict}{extra}"


def _all_finite(piece: str, named: Iterable[tuple[str, torch.Tensor]]) -> Measure:
    """How many of the piece's outputs and gradients hold a NaN or an infinity (bound 0)."""
    bad = non_finite(named)
    return Measure(f"{piece} outputs and gradients finite", float(len(bad)), 0.0, ", ".join(bad))


@contextmanager
def timed(part: str, what: str) -> Iterator[None]:
    start = time.perf_counter()
    log(part, f"{what} ...")
    yield
    log(part, f"{what}: {time.perf_counter() - start:.1f} s")


def _paper_config(hq: int, h: int, dk: int, dv: int) -> Any:
    from nsa_core import NSAConfig

    return NSAConfig(num_q_heads=hq, num_kv_heads=h, head_dim_qk=dk, head_dim_v=dv)


def _contract_on_rows(
    idx: torch.Tensor,
    counts: torch.Tensor,
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    cfg: Any,
    rows: Sequence[int],
) -> Measure:
    """The index contract on sampled rows, each against the reference at q_start = row."""
    import torch

    from nsa_core.reference import select_blocks
    from nsa_kernels.scoring.contract import check_index_contract, reference_scores

    geo = (cfg.cmp_block, cfg.cmp_stride, cfg.sel_block)
    broken = tolerance = 0
    first = ""
    for t in rows:
        qr = q[:, t : t + 1]
        ref_idx, _ = select_blocks(qr, k_cmp, *geo, cfg.num_selected, q_start=t)
        scores = reference_scores(qr, k_cmp, *geo, q_start=t)
        report = check_index_contract(
            idx[:, t : t + 1],
            counts[:, t : t + 1],
            ref_idx,
            scores,
            torch.tensor([t]),
            cfg.sel_block,
        )
        broken += report.broken_rows
        tolerance += report.tolerance_rows
        first = first or report.first_broken
    rows_checked = len(rows) * idx.shape[2]
    note = f"{tolerance} tolerance rows of {rows_checked}" + (
        f"; first broken: {first}" if first else ""
    )
    return Measure("select_blocks index contract (broken rows)", float(broken), 0.0, note)


def _long_selected(
    rt: Runtime, tokens: int, a: argparse.Namespace, gen: torch.Generator
) -> list[Measure]:
    """The selected branch (Triton) forward and backward at ``tokens`` tokens, checked on rows.

    Block indices come from the Triton block scoring (checked under the index contract on the
    sampled rows). A backward with a dense upstream gradient checks that every gradient is
    finite and gives dq of the sampled rows (dq of a row depends on its own upstream gradient
    only); a second backward with the upstream gradient of the sampled rows alone gives dk and
    dv that the reference recomputes exactly from those rows.
    """
    import torch

    from nsa_core.reference import compress, selected_attention

    cfg = _paper_config(a.hq, a.h, a.dim, a.dim)
    dtype = torch_dtype(a.dtype)
    bound = bound_for(dtype)
    rows = sample_rows(tokens, a.rows)
    # Leaves from the start: at the longest lengths q alone fills gigabytes, so no second copy.
    q = randn(gen, (1, tokens, a.hq, a.dim), dtype, rt.device).requires_grad_()
    k = randn(gen, (1, tokens, a.h, a.dim), dtype, rt.device).requires_grad_()
    v = randn(gen, (1, tokens, a.h, a.dim), dtype, rt.device).requires_grad_()
    with timed("long", f"T={tokens} selected: block scoring"), torch.no_grad():
        k_cmp = compress(k.detach(), cfg.cmp_block, cfg.cmp_stride)
        geo = (cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, cfg.num_selected)
        idx, counts = call_op(rt, "select_blocks", ["triton_score"], q.detach(), k_cmp, *geo)
        measures = [_contract_on_rows(idx, counts, q.detach(), k_cmp, cfg, rows)]
        del k_cmp
        sync(rt)
    do = randn(gen, q.shape, dtype, rt.device)
    with timed("long", f"T={tokens} selected: forward and backward"):
        o = call_op(rt, "selected_attention", ["triton_sel"], q, k, v, idx, cfg.sel_block)
        backprop(o, do, retain_graph=True)
        sync(rt)
    tensors = [o, *grads([q, k, v])]
    measures.append(_all_finite("selected", zip(("o", "dq", "dk", "dv"), tensors, strict=True)))
    dq_rows = grads([q])[0][:, rows].clone()
    for leaf in (q, k, v):
        leaf.grad = None
    do_rows = torch.zeros_like(do)
    do_rows[:, rows] = do[:, rows]
    with timed("long", f"T={tokens} selected: backward of the sampled rows"):
        backprop(o, do_rows)
        sync(rt)
    del do_rows
    o_rows = o.detach()[:, rows].clone()
    del o
    dk_rows, dv_rows = grads([k, v])
    kf, vf = leaves([k, v], torch.float32)
    ref_o, ref_dq = [], []
    with timed("long", f"T={tokens} selected: float32 reference on {len(rows)} rows"):
        for t in rows:
            qr = q.detach()[:, t : t + 1].float().requires_grad_()
            out = selected_attention(qr, kf, vf, idx[:, t : t + 1], cfg.sel_block, q_start=t)
            backprop(out, do[:, t : t + 1].float())
            assert qr.grad is not None
            ref_o.append(out.detach())
            ref_dq.append(qr.grad)
        sync(rt)
    ref_dk, ref_dv = grads([kf, vf])
    grad_bound = GRAD_FACTOR * bound
    measures += [
        Measure("selected o (sampled rows)", rel_err(o_rows, torch.cat(ref_o, 1)), bound),
        Measure("selected dq (sampled rows)", rel_err(dq_rows, torch.cat(ref_dq, 1)), grad_bound),
        Measure("selected dk (loss of the sampled rows)", rel_err(dk_rows, ref_dk), grad_bound),
        Measure("selected dv (loss of the sampled rows)", rel_err(dv_rows, ref_dv), grad_bound),
    ]
    return measures


def _core_routes(rt: Runtime, tokens: int, q: torch.Tensor, k: torch.Tensor) -> list[str]:
    """The routing report of the core's calls; on CUDA no step may fall back to the reference."""
    from nsa_core import registry
    from nsa_core.ops import op_context
    from nsa_core.toggles import get_toggles

    ctx = op_context(q, k, k, tokens, varlen=False)
    routing = registry.routing_report(ctx, get_toggles()).splitlines()
    for line in routing:
        log("long", f"T={tokens} route {line}")
    if rt.cuda:
        for line in routing:
            op, chosen = line.split("->")[0].strip(), line.split("->")[1].split()[0]
            if chosen == "reference":
                raise AssertionError(f"the core routes {op} to the reference at T={tokens}")
    return routing


def _long_core(
    rt: Runtime, tokens: int, a: argparse.Namespace, gen: torch.Generator
) -> tuple[list[Measure], list[str]]:
    """The attention core (nsa_attention) forward and backward on its default routes.

    Its output rows, and dq and dgates of those rows (each depends on that row's upstream
    gradient only: selection carries no gradient), against the reference ops recomputing the
    rows in float32 with the block indices the core used; every gradient finite.
    """
    import torch

    from nsa_core import nsa_attention
    from nsa_core.attention import branch_outputs
    from nsa_core.reference import (
        compress,
        compressed_attention,
        gated_combine,
        selected_attention,
        sliding_attention,
    )

    cfg = _paper_config(a.hq, a.h, a.dim, a.dim)
    dtype = torch_dtype(a.dtype)
    bound = bound_for(dtype)
    rows = sample_rows(tokens, a.rows)
    branches = ("cmp", "sel", "win")
    q = randn(gen, (1, tokens, a.hq, a.dim), dtype, rt.device).requires_grad_()
    k = {
        b: randn(gen, (1, tokens, a.h, a.dim), dtype, rt.device).requires_grad_() for b in branches
    }
    v = {
        b: randn(gen, (1, tokens, a.h, a.dim), dtype, rt.device).requires_grad_() for b in branches
    }
    gates = torch.sigmoid(randn(gen, (1, tokens, a.hq, 3), torch.float32, rt.device))
    gates = gates.to(dtype).requires_grad_()
    routing = _core_routes(rt, tokens, q, k["sel"])
    inputs = [q, *(k[b] for b in branches), *(v[b] for b in branches), gates]
    do = randn(gen, q.shape, dtype, rt.device)
    with timed("long", f"T={tokens} core: forward and backward"):
        o = nsa_attention(q, k, v, gates, cfg)
        backprop(o, do)
        sync(rt)
    measures = [_all_finite("core", zip(CORE_TENSORS, [o, *grads(inputs)], strict=True))]
    o_rows = o.detach()[:, rows].clone()
    dq_rows = grads([q])[0][:, rows].clone()
    dg_rows = grads([gates])[0][:, rows].clone()
    del o
    for leaf in inputs:
        leaf.grad = None
    q0, g0 = q.detach(), gates.detach()
    k0 = {b: x.detach() for b, x in k.items()}
    v0 = {b: x.detach() for b, x in v.items()}
    with timed("long", f"T={tokens} core: the block indices it used"), torch.no_grad():
        # branch_outputs is what nsa_attention runs (block scoring fed whatever the compressed
        # branch hands it): deterministic kernels give the very indices of the forward above.
        k_cmp = compress(k0["cmp"], cfg.cmp_block, cfg.cmp_stride)
        v_cmp = compress(v0["cmp"], cfg.cmp_block, cfg.cmp_stride)
        idx = branch_outputs(cfg, q0, k_cmp, v_cmp, k0["sel"], v0["sel"], k0["win"], v0["win"])[3]
        counts = (idx >= 0).sum(-1, dtype=torch.int32)
        measures.append(_contract_on_rows(idx, counts, q0, k_cmp, cfg, rows))
        del k_cmp, v_cmp
    f32 = {f"{kv}_{b}": x[b].float() for kv, x in (("k", k0), ("v", v0)) for b in branches}
    k_cmp_f = compress(f32["k_cmp"], cfg.cmp_block, cfg.cmp_stride)
    v_cmp_f = compress(f32["v_cmp"], cfg.cmp_block, cfg.cmp_stride)
    ref_o, ref_dq, ref_dg = [], [], []
    with timed("long", f"T={tokens} core: float32 reference on {len(rows)} rows"):
        for t in rows:
            qr = q0[:, t : t + 1].float().requires_grad_()
            gr = g0[:, t : t + 1].float().requires_grad_()
            row = idx[:, t : t + 1]
            o_cmp = compressed_attention(
                qr, k_cmp_f, v_cmp_f, cfg.cmp_block, cfg.cmp_stride, q_start=t
            )
            o_sel = selected_attention(
                qr, f32["k_sel"], f32["v_sel"], row, cfg.sel_block, q_start=t
            )
            o_win = sliding_attention(qr, f32["k_win"], f32["v_win"], cfg.window, q_start=t)
            out = gated_combine(o_cmp, o_sel, o_win, gr)
            backprop(out, do[:, t : t + 1].float())
            assert qr.grad is not None
            assert gr.grad is not None
            ref_o.append(out.detach())
            ref_dq.append(qr.grad)
            ref_dg.append(gr.grad)
        sync(rt)
    grad_bound = GRAD_FACTOR * bound
    measures += [
        Measure("core o (sampled rows)", rel_err(o_rows, torch.cat(ref_o, 1)), bound),
        Measure("core dq (sampled rows)", rel_err(dq_rows, torch.cat(ref_dq, 1)), grad_bound),
        Measure("core dgates (sampled rows)", rel_err(dg_rows, torch.cat(ref_dg, 1)), grad_bound),
    ]
    return measures, routing


def run_long(args: argparse.Namespace) -> PartResult:
    import torch

    start = time.perf_counter()
    rt = setup_runtime(args.device)
    lengths = parse_lengths(args.lengths)
    details: dict[str, Any] = {
        "shape": f"B=1 HQ={args.hq} H={args.h} d={args.dim} {args.dtype}, rows {args.rows}"
    }
    failures: list[str] = []
    checked: list[str] = []
    for tokens in lengths:
        for piece in args.pieces:
            label = f"T={tokens} {piece}"
            gen = torch.Generator(device=rt.device).manual_seed(tokens + len(piece))
            if rt.cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            piece_start = time.perf_counter()
            try:
                if piece == "selected":
                    measures = _long_selected(rt, tokens, args, gen)
                else:
                    measures, routing = _long_core(rt, tokens, args, gen)
                    details[f"{label} routing"] = routing
            except Exception as exc:
                failures.append(f"{label}: {first_line(exc)}")
                log("long", f"{label}: FAILED {first_line(exc)}")
                if is_fatal_cuda_error(exc):
                    failures.append(
                        "the CUDA context is lost; the remaining long checks did not run"
                    )
                    return PartResult(
                        "long",
                        "FAIL",
                        f"{label}: {first_line(exc)}",
                        time.perf_counter() - start,
                        details,
                        failures,
                        environment(rt),
                    )
                continue
            peak = f", peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if rt.cuda else ""
            lines = [m.line() for m in measures]
            details[label] = [*lines, f"{time.perf_counter() - piece_start:.1f} s{peak}"]
            for m in measures:
                log("long", f"{label}: {m.line()}")
                if not m.passed:
                    failures.append(f"{label}: {m.line()}")
            checked.append(label)
    status = "FAIL" if failures else "PASS"
    head = (
        f"{len(checked)}/{len(lengths) * len(args.pieces)} runs within bounds "
        f"(T = {', '.join(map(str, lengths))}: {', '.join(args.pieces)})"
    )
    return PartResult(
        "long", status, head, time.perf_counter() - start, details, failures, environment(rt)
    )
