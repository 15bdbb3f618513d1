"""What the benches' cases share: dtypes by name, the attention shape and its row columns, the
status of a case that failed, and the memory a finished case gives back.

The layer, cp and sel benches each write rows of their own schema; the columns that describe
the problem (``dtype``, ``B``, ``T``, ``HQ``, ``H``, ``G``, ``dk``, ``dv``) come from
:meth:`Shape.columns` in all of them, so they mean the same thing in every CSV.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, fields
from typing import Any

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MIB = 1 << 20


@dataclass(frozen=True)
class Shape:
    """q [B, T, HQ, dk], k [B, T, H, dk] and v [B, T, H, dv] in ``dtype``, a key of DTYPES."""

    batch: int
    seq_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_v: int
    dtype: str

    @property
    def group(self) -> int:
        """G = HQ / H: the query heads that share one kv head."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def scale(self) -> float:
        """The softmax scale, dk^-1/2."""
        return float(self.head_dim_qk**-0.5)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def columns(self) -> dict[str, Any]:
        """The shape under the names the rows' columns give it."""
        return {
            "dtype": self.dtype,
            "B": self.batch,
            "T": self.seq_len,
            "HQ": self.num_q_heads,
            "H": self.num_kv_heads,
            "G": self.group,
            "dk": self.head_dim_qk,
            "dv": self.head_dim_v,
        }


def row_columns(row_type: type) -> list[str]:
    """A dataclass row's own columns, in field order; its ``env`` dict is spread after them."""
    return [f.name for f in fields(row_type) if f.name != "env"]


def failure_status(exc: BaseException) -> str:
    """``oom: ``, ``refused: `` (the callee rejected the arguments) or ``error: `` + the message."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return "oom: " + text
    if isinstance(exc, (AssertionError, ValueError, NotImplementedError)):
        return "refused: " + text
    return "error: " + text


def free_memory(device: torch.device) -> None:
    """Give back what dropped tensors held, so the next case starts from an empty cache."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
