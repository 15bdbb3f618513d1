"""The routing context of one op call: what a backend needs to know to accept or refuse it.

The op validators of :mod:`nsa_core.checks` return it (they have read every shape), the public
ops of :mod:`nsa_core.ops` hand it to the registry (:mod:`nsa_core.registry`), and
``routing_report`` renders the decision for one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nsa_core.tracing import traced

if TYPE_CHECKING:
    from nsa_core.config import NSAConfig


@dataclass(frozen=True)
class OpContext:
    """What a backend needs to know to accept or refuse one call of an op.

    ``seq_len`` is the number of keys of the longest sequence (tokens), ``varlen`` whether the call
    packs sequences with ``cu_seqlens``, ``q_start`` the position of the first query (dense calls
    of the windowed ops; 0 elsewhere), ``traced`` whether torch.compile is tracing the call (its
    tensors are fake: a backend that needs the host to read device values declines).
    """

    device: torch.device
    dtype: torch.dtype
    seq_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_v: int
    requires_grad: bool
    varlen: bool
    q_start: int = 0
    traced: bool = False

    @classmethod
    def for_config(
        cls,
        config: NSAConfig,
        *,
        device: torch.device,
        dtype: torch.dtype,
        seq_len: int,
        requires_grad: bool = False,
        varlen: bool = False,
    ) -> OpContext:
        """The context of a call with ``config``'s heads and head dims."""
        return cls(
            device=device,
            dtype=dtype,
            seq_len=seq_len,
            num_q_heads=config.num_q_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim_qk=config.head_dim_qk,
            head_dim_v=config.head_dim_v,
            requires_grad=requires_grad,
            varlen=varlen,
        )

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def device_capability(self) -> tuple[int, int] | None:
        if self.device.type != "cuda":
            return None
        major, minor = torch.cuda.get_device_capability(self.device)
        return (major, minor)


def op_context(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_len: int,
    *,
    varlen: bool,
    q_start: int = 0,
) -> OpContext:
    """The routing context of one call: q [B, Tq, HQ, dk], k [B, *, H, dk], v [B, *, H, dv]."""
    return OpContext(
        device=q.device,
        dtype=q.dtype,
        seq_len=seq_len,
        num_q_heads=q.shape[2],
        num_kv_heads=k.shape[2],
        head_dim_qk=q.shape[3],
        head_dim_v=v.shape[3],
        requires_grad=torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)),
        varlen=varlen,
        traced=traced(q),
        q_start=q_start,
    )
