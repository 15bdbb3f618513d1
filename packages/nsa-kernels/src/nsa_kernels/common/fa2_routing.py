"""When FA-2 and its torch fallbacks serve the sliding and compressed branches.

The registry asks the backends from the highest priority down; the first that accepts serves.

| priority | backend | serves when |
|---|---|---|
| 30 | ``fa2`` | NSA_WIN_FA2 / NSA_CMP_FA2 (default on), CUDA sm80+, flash_attn imports, |
| | | fp16/bf16, head dims <= 256, at least NSA_WIN_FA2_MIN_LEN / NSA_CMP_FA2_MIN_LEN tokens |
| 20 | ``flex`` | CUDA, FlexAttention present, G a power of two, at least ``FLEX_MIN_LEN`` tokens |
| 10 | ``sdpa`` | CUDA (any device when NSA_WIN_BACKEND / NSA_CMP_BACKEND pins ``sdpa``) |
| 0 | ``reference`` | everything else (nsa-core): CPU, float64, and NSA_<STEP>_BACKEND=reference |

Defaults serve users: on a GPU with no toggle set the fastest installed backend serves (the
compressed branch's table adds its Triton kernel between FA-2 and Flex). NSA_WIN_FA2=0 and
NSA_CMP_FA2=0 turn FA-2 off per branch; each refusal of FA-2 while it is on is logged once by the
registry with its reason.
"""

from __future__ import annotations

import torch

from nsa_core.registry import OpContext
from nsa_core.toggles import Toggles
from nsa_kernels.common.flash import unsupported_reason
from nsa_kernels.common.flex import flex_missing_reason

# Where the compiled FlexAttention takes over from the chunked SDPA, for both branches: ahead
# from the shortest length timed where it compiles, in both branches, forward and
# forward+backward (`nsa-bench fa2`, docs/fa2.md). Below one 128-token tile torch's inductor
# finds no kernel for it.
FLEX_MIN_LEN = 256
# Above this head dim torch's inductor finds no float32 FlexAttention kernel that fits in an SM's
# shared memory (seen in the GPU robustness parity run): float32 there goes to SDPA.
FLEX_FP32_MAX_HEAD_DIM = 128

FA2_PRIORITY = 30
FLEX_PRIORITY = 20
SDPA_PRIORITY = 10


def fa2_sliding_requested(toggles: Toggles) -> bool:
    return toggles.win_fa2


def fa2_compressed_requested(toggles: Toggles) -> bool:
    return toggles.cmp_fa2


def _fa2_supports(
    ctx: OpContext, enabled: bool, step: str, min_len: int, min_len_toggle: str
) -> str | None:
    if not enabled:
        return f"NSA_{step}_FA2 is off"
    reason = unsupported_reason(ctx.device, ctx.dtype, ctx.head_dim_qk, ctx.head_dim_v)
    if reason is not None:
        return reason
    if ctx.seq_len < min_len:
        return f"seq_len {ctx.seq_len} < {min_len_toggle}={min_len}"
    return None


def fa2_sliding_supports(ctx: OpContext, toggles: Toggles) -> str | None:
    return _fa2_supports(
        ctx, toggles.win_fa2, "WIN", toggles.win_fa2_min_len, "NSA_WIN_FA2_MIN_LEN"
    )


def fa2_compressed_supports(ctx: OpContext, toggles: Toggles) -> str | None:
    return _fa2_supports(
        ctx, toggles.cmp_fa2, "CMP", toggles.cmp_fa2_min_len, "NSA_CMP_FA2_MIN_LEN"
    )


def flex_supports(ctx: OpContext, toggles: Toggles) -> str | None:
    if ctx.dtype == torch.float64:
        return "float64 runs the reference"
    if ctx.device.type != "cuda":
        return f"FlexAttention is only used compiled, on CUDA (device is {ctx.device.type})"
    missing = flex_missing_reason()
    if missing is not None:
        return missing
    head_dim = max(ctx.head_dim_qk, ctx.head_dim_v)
    if ctx.dtype == torch.float32 and head_dim > FLEX_FP32_MAX_HEAD_DIM:
        return (
            f"float32 at head dim {head_dim} > {FLEX_FP32_MAX_HEAD_DIM}: FlexAttention's kernels "
            "need more shared memory than an SM has"
        )
    g = ctx.group_size
    if g & (g - 1):
        return f"FlexAttention's decode kernel needs a power-of-two group size, G={g}"
    if ctx.seq_len < FLEX_MIN_LEN:
        return f"seq_len {ctx.seq_len} < {FLEX_MIN_LEN}: FlexAttention's setup is not repaid"
    return None


def _sdpa_decline(ctx: OpContext, pinned: bool, toggle: str) -> str | None:
    """Why SDPA does not serve ``ctx`` unasked (float64, or off CUDA), or None; ``pinned``: the
    op's own ``toggle`` names SDPA, which then serves anywhere."""
    if pinned:
        return None
    if ctx.dtype == torch.float64:
        return "float64 runs the reference"
    if ctx.device.type == "cuda":
        return None
    return f"the reference serves {ctx.device.type} (pin {toggle}=sdpa to use SDPA there)"


def sdpa_supports(ctx: OpContext, toggles: Toggles) -> str | None:
    """The sliding branch's SDPA row: CUDA, or anywhere NSA_WIN_BACKEND=sdpa pins it."""
    return _sdpa_decline(ctx, toggles.win_backend == "sdpa", "NSA_WIN_BACKEND")


def sdpa_compressed_supports(ctx: OpContext, toggles: Toggles) -> str | None:
    """The compressed branch's SDPA row: CUDA, or anywhere NSA_CMP_BACKEND=sdpa pins it."""
    return _sdpa_decline(ctx, toggles.cmp_backend == "sdpa", "NSA_CMP_BACKEND")
