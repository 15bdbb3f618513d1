"""The hyper-parameters of one NSA layer, with the paper's defaults and their validation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Literal

from nsa_core.limits import MAX_TOKENS
from nsa_core.tracing import TraceConstant

PhiKind = Literal["avg", "mlp"]


@dataclass(frozen=True)
class NSAConfig:
    """Shapes and block geometry of one NSA layer (docs/spec.md, "Symbols").

    Attributes:
        num_q_heads: HQ, query heads.
        num_kv_heads: H, key/value heads; the G = HQ / H query heads of a group share them.
        head_dim_qk: dk, query/key head dim.
        head_dim_v: dv, value head dim.
        cmp_block: l, compression block length.
        cmp_stride: d, compression stride; divides ``cmp_block`` and ``sel_block``.
        sel_block: l', selection block length.
        num_selected: n, selected blocks per query, forced blocks included (n >= 3).
        window: w, sliding window length, the query itself included.
        phi: ``"avg"`` (mean over the block) or ``"mlp"`` (learned, with intra-block positions).
        scale: softmax scale; ``None`` means ``head_dim_qk ** -0.5``.
        rope_theta: RoPE base for the rotary embedding of queries and keys.
        trace_constant: this config as torch.compile's regions take it (set on creation;
            :mod:`nsa_core.tracing`).
    """

    num_q_heads: int = 64
    num_kv_heads: int = 4
    head_dim_qk: int = 192
    head_dim_v: int = 128
    cmp_block: int = 32
    cmp_stride: int = 16
    sel_block: int = 64
    num_selected: int = 16
    window: int = 512
    phi: PhiKind = "avg"
    scale: float | None = None
    rope_theta: float = 10000.0
    trace_constant: TraceConstant[NSAConfig] = field(
        init=False, repr=False, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        # Made here, outside any trace: Dynamo cannot build it inside a compiled function.
        object.__setattr__(self, "trace_constant", TraceConstant(self))
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int) or isinstance(value, bool)):
                raise TypeError(f"NSAConfig.{f.name} must be an int, got {value!r}")
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if f.type in ("float", "float | None") and not (
                number or (value is None and "None" in f.type)
            ):
                raise TypeError(f"NSAConfig.{f.name} must be a number, got {value!r}")
        if not isinstance(self.phi, str):
            raise TypeError(f"NSAConfig.phi must be a str, 'avg' or 'mlp', got {self.phi!r}")
        # Every int field is a head count, a head dim or a length in tokens: all must be >= 1,
        # and none may pass what int32 addresses (docs/spec.md, "Argument rules"): a block or
        # window past it could never be filled, and a forward would size buffers by it.
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and value < 1:
                raise ValueError(f"NSAConfig.{f.name} must be >= 1, got {value}")
            if f.type == "int" and value > MAX_TOKENS:
                raise ValueError(
                    f"NSAConfig.{f.name} must be <= {MAX_TOKENS} (int32 token positions), "
                    f"got {value}"
                )
        if self.num_q_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"NSAConfig.num_q_heads ({self.num_q_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.cmp_block % self.cmp_stride != 0:
            raise ValueError(
                f"NSAConfig.cmp_stride ({self.cmp_stride}) must divide cmp_block ({self.cmp_block})"
            )
        if self.sel_block % self.cmp_stride != 0:
            raise ValueError(
                f"NSAConfig.cmp_stride ({self.cmp_stride}) must divide sel_block ({self.sel_block})"
            )
        if self.num_selected < 3:
            raise ValueError(
                f"NSAConfig.num_selected must be >= 3 to hold the forced initial and two local "
                f"blocks, got {self.num_selected}"
            )
        if self.num_selected > MAX_TOKENS // self.sel_block:
            raise ValueError(
                f"NSAConfig.num_selected ({self.num_selected}) times sel_block ({self.sel_block}) "
                f"must be <= {MAX_TOKENS}: no sequence of int32 positions holds more blocks"
            )
        if self.phi not in ("avg", "mlp"):
            raise ValueError(f"NSAConfig.phi must be 'avg' or 'mlp', got {self.phi!r}")
        if self.head_dim_qk % 2 != 0:
            raise ValueError(
                "NSAConfig.head_dim_qk must be even for the rotary embedding, "
                f"got {self.head_dim_qk}"
            )
        if self.scale is not None and not 0 < self.scale < math.inf:
            raise ValueError(f"NSAConfig.scale must be positive and finite, got {self.scale}")
        if not 0 < self.rope_theta < math.inf:
            raise ValueError(
                f"NSAConfig.rope_theta must be positive and finite, got {self.rope_theta}"
            )

    @property
    def group_size(self) -> int:
        """G = HQ / H, query heads per key/value head."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def softmax_scale(self) -> float:
        """The softmax scale in use: ``scale`` or ``head_dim_qk ** -0.5``."""
        return self.scale if self.scale is not None else self.head_dim_qk**-0.5
