"""``nsa-bench decode --ragged B:LO-HI``: a ragged batch in a paged cache against a dense batch.

B sequences with lengths spread evenly over [LO, HI] decode through nsa-kernels' fused step
(CUDA graph replays, as ``nsa-bench decode``), three ways in one run:

- ``uniform``: B sequences of the mean length in a dense state, the baseline: the same total
  tokens, so the same total reads (a step reads N_cmp(L) compressed blocks, n selected blocks
  and w window keys per sequence and kv head: linear in L);
- ``ragged_dense``: the spread lengths in a dense state (every sequence sized for the longest);
- ``ragged_paged``: the spread lengths with the selected-branch K/V in pages of
  ``--page-size`` tokens from one pool, each sequence holding only its own pages, shuffled.

Every plan sizes its split-K chunks for the batch's mean length (``DecodePlan(tokens=...)``),
the grids covering the capacity. ``vs uniform`` is the uniform ms over the row's (>= 0.91:
within 10%). ``replays`` graph steps
of the paged state are then checked against as many eager steps from a copy of it, with the same
inputs: ``replay mismatches`` counts the steps whose outputs, indices or reads differ in any bit.
Rows go to ``ragged.csv``, ``ragged.json`` and ``ragged.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nsa_bench.env import collect
from nsa_core import NSAConfig

if TYPE_CHECKING:
    from nsa_kernels.decode.state import DecodeState, PageTable
    from nsa_kernels.decode.step import DecodeKernelConfig


def parse_ragged(text: str) -> tuple[int, int, int]:
    """``"32:1k-128k"`` -> (B, LO, HI); 1 <= LO <= HI, B >= 1."""
    from nsa_bench.cli_args import seqlens

    batch_text, _, span = text.partition(":")
    lo_text, _, hi_text = span.partition("-")
    try:
        batch = int(batch_text)
        lo, hi = seqlens(f"{lo_text},{hi_text}")
    except (ValueError, argparse.ArgumentTypeError) as exc:
        message = f"expected B:LO-HI such as 32:1k-128k, got {text!r}"
        raise argparse.ArgumentTypeError(message) from exc
    if batch < 1 or not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"need B >= 1 and 1 <= LO <= HI, got {text!r}")
    return batch, lo, hi


def spread(batch: int, lo: int, hi: int) -> list[int]:
    """B lengths evenly spaced over [lo, hi] (one sequence: lo)."""
    if batch == 1:
        return [lo]
    return [lo + round(i * (hi - lo) / (batch - 1)) for i in range(batch)]


def _progress(text: str) -> None:
    print(f"[decode --ragged] {text}", file=sys.stderr, flush=True)


def _mismatched_replays(
    state: DecodeState, kernel_cfg: DecodeKernelConfig, steps: int, tokens: int
) -> int:
    """Of ``steps`` graph replays from ``state`` and as many eager steps from a copy of it, the
    same inputs every step: how many steps differ in any bit (outputs, indices or reads)."""
    from nsa_bench.decode_bench import random_inputs
    from nsa_kernels.decode.graph import DecodeGraph
    from nsa_kernels.decode.step import DecodePlan, decode_step

    eager_state = state.clone()
    graph = DecodeGraph(state, config=kernel_cfg, tokens=tokens)
    inputs = random_inputs(state)
    graph.inputs.copy_(inputs)
    plan = DecodePlan(eager_state, kernel_cfg, tokens=tokens)
    mismatches = torch.zeros((), dtype=torch.int64, device="cuda")
    for _ in range(steps):
        got = graph.replay()
        want = decode_step(eager_state, inputs, plan=plan)
        # NaN != NaN: a NaN output counts as a mismatch.
        differ = (got.o != want.o).any() | (got.indices != want.indices).any()
        differ = differ | (got.reads != want.reads).any()
        mismatches += differ.to(torch.int64)
    return int(mismatches)


def run_ragged(args: argparse.Namespace, cfg: NSAConfig, kernel_cfg: DecodeKernelConfig) -> int:
    from nsa_bench.decode_bench import DTYPES, filled_state, nsa_step_ms
    from nsa_kernels.decode.state import PageTable

    batch, lo, hi = args.ragged
    dtype = DTYPES[args.dtype]
    lengths = spread(batch, lo, hi)
    mean = round(sum(lengths) / batch)
    # Room for the timed steps (restored after each timing) and the replay check.
    extra = args.iters * (args.repeats + 1) + args.replays + 64
    rows: list[dict[str, Any]] = []
    layouts: list[tuple[str, list[int], PageTable | None]] = [
        ("uniform", [mean] * batch, None),
        ("ragged_dense", lengths, None),
        (
            "ragged_paged",
            lengths,
            PageTable.for_capacities(
                [n + extra for n in lengths], args.page_size, device="cuda",
                generator=torch.Generator().manual_seed(5),
            ),
        ),
    ]  # fmt: skip
    for name, case_lengths, pages in layouts:
        capacity = max(case_lengths) + extra
        _progress(f"{name}: B={batch}, tokens {sum(case_lengths)}, capacity {capacity}")
        state = filled_state(cfg, case_lengths, capacity, dtype, pages)
        ms, graph, outputs = nsa_step_ms(state, kernel_cfg, args, tokens=sum(case_lengths))
        reads = int(outputs.reads.sum())
        row: dict[str, Any] = {
            "layout": name,
            "B": batch,
            "lengths": f"{min(case_lengths)}..{max(case_lengths)}",
            "tokens": sum(case_lengths),
            "page_size": None if pages is None else pages.page_size,
            "sel_cache_mib": round(state.k_sel.numel() * state.k_sel.element_size() * 2 / 2**20),
            "ms_step": round(ms, 5),
            "reads_last_step": reads,
            "replays": None,
            "replay_mismatches": None,
            "plan": "" if graph is None else graph.plan.describe(),
            "device": torch.cuda.get_device_name(),
        }
        if pages is not None and args.replays:
            _progress(f"{name}: {args.replays} graph replays against eager steps")
            row["replays"] = args.replays
            row["replay_mismatches"] = _mismatched_replays(
                state, kernel_cfg, args.replays, sum(case_lengths)
            )
        rows.append(row)
        print(json.dumps(row), flush=True)
        del state, outputs, graph
        torch.cuda.empty_cache()
    base = rows[0]["ms_step"]
    for row in rows:
        row["vs_uniform"] = round(base / row["ms_step"], 3)
    _write(rows, args)
    print(markdown(rows))
    return 0


COLUMNS = (
    "layout", "B", "lengths", "tokens", "page_size", "sel_cache_mib", "ms_step", "vs_uniform",
    "reads_last_step", "replays", "replay_mismatches", "plan", "device",
)  # fmt: skip


def _write(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "ragged.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(COLUMNS), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    meta = {"env": collect(nvidia_smi=None), "rows": rows}
    (out / "ragged.json").write_text(json.dumps(meta, indent=1))
    (out / "ragged.md").write_text(markdown(rows) + "\n")


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as one Markdown table."""
    lines = [
        "| layout | B | lengths | tokens | page | selected K/V MiB | step ms | vs uniform "
        "| reads (last step) | replays | mismatched steps |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def cell(x: object) -> str:
        return "-" if x is None else str(x)

    for r in rows:
        lines.append(
            f"| {r['layout']} | {r['B']} | {r['lengths']} | {r['tokens']} | {cell(r['page_size'])} "
            f"| {r['sel_cache_mib']} | {r['ms_step']} | {r['vs_uniform']} "
            f"| {r['reads_last_step']} | {cell(r['replays'])} | {cell(r['replay_mismatches'])} |"
        )
    return "\n".join(lines)
