"""The banded overlap map that block scoring sums is exactly the dense map of the spec."""

from __future__ import annotations

import pytest
import torch

from nsa_core import cmp_block_overlap, num_cmp_blocks, num_sel_blocks
from nsa_core.block_math import cmp_block_band


@pytest.mark.parametrize(
    ("l_cmp", "d", "l_sel", "length"),
    [
        (32, 16, 64, 1000),
        (8, 4, 8, 77),
        (4, 2, 8, 50),
        (4, 4, 4, 33),
        (16, 8, 32, 15),
        # (l + l') / d exceeds the blocks that exist: the band narrows to num_cmp
        (32, 16, 64, 60),
        (64, 4, 8, 70),
        (31, 1, 1, 40),
    ],
)
def test_band_holds_every_nonzero_overlap_weight_once(
    l_cmp: int, d: int, l_sel: int, length: int
) -> None:
    num_cmp, num_sel = num_cmp_blocks(length, l_cmp, d), num_sel_blocks(length, l_sel)
    dense = cmp_block_overlap(num_cmp, num_sel, l_cmp, d, l_sel, dtype=torch.float64)
    index, weight = cmp_block_band(num_cmp, num_sel, l_cmp, d, l_sel, dtype=torch.float64)
    rebuilt = torch.zeros(num_cmp + 1, num_sel, dtype=torch.float64)  # row num_cmp: padding
    rebuilt.index_put_(
        (index, torch.arange(num_sel).unsqueeze(1).expand_as(index)), weight, accumulate=True
    )
    assert torch.equal(rebuilt[:num_cmp], dense)
    assert torch.all(weight[index == num_cmp] == 0)


@pytest.mark.parametrize("length", [0, 20, 2**31 - 1])
def test_band_is_no_wider_than_the_blocks_that_exist(length: int) -> None:
    """l = 2^31 - 1 with d = 1 spans 2^31 + l' compressed blocks per selection block; only
    N_cmp(L) exist, and the band holds no more columns than that."""
    l_cmp, d, l_sel = 2**31 - 1, 1, 64
    num_cmp, num_sel = num_cmp_blocks(length, l_cmp, d), num_sel_blocks(min(length, 64), l_sel)
    index, weight = cmp_block_band(num_cmp, num_sel, l_cmp, d, l_sel)
    assert index.shape == weight.shape == (num_sel, num_cmp)
