# Triton kernels take untyped pointer/scalar parameters (types come from the launch), and
# triton.jit is untyped without triton installed: mypy checks only the plain Python here.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Index preparation: the block index rows as sets, before any walk over them.

The kernels walk every slot of an index row, so a block listed twice would count twice, while
the reference treats a row as a set. :func:`unique_block_rows` restores that contract on the
device with one kernel, ``block_set_kernel``. The reverse index the dk/dv backward needs (for
each key block, the queries that selected it) is :mod:`nsa_kernels.selected.csr`.
"""

# No `from __future__ import annotations`: the triton 3.0/3.1 interpreter reads a string
# annotation as a runtime argument, so `B: tl.constexpr` would stop being a constant.
import torch
import triton
import triton.language as tl

from nsa_kernels.common.tile_config import pow2
from nsa_kernels.common.traced_launch import launch

# tl.gather arrived in triton 3.3; before it, block_set_kernel finds left neighbours with a scan.
_HAS_GATHER = tl.constexpr(hasattr(tl, "gather"))


@triton.jit
def _last_two(prev_a, last_a, prev_b, last_b):
    """Combine of a scan over (entry before the last, last entry); -1 stands for none."""
    return tl.where(prev_b < 0, last_a, prev_b), last_b


@triton.jit
def block_set_kernel(
    idx_ptr,
    out_ptr,
    n_rows,
    nsel,
    num_blocks,
    NP: tl.constexpr,
    ROWS: tl.constexpr,
):
    """out [ROWS, nsel] int32: each index row as a set, ascending, then -1.

    Entries outside [0, num_blocks) and repeats of an earlier entry become -1. The range test runs
    in the input's integer type, before the int32 cast, so large int64 values cannot wrap into
    range. Rows are padded to NP (a power of two) with a key that sorts last.
    """
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, NP)
    inside = (rows < n_rows)[:, None] & (cols < nsel)[None, :]
    offs = rows[:, None] * nsel + cols[None, :]
    x = tl.load(idx_ptr + offs, mask=inside, other=-1)
    pad = 2147483647
    key = tl.sort(tl.where((x >= 0) & (x < num_blocks), x, pad).to(tl.int32), dim=1)
    # A sorted row holds a repeat where an entry equals its left neighbour; a second sort moves
    # the repeats behind the distinct entries.
    if _HAS_GATHER:
        left = tl.gather(key, tl.maximum(cols - 1, 0)[None, :].broadcast_to(ROWS, NP), axis=1)
        repeat = (cols > 0)[None, :] & (key == left)
    else:
        # Keys are >= 0, so the -1 that the first entry of each row keeps never matches.
        none = tl.full([ROWS, NP], -1, dtype=tl.int32)
        left, _ = tl.associative_scan((none, key), axis=1, combine_fn=_last_two)
        repeat = key == left
    key = tl.sort(tl.where(repeat, pad, key), dim=1)
    tl.store(out_ptr + offs, tl.where(key == pad, -1, key), mask=inside)


def unique_block_rows(block_indices: torch.Tensor, num_blocks: int | None = None) -> torch.Tensor:
    """block_indices [..., n] -> int32 [..., n]: each row's distinct blocks ascending, then -1.

    The kernels walk every slot of a row, so a block listed twice would count twice; the
    reference treats a row as a set. One kernel (``block_set_kernel``: two sorts of each row in
    registers) restores that contract. Entries outside [0, num_blocks) (when given; else
    [0, 2**31 - 1)) become -1: they select nothing.
    """
    n = block_indices.shape[-1]
    out = torch.empty(block_indices.shape, dtype=torch.int32, device=block_indices.device)
    rows = out.numel() // n if n else 0
    if rows == 0:
        return out
    limit = torch.iinfo(torch.int32).max if num_blocks is None else num_blocks
    np_ = max(2, pow2(n))
    per_prog = max(1, 4096 // np_)
    launch(
        block_set_kernel,
        (-(-rows // per_prog),),
        block_indices.contiguous(),
        out,
        rows,
        n,
        limit,
        NP=np_,
        ROWS=per_prog,
        writes=(out,),
    )
    return out
