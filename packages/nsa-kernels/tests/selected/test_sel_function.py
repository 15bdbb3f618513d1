"""Host-side work of the Triton selection forward: index rows as sets, config strings."""

from __future__ import annotations

import pytest
import torch
from kernel_testlib import DEVICE, SKIP_REASON

pytest.importorskip("triton")

from nsa_kernels.selected.function import (
    SelConfig,
    parse_config,
    unique_block_rows,
)

# unique_block_rows is a Triton kernel: its tests carry the triton marker, so the interpreter
# tier runs them on a CPU and the triton-gpu tier on a GPU.
needs_triton_device = pytest.mark.skipif(DEVICE is None, reason=SKIP_REASON)


def rows(*entries: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """[1, Tq, 1, n] from one list per query row, on the kernels' device."""
    return torch.tensor(entries, dtype=dtype, device=DEVICE).view(1, len(entries), 1, -1)


def as_sets(idx: torch.Tensor, num_blocks: int | None) -> list[list[int]]:
    """The contract, written out: each row's distinct in-range entries ascending, then -1."""
    limit = 2**31 - 1 if num_blocks is None else num_blocks
    n = idx.shape[-1]
    out = []
    for row in idx.reshape(-1, n).tolist():
        kept = sorted({b for b in row if 0 <= b < limit})
        out.append(kept + [-1] * (n - len(kept)))
    return out


@pytest.mark.triton
@needs_triton_device
def test_unique_block_rows_sorts_and_drops_repeats() -> None:
    idx = rows([3, -1, 3, 0], [2, 2, 2, 2], [-1, -1, -1, -1])
    out = unique_block_rows(idx)[0, :, 0].tolist()
    # Ascending, one copy of each block, then -1.
    assert out == [[0, 3, -1, -1], [2, -1, -1, -1], [-1, -1, -1, -1]]


def test_parse_config_names_unknown_fields() -> None:
    assert parse_config("tma=1,block_l=32") == SelConfig(tma=1, block_l=32)
    with pytest.raises(ValueError, match="tile_rows"):
        parse_config("tile_rows=4")


@pytest.mark.triton
@needs_triton_device
def test_unique_block_rows_drops_entries_outside_the_keys() -> None:
    idx = rows([5, -3, 1, 1 << 30], [4, 0, -1, 2])
    out = unique_block_rows(idx, num_blocks=5)[0, :, 0].tolist()
    assert out == [[1, -1, -1, -1], [0, 2, 4, -1]]


@pytest.mark.triton
@needs_triton_device
@pytest.mark.parametrize("n", [1, 3, 5, 16, 40])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("num_blocks", [None, 9])
def test_unique_block_rows_matches_the_set_contract(
    n: int, dtype: torch.dtype, num_blocks: int | None
) -> None:
    gen = torch.Generator().manual_seed(n * 7 + (num_blocks or 0))
    # Small values repeat often; a few rows carry values far outside any index range.
    # Wide rows take a few seconds per hundred rows under the interpreter: fewer of them.
    shape = (2, 37, 3, n) if n <= 16 else (2, 6, 3, n)
    idx = torch.randint(-2, 12, shape, generator=gen).to(dtype)
    if dtype == torch.int64:
        idx[0, 5, 1, 0] = (1 << 40) + 3  # would wrap to 3 in a cast before the range test
    idx[1, 2, 1] = 4  # a row of one repeated block
    out = unique_block_rows(idx.to(DEVICE), num_blocks)
    assert out.dtype == torch.int32
    assert out.shape == idx.shape
    assert out.cpu().reshape(-1, n).tolist() == as_sets(idx, num_blocks)


@pytest.mark.triton
@needs_triton_device
@pytest.mark.parametrize("shape", [(1, 0, 2, 4), (1, 3, 2, 0)])
def test_unique_block_rows_of_no_rows_or_no_slots(shape: tuple[int, ...]) -> None:
    out = unique_block_rows(torch.zeros(shape, dtype=torch.int32, device=DEVICE))
    assert out.shape == shape
    assert out.dtype == torch.int32


def test_resolve_config_without_a_gpu_takes_pointer_loads_and_the_plain_forward() -> None:
    from nsa_kernels.selected.launch import resolve_config

    cfg = resolve_config(None, 16, 128, 128, 64, device=torch.device("cpu"))
    assert cfg.tma == 2
    assert (cfg.fwd_block_l, cfg.fwd_warps, cfg.fwd_stages) == (64, 4, 2)
    assert (cfg.block_l, cfg.dq_warps) == (64, 4)


@pytest.mark.parametrize(
    ("group", "warps", "keys", "dq_warps"),
    # The forward: one warp while it holds every row of the program (BG <= 32 rows), else
    # four, on 16-key tiles up to 16 rows, else 32; dq: two warps up to 16 rows.
    [(1, 1, 16, 2), (4, 1, 16, 2), (16, 1, 16, 2), (32, 1, 32, 4), (64, 4, 32, 4)],
)
def test_resolve_config_with_tma_runs_the_forward_one_warp_per_program(
    group: int, warps: int, keys: int, dq_warps: int
) -> None:
    from nsa_kernels.selected.launch import resolve_config, tma_available

    if not tma_available():
        pytest.skip("this triton has no triton.tools.tensor_descriptor (< 3.4)")
    cfg = resolve_config(SelConfig(tma=1), group, 128, 128, 64)
    assert cfg.tma == 1
    assert (cfg.fwd_block_l, cfg.fwd_warps, cfg.fwd_stages) == (keys, warps, 3)
    assert cfg.dq_warps == dq_warps
    # dq and dk/dv keep 64-key tiles: 32 cost the backward a third (docs/selection.md).
    assert cfg.block_l == 64
    assert resolve_config(SelConfig(tma=1, fwd_warps=4), group, 128, 128, 64).fwd_warps == 4


def test_resolve_config_takes_the_forced_block_prologue_where_it_applies() -> None:
    """On by default with TMA up to G = 4 (16 rows a program); 1 (off) without TMA, at larger G,
    with the group split over programs, dv not one power-of-two tile, more rows than l', or
    with a local softmax."""
    from nsa_kernels.selected.launch import resolve_config, tma_available

    assert resolve_config(None, 4, 128, 128, 64, device=torch.device("cpu")).forced_tokens == 1
    assert resolve_config(SelConfig(forced_tokens=8), 4, 128, 128, 64).forced_tokens == 1
    if not tma_available():
        pytest.skip("this triton has no triton.tools.tensor_descriptor (< 3.4)")
    tma = SelConfig(tma=1)
    assert resolve_config(tma, 4, 128, 128, 64).forced_tokens == 16
    assert resolve_config(tma, 1, 128, 128, 64).forced_tokens == 16
    # A forward from the sliding branch's local softmax has its forced blocks already.
    assert resolve_config(tma, 4, 128, 128, 64, local=True).forced_tokens == 1
    assert resolve_config(tma, 16, 128, 128, 64).forced_tokens == 1
    assert resolve_config(SelConfig(tma=1, forced_tokens=8), 16, 128, 128, 64).forced_tokens == 8
    assert resolve_config(SelConfig(tma=1, forced_tokens=8), 32, 128, 128, 64).forced_tokens == 1
    split = SelConfig(tma=1, heads_per_prog=2)
    assert resolve_config(split, 4, 128, 128, 64).forced_tokens == 1
    assert resolve_config(tma, 4, 128, 96, 64).forced_tokens == 1
    assert resolve_config(SelConfig(tma=1, block_dv=64), 4, 128, 128, 64).forced_tokens == 1
    assert resolve_config(tma, 4, 128, 128, 8).forced_tokens == 1
    with pytest.raises(ValueError, match="forced_tokens must be a power of two"):
        resolve_config(SelConfig(tma=1, forced_tokens=6), 4, 128, 128, 64)


def test_resolve_config_refuses_tma_where_it_cannot_serve() -> None:
    from nsa_kernels.selected.launch import resolve_config, tma_available

    with pytest.raises(ValueError, match="tma must be 0"):
        resolve_config(SelConfig(tma=3), 16, 128, 128, 64)
    if tma_available():
        with pytest.raises(ValueError, match="power of two in one tile"):
            resolve_config(SelConfig(tma=1), 16, 192, 128, 64)
    # dk = 192 chooses pointer loads by itself, on any device.
    assert resolve_config(None, 16, 192, 128, 64).tma == 2


def test_resolve_config_walks_a_wide_dk_in_64_wide_chunks() -> None:
    """dk = 192 takes three 64-wide chunks, not one tile padded to 256; powers of two keep one
    tile, a dk that 64 does not divide keeps the padded tile, and a caller's block_d is kept."""
    from nsa_kernels.selected.launch import resolve_config

    assert resolve_config(None, 16, 192, 128, 64).block_d == 64
    assert resolve_config(None, 16, 128, 128, 64).block_d == 128
    assert resolve_config(None, 16, 256, 128, 64).block_d == 256
    assert resolve_config(None, 16, 160, 128, 64).block_d == 256
    assert resolve_config(SelConfig(block_d=128), 16, 192, 128, 64).block_d == 128
