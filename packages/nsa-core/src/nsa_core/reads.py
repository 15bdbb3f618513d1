"""Tokens a decode step reads (docs/spec.md, "Tokens read per decode step")."""

from __future__ import annotations

from nsa_core.block_math import num_cmp_blocks
from nsa_core.checks import check_config, check_position, check_selected_reads
from nsa_core.config import NSAConfig


def expected_reads(position: int, config: NSAConfig) -> int:
    """reads(t) for a full selection, per sequence and kv head, at a step at position t.

    ``N_cmp(t+1) + sum_j |block j ∩ [0, t]| + min(w, t+1)``, the sum over the n selected blocks
    when the n blocks are the most recent full ones plus the current block (every selection has
    that size once t+1 >= n*l'; before that every valid block is selected). ``position`` is an
    int in [0, 2^31 - 2], ``config`` an NSAConfig.
    """
    t = check_position("position", position)
    check_config(config)
    lsel, n = config.sel_block, config.num_selected
    current = t // lsel
    selected_tokens = (t - current * lsel + 1) + min(current, n - 1) * lsel
    return (
        num_cmp_blocks(t + 1, config.cmp_block, config.cmp_stride)
        + selected_tokens
        + min(config.window, t + 1)
    )


def selected_reads(position: int, block_indices: list[int], sel_block: int) -> int:
    """sum_j |block j ∩ [0, t]| over the given selected blocks (-1 ignored, repeats once).

    ``position`` an int in [0, 2^31 - 2], ``block_indices`` a list or tuple of ints >= -1,
    ``sel_block`` l' >= 1.
    """
    check_selected_reads(position, block_indices, sel_block)
    total = 0
    for j in sorted({j for j in block_indices if j >= 0}):
        total += max(0, min((j + 1) * sel_block, position + 1) - j * sel_block)
    return total
