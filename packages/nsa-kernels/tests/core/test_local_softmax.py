"""The sliding branch handing the selected one each row's softmax over its forced blocks.

A query at t always selects its blocks 0, jt - 1 and jt (forced, docs/spec.md); the keys of the
last two, ``[max(jt - 1, 0) l', t]``, a window of w >= 2 l' holds too. Where the two branches
share k and v, the fused core has the Triton sliding kernel hand that softmax to the selected
launch (tests/core/test_fused_core.py); here, what the softmax covers.
"""

from __future__ import annotations

import pytest
import torch

from nsa_kernels.common.local_softmax import holds_local_keys, local_softmax_reference

F64 = torch.float64


def test_the_local_keys_are_the_forced_blocks_keys() -> None:
    """The definition: row t attends to positions 0 .. l' - 1 and max(t // l' - 1, 0) l' .. t
    (those up to t), in one softmax (here against a loop over rows), restarting in every packed
    sequence."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 19, 2, 4, generator=gen, dtype=F64)
    k = torch.randn(1, 19, 1, 4, generator=gen, dtype=F64)
    v = torch.randn(1, 19, 1, 3, generator=gen, dtype=F64)
    cu = torch.tensor([0, 1, 12, 19], dtype=torch.int32)
    got = local_softmax_reference(q, k, v, 4, 0.5, cu_seqlens=cu)
    for start, end in ((0, 1), (1, 12), (12, 19)):
        for r in range(start, end):
            t = r - start
            lo = start + max(t // 4 - 1, 0) * 4
            keys = sorted(set(range(start, min(start + 4, r + 1))) | set(range(lo, r + 1)))
            s = torch.einsum("hd,nd->hn", q[0, r], k[0, keys, 0]) * 0.5
            torch.testing.assert_close(got.lse[0, r], torch.logsumexp(s, -1))
            torch.testing.assert_close(got.o[0, r], torch.softmax(s, -1) @ v[0, keys, 0])


def test_a_window_holds_the_local_keys_from_2_l_or_over_all_keys() -> None:
    assert holds_local_keys(128, 64, 10_000)
    assert not holds_local_keys(127, 64, 10_000)
    assert holds_local_keys(127, 64, 127)


def test_the_sliding_kernel_refuses_a_window_that_cannot_hold_them() -> None:
    """Called by name, the Triton sliding branch's local-softmax entry checks the window before
    any launch."""
    from nsa_kernels.sliding.triton_function import sliding_attention_triton_with_local

    q, k = torch.zeros(1, 23, 4, 8), torch.zeros(1, 23, 2, 8)
    with pytest.raises(ValueError, match="does not hold every row's local blocks"):
        sliding_attention_triton_with_local(q, k, k, 7, sel_block=4)
