"""What every part of the robustness check shares: paths, the error bounds, progress lines, and
how a failure is told apart from one that lost the CUDA context."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
# The command line the parts start their child processes through (sweep shards, parity workers).
SCRIPT = ROOT / "ci" / "gpu_robustness.py"
DEFAULT_OUT = "artifacts/gpu_robustness"
PARTS = ("sanitize", "long", "parity")

# docs/spec.md, "Tolerances": relative error of a kernel against the reference on the same
# inputs (float32 against float64; 16-bit against float32); gradients get GRAD_FACTOR times it.
BOUNDS = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 5e-3}
GRAD_FACTOR = 2.0


def log(part: str, message: str) -> None:
    """A progress line on stderr (stdout carries the sweep's protocol lines)."""
    print(f"[{part}] {message}", file=sys.stderr, flush=True)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def is_fatal_cuda_error(exc: BaseException) -> bool:
    """An error after which the CUDA context is unusable (every later launch fails too)."""
    text = str(exc).lower()
    return any(
        s in text
        for s in (
            "illegal memory access",
            "illegal address",
            "misaligned address",
            "unspecified launch failure",
            "device-side assert",
            "illegal instruction",
        )
    )
