"""Compile every Triton launch the interpreter tests made, for a real GPU target, with no GPU.

The interpreter tier (TRITON_INTERPRET=1) proves the kernels' logic on the CPU, but never runs
Triton's compiler. Run with ``--record-triton-launches DIR`` (ci/triton_launches.py), it writes
each distinct launch down; this script then compiles each one to a cubin for the given CUDA
architectures through Triton's own JIT (its ``warmup`` entry: specialization, compile, no
launch) behind a driver that only names the target. A launch fails when Triton cannot compile it
or when it asks for more shared memory than one SM of that architecture has.

    python ci/compile_triton.py DIR [--arch 90 --arch 80] [--resources]

Prints one line per kernel (variants compiled, the most shared memory any asks for) and every
failure with its message; exits 1 on any failure not in KNOWN_FAILURES, and on a known failure
that now compiles (so the list cannot go stale). ``--resources`` also prints, per launch, the
registers a thread and the bytes spilled to local memory that ``ptxas -v`` (CUDA's assembler,
on PATH) reports for the PTX Triton made: a spill or a register count that holds one program
per SM shows here before any GPU run does (ci/paper_launches.py records the paper's shapes).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Shared memory one thread block may use (bytes): sm_80 A100, sm_89 RTX 4090, sm_90 H100/H200.
MAX_SHARED_BYTES = {80: 166_912, 89: 101_376, 90: 232_448}


@dataclass(frozen=True)
class KnownFailure:
    """A launch Triton itself cannot compile: the kernel, the constexprs that pick it, why."""

    kernel: str
    constexprs: Mapping[str, object]
    reason: str

    def matches(self, kernel: str, constexprs: Mapping[str, object]) -> bool:
        return kernel == self.kernel and all(
            constexprs.get(k) == v for k, v in self.constexprs.items()
        )


# Empty today. The block-scoring top-n sort at G=1, l=d was listed here until its hypercube
# masks were read off a full-shape index (scoring/kernels.py, _bitonic).
KNOWN_FAILURES: tuple[KnownFailure, ...] = ()


@dataclass(frozen=True)
class Launch:
    module: str
    kernel: str
    args: tuple[Any, ...]
    options: tuple[tuple[str, Any], ...]


def load_launches(folder: Path) -> list[Launch]:
    """The distinct launches of every launches-*.json under ``folder``, in a stable order."""
    files = sorted(folder.glob("launches-*.json"))
    if not files:
        raise SystemExit(f"compile_triton: no launches-*.json in {folder}")
    seen: dict[str, Launch] = {}
    for path in files:
        for row in json.loads(path.read_text()):
            launch = Launch(
                row["module"],
                row["kernel"],
                tuple(tuple(a) for a in row["args"]),
                tuple((name, tuple(value)) for name, value in row["options"]),
            )
            seen.setdefault(json.dumps(row, sort_keys=True), launch)
    return [seen[key] for key in sorted(seen)]


def decode(encoded: Sequence[Any]) -> Any:
    """A stand-in argument the compiler specializes exactly as the recorded one."""
    import torch
    import triton.language as tl

    kind = encoded[0]
    if kind == "tensor":
        return torch.empty(64, dtype=getattr(torch, encoded[1]))
    if kind == "int":
        return {"one": 1, "i32_div16": 64, "i32": 7, "i64": 2**40 + 7}[encoded[1]]
    if kind == "float":
        return 0.5
    if kind == "value":
        return encoded[1]
    if kind == "tl_dtype":
        return getattr(tl, encoded[1])
    if kind == "tensor_descriptor":
        from triton.tools.tensor_descriptor import TensorDescriptor

        _, dtype, ndim, block = encoded
        base = torch.empty(*([64] * ndim), dtype=getattr(torch, dtype))
        return TensorDescriptor(base, list(base.shape), list(base.stride()), list(block))
    raise ValueError(f"unknown recorded argument {encoded!r}")


@contextlib.contextmanager
def compile_only_target(arch: int) -> Iterator[None]:
    """Within: Triton's JIT compiles for CUDA ``sm_<arch>`` (nothing is launched), GPU or not."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase
    from triton.runtime import driver

    class CompileOnlyDriver(DriverBase):  # type: ignore[misc]
        @classmethod
        def is_active(cls) -> bool:
            return True

        def map_python_to_cpp_type(self, ty: str) -> str:
            raise NotImplementedError("compile only: nothing is launched")

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", arch, 32)

        def get_active_torch_device(self) -> torch.device:
            return torch.device("cpu")

        def get_benchmarker(self) -> Any:
            raise NotImplementedError("compile only: nothing is timed")

        def get_current_device(self) -> int:
            # The JIT caches its target per device: one made-up device per architecture.
            return -arch

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

    # The driver in force before (None until first used; reading `active` would create one, and
    # on a machine with no GPU that raises), put back as it was.
    previous = driver._active
    driver.set_active(CompileOnlyDriver())
    try:
        yield
    finally:
        driver._active = previous


@dataclass(frozen=True)
class Resources:
    """What ``ptxas -v`` reports for one compiled launch."""

    registers: int
    spill_stores: int
    spill_loads: int


