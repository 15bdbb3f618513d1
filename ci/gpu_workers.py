"""How many pytest-xdist workers a GPU tier runs on this host, and which GPUs they share.

    python3 ci/gpu_workers.py            # "16 0": workers, then the GPU list for --worker-gpus
    python3 ci/gpu_workers.py --explain  # the same, with the card memory and cores behind it

Each GPU takes as many workers as its memory holds at ``GIB_PER_WORKER`` each, and each worker
takes ``CORES_PER_WORKER`` of the host's cores. Most GPU tests need a small part of that; the
few that need more (the 64k forward+backward of the layer, in the slow tier) are too few to
meet more than a handful at once, and a worker hands its cached blocks back to the card after a
test that left more than ``RELEASE_GIB`` reserved (the root conftest.py), so a card is not held
by blocks a worker no longer uses. One core a worker: it runs torch on one thread (the test
conftests set it) and compiles Triton kernels on one core. The workers spread over every visible
GPU (the root conftest.py pins worker k to the (k mod n)-th GPU of the list). Stdlib only: it
reads ``nvidia-smi``, never CUDA, so the tiers' processes start with no CUDA context taken by
this script.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

GIB_PER_WORKER = 8
CORES_PER_WORKER = 1
RELEASE_GIB = 4


@dataclass(frozen=True)
class Gpu:
    index: str
    name: str
    memory_mib: int


@dataclass(frozen=True)
class WorkerPlan:
    workers: int
    gpus: tuple[str, ...]
    why: str


def plan(gpus: Sequence[Gpu], cores: int) -> WorkerPlan:
    """Workers for ``gpus`` on a host of ``cores`` cores: at least one per GPU."""
    if not gpus:
        return WorkerPlan(0, (), "no GPU visible to nvidia-smi")
    by_memory = sum(max(1, g.memory_mib // (GIB_PER_WORKER * 1024)) for g in gpus)
    by_cores = max(len(gpus), cores // CORES_PER_WORKER)
    workers = min(by_memory, by_cores)
    cards = ", ".join(f"{g.index}: {g.name} {g.memory_mib // 1024} GiB" for g in gpus)
    why = (
        f"{workers} workers = min({by_memory} by memory at {GIB_PER_WORKER} GiB each, "
        f"{by_cores} by {cores} cores at {CORES_PER_WORKER} each) over GPUs {cards}"
    )
    return WorkerPlan(workers, tuple(g.index for g in gpus), why)


def parse_nvidia_smi(text: str) -> list[Gpu]:
    """Rows of ``nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader,nounits``."""
    gpus = []
    for line in text.strip().splitlines():
        index, name, memory = (part.strip() for part in line.split(","))
        gpus.append(Gpu(index, name, int(float(memory))))
    return gpus


def visible_gpus() -> list[Gpu]:
    """The GPUs nvidia-smi lists, narrowed to CUDA_VISIBLE_DEVICES where that names indices."""
    if shutil.which("nvidia-smi") is None:
        return []
    query = ["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"]
    proc = subprocess.run(query, capture_output=True, text=True, check=False, timeout=60)
    if proc.returncode != 0:
        return []
    gpus = parse_nvidia_smi(proc.stdout)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return gpus
    wanted = [v.strip() for v in visible.split(",") if v.strip()]
    if not all(v.isdigit() for v in wanted):
        return gpus  # UUIDs or MIG names: use what nvidia-smi lists
    by_index = {g.index: g for g in gpus}
    return [by_index[v] for v in wanted if v in by_index]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--explain", action="store_true", help="say how the number was chosen")
    args = parser.parse_args(argv)
    result = plan(visible_gpus(), os.cpu_count() or 1)
    print(result.workers, ",".join(result.gpus) or "-")
    if args.explain:
        print(result.why, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
