"""A layer's config fields written in the order of its geometry, for the tests' tables of configs.

``geometry(HQ, H, dk, dv, l, d, l', n=..., w=...)``: query heads, kv heads, head dims, compression
block and stride, selection block, then the number of selected blocks and the window by name.
"""

from __future__ import annotations


def geometry(
    hq: int, heads: int, dk: int, dv: int, l_cmp: int, d: int, l_sel: int, n: int, w: int
) -> dict[str, int]:
    """NSAConfig's fields (phi and scale left to the caller)."""
    return dict(
        num_q_heads=hq,
        num_kv_heads=heads,
        head_dim_qk=dk,
        head_dim_v=dv,
        cmp_block=l_cmp,
        cmp_stride=d,
        sel_block=l_sel,
        num_selected=n,
        window=w,
    )
