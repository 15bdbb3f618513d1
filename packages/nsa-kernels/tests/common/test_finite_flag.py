"""all_finite_flag: 1 exactly when every element is finite (an overflowing sum reads 0)."""

from __future__ import annotations

import pytest
import torch

from nsa_kernels.common.finite_flag import all_finite_flag


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_finite_values_read_one(dtype: torch.dtype) -> None:
    x = torch.randn(2, 33, 4, 24).to(dtype)
    flag = all_finite_flag(x)
    assert flag.dtype == torch.int32
    assert flag.shape == (1,)
    assert flag.item() == 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_non_finite_value_reads_zero(bad: float, dtype: torch.dtype) -> None:
    x = torch.randn(2, 33, 4, 24).to(dtype)
    x[1, 17, 2, 5] = bad
    assert all_finite_flag(x).item() == 0


def test_opposite_infinities_read_zero() -> None:
    x = torch.zeros(8)
    x[2], x[5] = float("inf"), float("-inf")
    assert all_finite_flag(x).item() == 0


def test_an_overflowing_sum_reads_zero() -> None:
    # Finite values whose float32 sum overflows: the flag is conservative (the slower path).
    x = torch.full((4,), 3.0e38, dtype=torch.float32)
    assert all_finite_flag(x).item() == 0


def test_empty_tensor_reads_one() -> None:
    assert all_finite_flag(torch.empty(0, 4)).item() == 1


def test_several_tensors_read_one_only_when_all_are_finite() -> None:
    k, v = torch.randn(3, 5), torch.randn(3, 7).bfloat16()
    assert all_finite_flag(k, v).item() == 1
    v[2, 6] = float("nan")
    assert all_finite_flag(k, v).item() == 0
    assert all_finite_flag(k).item() == 1


def test_no_tensor_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one tensor"):
        all_finite_flag()


def test_finite_path_launches_two_paths_behind_the_flag_or_one_general_path() -> None:
    from nsa_kernels.common.finite_flag import finite_path_launches

    k, v = torch.randn(3, 5), torch.randn(3, 7)
    flag, paths = finite_path_launches(True, k, v)
    assert (flag.item(), paths) == (1, (True, False))
    v[0, 0] = float("inf")
    assert finite_path_launches(True, k, v)[0].item() == 0
    flag, paths = finite_path_launches(False, k, v)
    # Without the faster path the flag is 0, so the one launch (path False) works.
    assert (flag.item(), paths) == (0, (False,))
