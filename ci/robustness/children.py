"""Work split over child processes: shards of a list, children started together (one per GPU in
turn where there are several), each killed with its process group past its timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ci.robustness.common import ROOT, log


def parse_shard(text: str) -> tuple[int, int]:
    """``"2/6"`` -> (2, 6): shard 2 of 6 (0-based)."""
    index, sep, count = text.partition("/")
    if not (sep and index.isdigit() and count.isdigit()) or not 0 <= int(index) < int(count):
        raise ValueError(f"--shard wants I/N with 0 <= I < N, got {text!r}")
    return int(index), int(count)


def shard_of(items: Sequence[Any], index: int, count: int) -> list[Any]:
    """Every ``count``-th item from ``index`` on: the heavy families of the sweep (one case per
    G, each compiling its own kernels) spread evenly over the shards."""
    return list(items[index::count])


@dataclass
class Child:
    """One child process: its command, its log (stdout and stderr together) and its timeout;
    ``run_children`` fills in the rest as it runs."""

    name: str
    command: list[str]
    log_path: Path
    timeout_s: float
    process: subprocess.Popen[bytes] | None = None
    start: float = 0.0
    returncode: int | None = None
    timed_out: bool = False
    wall_s: float = 0.0


def visible_gpus(device: str, env: dict[str, str]) -> list[str]:
    """The CUDA device ids children may be pinned to (``CUDA_VISIBLE_DEVICES`` values); empty on
    CPU or with one GPU, where every child simply inherits ``env``."""
    if device != "cuda":
        return []
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        ids = [i.strip() for i in listed.split(",") if i.strip()]
    else:
        import torch

        ids = [str(i) for i in range(torch.cuda.device_count())]
    return ids if len(ids) > 1 else []


def run_children(
    children: Sequence[Child], env: dict[str, str], part: str, gpus: Sequence[str] = ()
) -> None:
    """Start ``children`` together, wait, kill a child past its timeout (its whole group).

    ``gpus``: device ids; child i runs on ``gpus[i % len(gpus)]`` alone, so a host with several
    GPUs runs the children side by side on all of them."""
    for i, child in enumerate(children):
        child.log_path.parent.mkdir(parents=True, exist_ok=True)
        handle = child.log_path.open("wb")
        child.start = time.perf_counter()
        gpu = gpus[i % len(gpus)] if gpus else None
        child_env = env if gpu is None else {**env, "CUDA_VISIBLE_DEVICES": gpu}
        child.process = subprocess.Popen(
            child.command,
            stdout=handle,
            stderr=subprocess.STDOUT,
            env=child_env,
            cwd=ROOT,
            start_new_session=True,
        )
        handle.close()
        on_gpu = "" if gpu is None else f" on GPU {gpu}"
        log(
            part,
            f"{child.name}: started{on_gpu} ({' '.join(child.command[:4])} ...), "
            f"log {child.log_path}",
        )
    last_note = time.perf_counter()
    while any(c.returncode is None for c in children):
        time.sleep(1.0)
        for child in children:
            if child.returncode is not None or child.process is None:
                continue
            elapsed = time.perf_counter() - child.start
            code = child.process.poll()
            if code is not None:
                child.returncode, child.wall_s = code, elapsed
                log(part, f"{child.name}: exit {code} after {elapsed:.0f} s")
            elif elapsed > child.timeout_s:
                os.killpg(child.process.pid, signal.SIGKILL)
                child.returncode, child.timed_out, child.wall_s = (
                    child.process.wait(),
                    True,
                    elapsed,
                )
                log(part, f"{child.name}: killed after {elapsed:.0f} s (timeout)")
        if time.perf_counter() - last_note > 30:
            last_note = time.perf_counter()
            running = [
                f"{c.name} {time.perf_counter() - c.start:.0f} s"
                for c in children
                if c.returncode is None
            ]
            if running:
                log(part, "running: " + ", ".join(running))