def ptxas_resources(ptx: str) -> Resources | None:
    """Registers and spill bytes of the PTX's kernel, assembled for its own target; None when
    ptxas is not on PATH."""
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        return None
    target = re.search(r"^\.target\s+(sm_\w+)", ptx, re.M)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        arch = target.group(1) if target else "sm_90a"
        done = subprocess.run(
            [ptxas, f"-arch={arch}", "-v", str(path), "-o", str(Path(tmp) / "kernel.cubin")],
            capture_output=True,
            text=True,
            check=True,
        )
    report = done.stderr
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    return Resources(
        registers=int(registers.group(1)) if registers else 0,
        spill_stores=int(spills.group(1)) if spills else 0,
        spill_loads=int(spills.group(2)) if spills else 0,
    )


@dataclass
class Outcome:
    launch: Launch
    shared: int | None
    error: str | None
    known: KnownFailure | None
    resources: Resources | None = None


def compile_launch(launch: Launch, arch: int, resources: bool = False) -> Outcome:
    kernel = getattr(importlib.import_module(launch.module), launch.kernel)
    options = {name: decode(value) for name, value in launch.options}
    constexprs = {name: value[1] for name, value in launch.options if value[0] == "value"}
    known = next((k for k in KNOWN_FAILURES if k.matches(launch.kernel, constexprs)), None)
    try:
        compiled = kernel.warmup(*[decode(a) for a in launch.args], grid=(1,), **options)
    except Exception as err:  # every compiler error is a finding, reported below
        message = (str(err).strip().splitlines() or [type(err).__name__])[-1]
        return Outcome(launch, None, f"{type(err).__name__}: {message[:300]}", known)
    shared = int(compiled.metadata.shared)
    used = ptxas_resources(compiled.asm["ptx"]) if resources else None
    limit = MAX_SHARED_BYTES[arch]
    if shared > limit:
        too_much = f"needs {shared} B of shared memory, sm_{arch} has {limit} B"
        return Outcome(launch, shared, too_much, known, used)
    return Outcome(launch, shared, None, known, used)


def print_resources(outcomes: Sequence[Outcome], arch: int) -> None:
    """One line per compiled launch: registers, spill bytes, shared memory, its constexprs."""
    rows = [o for o in outcomes if o.resources is not None]
    if not rows:
        print(f"\nsm_{arch}: no register report (ptxas is not on PATH)")
        return
    print(f"\nsm_{arch} resources (ptxas -v)")
    print(f"{'kernel':<24} {'regs':>4} {'spill st/ld B':>13} {'shared B':>9}  launch")
    for o in sorted(rows, key=lambda o: o.launch.kernel):
        assert o.resources is not None
        used = o.resources
        opts = " ".join(
            f"{k}={v[1]}" for k, v in o.launch.options if v[0] == "value" and v[1] is not None
        )
        spills = f"{used.spill_stores}/{used.spill_loads}"
        print(f"{o.launch.kernel:<24} {used.registers:>4} {spills:>13} {o.shared or 0:>9}  {opts}")


def run(folder: Path, archs: Sequence[int], resources: bool = False) -> int:
    launches = load_launches(folder)
    kernels = sorted({launch.kernel for launch in launches})
    print(f"[compile] {len(launches)} distinct launches of {len(kernels)} kernels from {folder}")
    status = 0
    known = 0
    for arch in archs:
        t0 = time.perf_counter()
        outcomes: list[Outcome] = []
        with compile_only_target(arch):
            for i, launch in enumerate(launches, 1):
                outcomes.append(compile_launch(launch, arch, resources))
                if i % 25 == 0 or i == len(launches):
                    print(f"[compile] sm_{arch}: {i}/{len(launches)}", flush=True)
        seconds = time.perf_counter() - t0
        print(f"\nsm_{arch} ({seconds:.0f} s)\n{'kernel':<24} {'variants':>8} {'max shared B':>13}")
        for name in kernels:
            mine = [o for o in outcomes if o.launch.kernel == name]
            shared = max((o.shared or 0 for o in mine), default=0)
            print(f"{name:<24} {len(mine):>8} {shared:>13}")
        if resources:
            print_resources(outcomes, arch)
        for o in outcomes:
            opts = ", ".join(f"{k}={v[1]}" for k, v in o.launch.options if v[0] == "value")
            where = f"{o.launch.module}.{o.launch.kernel} ({opts})"
            if o.error is not None and o.known is not None:
                print(f"KNOWN  sm_{arch} {where}: {o.known.reason}")
                known += 1
            elif o.error is not None:
                print(f"FAIL   sm_{arch} {where}: {o.error}")
                status = 1
            elif o.known is not None:
                print(f"FIXED  sm_{arch} {where} compiles now: remove it from KNOWN_FAILURES")
                status = 1
    if status:
        print("\ncompile_triton: FAILED")
    else:
        but = f" but {known} known Triton failure(s)" if known else ""
        print(f"\ncompile_triton: every launch compiled{but}")
    return status


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="the --record-triton-launches folder")
    parser.add_argument(
        "--arch",
        type=int,
        action="append",
        choices=sorted(MAX_SHARED_BYTES),
        help="CUDA compute capability x10 to compile for (repeatable; default 90)",
    )
    parser.add_argument(
        "--resources",
        action="store_true",
        help="also print each launch's registers and spills (ptxas -v)",
    )
    args = parser.parse_args(argv)
    return run(args.folder, args.arch or [90], args.resources)


if __name__ == "__main__":
    sys.exit(main())
