# Triton kernels take untyped pointer/scalar parameters (types come from the launch), and
# triton.jit is untyped without triton installed: mypy checks only the plain Python here.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""One step of the online (streaming) softmax in base 2, shared by the attention kernels.

Rows keep a running maximum m and normaliser l over the key tiles seen so far; a new tile of
logits s (already in base 2, ``-inf`` where a key is not visible) moves the maximum to m_new,
rescales what was accumulated by ``alpha = exp2(m - m_new)`` and weighs the tile's keys by
``p = exp2(s - m_new)`` (exactly 0 for a ``-inf`` logit). The caller then updates its output
accumulator as ``acc * alpha[:, None] + p @ v``.
"""

# No `from __future__ import annotations`: the triton 3.0/3.1 interpreter reads a string
# annotation as a runtime argument, so `B: tl.constexpr` would stop being a constant.
import triton
import triton.language as tl


@triton.jit
def online_softmax_step(m_i, l_i, s):
    """(m_new [R], alpha [R], p [R, N], l_new [R]) for running m_i, l_i [R] and logits s [R, N]."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_new = l_i * alpha + tl.sum(p, axis=1)
    return m_new, alpha, p, l_new
