"""``nsa-bench decode --ragged``'s host side: the spread of lengths and its table (CPU)."""

from __future__ import annotations

import argparse
import itertools

import pytest

from nsa_bench.decode_ragged import markdown, parse_ragged, spread


def test_lengths_spread_evenly_from_lo_to_hi() -> None:
    lengths = spread(32, 1024, 131072)
    assert len(lengths) == 32
    assert (lengths[0], lengths[-1]) == (1024, 131072)
    steps = {b - a for a, b in itertools.pairwise(lengths)}
    assert max(steps) - min(steps) <= 1, "evenly spaced up to rounding"
    assert spread(1, 4096, 8192) == [4096]


def test_the_spec_reads_b_lo_and_hi_with_length_suffixes() -> None:
    assert parse_ragged("32:1k-128k") == (32, 1024, 131072)
    assert parse_ragged("4:100-100") == (4, 100, 100)
    for bad in ("32", "0:1k-2k", "32:2k-1k", "x:1k-2k", "32:1k"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_ragged(bad)


def test_the_table_has_one_line_per_layout() -> None:
    row = {
        "layout": "ragged_paged", "B": 32, "lengths": "1024..131072", "tokens": 2113536,
        "page_size": 256, "sel_cache_mib": 4240, "ms_step": 0.17, "vs_uniform": 0.95,
        "reads_last_step": 724860, "replays": 1000, "replay_mismatches": 0,
    }  # fmt: skip
    uniform = {**row, "layout": "uniform", "page_size": None, "replays": None}
    lines = markdown([row, {**uniform, "replay_mismatches": None}])
    table = lines.splitlines()
    assert len(table) == 4
    assert table[2].startswith("| ragged_paged | 32 | 1024..131072 | 2113536 | 256 |")
    assert "| 1000 | 0 |" in table[2]
    assert "| - | - |" in table[3]
