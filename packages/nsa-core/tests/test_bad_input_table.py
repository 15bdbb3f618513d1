"""Every public entry point refuses bad arguments before it changes anything (docs/spec.md).

One row per bad input: the entry point, the argument, the bad value, the exception type and a
fragment of its message (which names the argument and the rule). Rows that touch a decode cache
also check that the cache is exactly as it was (length, num_cmp and every tensor). A row that
reaches ZeroDivisionError, AttributeError, an allocator error or any other exception type fails.
Every public name of nsa_core that takes arguments has at least three rows of its own.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from bad_input_lib import (
    D_CMP,
    DK,
    DV,
    HIDDEN,
    HQ,
    L_CMP,
    L_SEL,
    N_BLOCKS,
    N_CMP,
    N_SEL,
    B,
    H,
    T,
    W,
    config,
    rand,
    valid_indices,
)

import nsa_core
from nsa_core import (
    BranchInputs,
    CompressMLP,
    DecodeStats,
    NSAAttention,
    NSACache,
    NSAConfig,
    RaggedNSACache,
    Toggles,
    apply_rope,
    attention_core,
    block_scores,
    cmp_block_overlap,
    cmp_cu_seqlens,
    compress,
    compress_avg,
    compressed_attention,
    compressed_attention_with_lse,
    expected_reads,
    gated_combine,
    nsa_attention,
    nsa_func,
    nsa_varlen_func,
    nsa_with_kvcache,
    num_cmp_blocks,
    num_sel_blocks,
    select_blocks,
    selected_attention,
    selected_reads,
    sliding_attention,
    split_blocks,
    topn_blocks,
)

PREFILL = 5  # tokens in the decode cache of the stateful rows
HUGE = 10**9  # would ask the allocator for gigabytes if it were not refused
PAST_INT32 = 2**31  # one past the most tokens int32 positions address (docs/spec.md)
# Finite in float64, infinite in the float32 that float16, bfloat16 and float32 logits are scaled
# in: docs/spec.md refuses it for those inputs.
SCALE_INF_IN_FLOAT32 = 1e39
IN_FLOAT32 = "must be finite and > 0 in torch.float32"


def paper_config(**over: Any) -> NSAConfig:
    return NSAConfig(**over)


def q_() -> torch.Tensor:
    return rand(B, T, HQ, DK)


def k_cmp_() -> torch.Tensor:
    return rand(B, N_CMP, H, DK)


def scores_() -> torch.Tensor:
    return rand(B, T, H, N_BLOCKS)


def branch() -> torch.Tensor:
    """o_* [B, T, HQ, dv]."""
    return rand(B, T, HQ, DV)


def gates_() -> torch.Tensor:
    return torch.rand(B, T, HQ, 3)


# ------------------------------------------------------------------------------ op calls


def call_with(
    fn: Callable[..., object], args: dict[str, Any], keywords: tuple[str, ...], over: dict[str, Any]
) -> object:
    """``fn`` on ``args`` with some replaced or added by ``over``, in order; the names in
    ``keywords`` go by keyword, the rest by position."""
    a = args | over
    kw = {name: a.pop(name) for name in keywords if name in a}
    return fn(*a.values(), **kw)


def scoring_args() -> dict[str, Any]:
    """The leading arguments select_blocks and block_scores share (q, k_cmp, l, d, l')."""
    return {
        "q": q_(),
        "k_cmp": k_cmp_(),
        "cmp_block": L_CMP,
        "cmp_stride": D_CMP,
        "sel_block": L_SEL,
    }


def select_blocks_with(**over: Any) -> object:
    args = scoring_args() | {"num_selected": N_SEL, "scale": None}
    return call_with(select_blocks, args, ("q_start", "cu_seqlens"), over)


def block_scores_with(**over: Any) -> object:
    return call_with(block_scores, scoring_args() | {"scale": None}, ("q_start",), over)


def topn_blocks_with(**over: Any) -> object:
    args = {"scores": scores_(), "num_selected": N_SEL, "sel_block": L_SEL}
    return call_with(topn_blocks, args, ("q_start",), over)


def compressed_with(**over: Any) -> object:
    args = {
        "q": q_(),
        "k_cmp": k_cmp_(),
        "v_cmp": rand(B, N_CMP, H, DV),
        "cmp_block": L_CMP,
        "cmp_stride": D_CMP,
    }
    return call_with(compressed_attention, args, ("q_start", "scale"), over)


def attention_args() -> dict[str, Any]:
    """The q, k, v that sliding, selected and nsa_attention share."""
    return {"q": q_(), "k": rand(B, T, H, DK), "v": rand(B, T, H, DV)}


def sliding_with(**over: Any) -> object:
    args = attention_args() | {"window": W}
    return call_with(sliding_attention, args, ("q_start",), over)


def selected_with(**over: Any) -> object:
    args = attention_args() | {"block_indices": valid_indices(), "sel_block": L_SEL}
    return call_with(selected_attention, args, ("scale", "q_start", "cu_seqlens"), over)


def compress_with(**over: Any) -> object:
    args = {"x": rand(B, T, H, DK), "cmp_block": L_CMP, "cmp_stride": D_CMP}
    return call_with(compress, args, ("phi", "cu_seqlens"), over)


def split_blocks_with(**over: Any) -> object:
    args = {"x": rand(B, T, H, DK), "cmp_block": L_CMP, "cmp_stride": D_CMP}
    return call_with(split_blocks, args, (), over)


def combine_with(**over: Any) -> object:
    args = {"o_cmp": branch(), "o_sel": branch(), "o_win": branch(), "gates": gates_()}
    return call_with(gated_combine, args, (), over)


def nsa_attention_with(**over: Any) -> object:
    args = attention_args() | {"gates": gates_(), "config": config()}
    return call_with(nsa_attention, args, ("phi_k", "phi_v", "cu_seqlens"), over)


def kv_branches(**over: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"cmp": rand(B, T, H, DK), "sel": rand(B, T, H, DK), "win": rand(B, T, H, DK)} | over


def layer_() -> NSAAttention:
    return NSAAttention(config(), HIDDEN)


def compressed_with_lse(**over: Any) -> object:
    args = {
        "q": q_(),
        "k_cmp": k_cmp_(),
        "v_cmp": rand(B, N_CMP, H, DV),
        "cmp_block": L_CMP,
        "cmp_stride": D_CMP,
    }
    return call_with(compressed_attention_with_lse, args, ("q_start", "scale"), over)


def apply_rope_with(**over: Any) -> object:
    args = {"x": rand(B, T, H, DK), "positions": torch.arange(T), "theta": 10000.0}
    return call_with(apply_rope, args, (), over)


def attention_core_with(**over: Any) -> object:
    args = {
        "q": q_(),
        "k_cmp": k_cmp_(),
        "v_cmp": rand(B, N_CMP, H, DV),
        "k_sel": rand(B, T, H, DK),
        "v_sel": rand(B, T, H, DV),
        "k_win": rand(B, T, H, DK),
        "v_win": rand(B, T, H, DV),
        "gates": gates_(),
        "config": config(),
    }
    return call_with(attention_core, args, ("q_start", "win_start", "cu_seqlens"), over)


def nsa_func_with(**over: Any) -> object:
    args = attention_args() | {"gates": gates_()}
    keywords = ("config", "softmax_scale", "window", "phi_k", "phi_v")
    return call_with(nsa_func, args | {"config": config()}, keywords, over)


def nsa_with_kvcache_with(**over: Any) -> object:
    """One new token per sequence appended to a dense cache of room T holding 5 tokens each."""
    args = {
        "q": rand(B, 1, HQ, DK),
        "k_cache": rand(B, T, H, DK),
        "v_cache": rand(B, T, H, DV),
        "k": rand(B, 1, H, DK),
        "v": rand(B, 1, H, DV),
        "gates": torch.rand(B, 1, HQ, 3),
        "cache_seqlens": torch.full((B,), 5, dtype=torch.int32),
        "config": config(),
    }
    keywords = ("cache_seqlens", "block_table", "config", "softmax_scale", "window", "rope_theta")
    return call_with(nsa_with_kvcache, args, keywords, over)


def nsa_varlen_func_with(**over: Any) -> object:
    cu = torch.tensor([0, 3, T], dtype=torch.int32)
    args = {
        "q": rand(T, HQ, DK),
        "k": rand(T, H, DK),
        "v": rand(T, H, DV),
        "cu_seqlens_q": cu,
        "cu_seqlens_k": cu.clone(),
        "gates": torch.rand(T, HQ, 3),
        "config": config(),
    }
    keywords = ("max_seqlen_q", "max_seqlen_k", "config", "softmax_scale", "window")
    return call_with(nsa_varlen_func, args, keywords, over)


def compress_avg_with(**over: Any) -> object:
    return call_with(compress_avg, {"blocks": rand(B, N_CMP, L_CMP, H, DK)}, (), over)


def compress_mlp_with(**over: Any) -> object:
    return call_with(CompressMLP, {"head_dim": DK, "cmp_block": L_CMP}, (), over)


def compress_mlp_forward(blocks: torch.Tensor) -> object:
    return CompressMLP(DK, L_CMP)(blocks)


def num_cmp_blocks_with(**over: Any) -> object:
    args = {"length": T, "cmp_block": L_CMP, "cmp_stride": D_CMP}
    return call_with(num_cmp_blocks, args, (), over)


def num_sel_blocks_with(**over: Any) -> object:
    return call_with(num_sel_blocks, {"length": T, "sel_block": L_SEL}, (), over)


def cmp_block_overlap_with(**over: Any) -> object:
    args = {
        "num_cmp": N_CMP,
        "num_sel": N_BLOCKS,
        "cmp_block": L_CMP,
        "cmp_stride": D_CMP,
        "sel_block": L_SEL,
    }
    return call_with(cmp_block_overlap, args, ("device", "dtype"), over)


def cmp_cu_seqlens_with(**over: Any) -> object:
    args = {
        "cu_seqlens": torch.tensor([0, 3, T], dtype=torch.int32),
        "cmp_block": L_CMP,
        "cmp_stride": D_CMP,
    }
    return call_with(cmp_cu_seqlens, args, (), over)


def expected_reads_with(**over: Any) -> object:
    return call_with(expected_reads, {"position": T, "config": config()}, (), over)


def selected_reads_with(**over: Any) -> object:
    args = {"position": T, "block_indices": [0, 1, -1], "sel_block": L_SEL}
    return call_with(selected_reads, args, (), over)


def branch_inputs_with(**over: Any) -> object:
    args = {"q": q_(), "k": kv_branches(), "v": v_branches(), "gates": gates_()}
    return call_with(BranchInputs, args, (), over)


def v_branches(**over: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"cmp": rand(B, T, H, DV), "sel": rand(B, T, H, DV), "win": rand(B, T, H, DV)} | over


def decode_stats_with(**over: Any) -> object:
    reads = torch.ones(B, H, dtype=torch.int64)
    args = {
        "position": T,
        "reads_cmp": reads,
        "reads_sel": reads,
        "reads_win": reads,
        "reads_expected": 3,
    }
    return call_with(DecodeStats, args, (), over)


def cache_with(**over: Any) -> object:
    """NSACache made from the fields of a valid empty cache (capacity 4), some replaced."""
    cache = NSACache.empty(config(), B, capacity=4)
    given = {f.name: getattr(cache, f.name) for f in dataclasses.fields(cache)}
    return NSACache(**(given | over))


def ragged_with(**over: Any) -> object:
    args = {"rows": [NSACache.empty(config(), 1)], "starts": [0]}
    return call_with(RaggedNSACache, args, (), over)


def toggles_with(**over: Any) -> object:
    return Toggles(**over)


# ------------------------------------------------------------------------------ stateful calls


@dataclass
class Fixture:
    """A layer, its prefilled cache, and every cache a row's call must leave unchanged."""

    layer: NSAAttention
    cache: NSACache
    watched: list[tuple[NSACache, dict[str, Any]]] = field(default_factory=list)

    def watch(self, cache: NSACache) -> NSACache:
        self.watched.append((cache, logical_state(cache)))
        return cache


def logical_state(cache: NSACache) -> dict[str, Any]:
    """length, num_cmp and every logical tensor (meta tensors by shape, dtype and device)."""
    tensors = {
        name: t.clone() if t.device.type != "meta" else t for name, t in cache.state().items()
    }
    return {"length": cache.length, "num_cmp": cache.num_cmp, "tensors": tensors}


def same_state(before: dict[str, Any], after: dict[str, Any]) -> bool:
    if (before["length"], before["num_cmp"]) != (after["length"], after["num_cmp"]):
        return False
    for name, old in before["tensors"].items():
        new = after["tensors"][name]
        if (old.shape, old.dtype, old.device) != (new.shape, new.dtype, new.device):
            return False
        if old.device.type != "meta" and not torch.equal(old, new):
            return False
    return True


def make_fixture() -> Fixture:
    torch.manual_seed(0)
    layer = layer_()
    with torch.no_grad():
        _, cache = layer.prefill(rand(B, PREFILL, HIDDEN))
    fx = Fixture(layer, cache)
    fx.watch(cache)
    return fx


def cache_of(fx: Fixture, **empty: Any) -> NSACache:
    """A watched cache for ``fx.layer``'s config with some of NSACache.empty's arguments changed."""
    a: dict[str, Any] = {"config": config(), "batch": B} | empty
    cache = NSACache.empty(a.pop("config"), a.pop("batch"), **a)
    return fx.watch(cache)


def float64_cache(fx: Fixture) -> NSACache:
    """A prefilled float64 cache of the same layer (the user's "cache of another dtype")."""
    layer64 = copy.deepcopy(fx.layer).to(torch.float64)
    with torch.no_grad():
        _, cache = layer64.prefill(rand(B, PREFILL, HIDDEN, dtype=torch.float64))
    return fx.watch(cache)


def tokens(fx: Fixture, **over: torch.Tensor) -> dict[str, torch.Tensor]:
    """One token of K/V per branch for ``fx.cache``: k_* [B, 1, H, dk], v_* [B, 1, H, dv]."""
    base = {
        "k_sel": rand(B, 1, H, DK),
        "v_sel": rand(B, 1, H, DV),
        "k_win": rand(B, 1, H, DK),
        "v_win": rand(B, 1, H, DV),
        "k_raw": rand(B, 1, H, DK),
        "v_raw": rand(B, 1, H, DV),
    }
    return base | over


def decode(fx: Fixture, x: object = None, cache: object = None) -> object:
    x = rand(B, 1, HIDDEN) if x is None else x
    return fx.layer.decode(x, fx.cache if cache is None else cache)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ the table


@dataclass(frozen=True)
class Case:
    entry: str
    arg: str
    bad: str
    error: type[Exception]
    fragment: str
    call: Callable[[], object] | None = None
    stateful: Callable[[Fixture], object] | None = None

    @property
    def id(self) -> str:
        return f"{self.entry}-{self.arg}={self.bad}"


def case(
    entry: str, arg: str, bad: object, error: type[Exception], fragment: str, call: Any
) -> Case:
    return Case(entry, arg, str(bad), error, fragment, call=call)


# Each entry point's call on valid arguments, some of them replaced by keyword (the op calls above).
CALL_WITH: dict[str, Callable[..., object]] = {
    "select_blocks": select_blocks_with,
    "block_scores": block_scores_with,
    "topn_blocks": topn_blocks_with,
    "compressed_attention": compressed_with,
    "sliding_attention": sliding_with,
    "selected_attention": selected_with,
    "compress": compress_with,
    "split_blocks": split_blocks_with,
    "gated_combine": combine_with,
    "NSAConfig": paper_config,
    "nsa_attention": nsa_attention_with,
    "compressed_attention_with_lse": compressed_with_lse,
    "apply_rope": apply_rope_with,
    "attention_core": attention_core_with,
    "nsa_func": nsa_func_with,
    "nsa_varlen_func": nsa_varlen_func_with,
    "nsa_with_kvcache": nsa_with_kvcache_with,
    "compress_avg": compress_avg_with,
    "CompressMLP": compress_mlp_with,
    "num_cmp_blocks": num_cmp_blocks_with,
    "num_sel_blocks": num_sel_blocks_with,
    "cmp_block_overlap": cmp_block_overlap_with,
    "cmp_cu_seqlens": cmp_cu_seqlens_with,
    "expected_reads": expected_reads_with,
    "selected_reads": selected_reads_with,
    "BranchInputs": branch_inputs_with,
    "DecodeStats": decode_stats_with,
    "NSACache": cache_with,
    "RaggedNSACache": ragged_with,
    "Toggles": toggles_with,
}


def arg_case(entry: str, arg: str, bad: object, error: type[Exception], fragment: str) -> Case:
    """The row whose call is ``entry``'s valid call with ``bad`` passed as ``arg``."""
    return case(entry, arg, bad, error, fragment, lambda: CALL_WITH[entry](**{arg: bad}))


def config_case(entry: str, bad: str, error: type[Exception], fragment: str, **over: Any) -> Case:
    """The row whose call is ``entry``'s valid call with the geometry's config changed by
    ``over`` (named ``bad`` in the row's id)."""
    return case(
        entry, "config", bad, error, fragment, lambda: CALL_WITH[entry](config=config(**over))
    )


def arg_cases(entry: str, rows: list[tuple[str, object, type[Exception], str]]) -> list[Case]:
    """:func:`arg_case` of each (argument, bad value, error, fragment) row of ``entry``."""
    return [arg_case(entry, *row) for row in rows]


def state_case(
    entry: str,
    arg: str,
    bad: object,
    error: type[Exception],
    fragment: str,
    call: Callable[[Fixture], object],
) -> Case:
    return Case(entry, arg, str(bad), error, fragment, stateful=call)


VE, TE = ValueError, TypeError
META = "meta"

# fmt: off
CASES = [
    # select_blocks (nsa_core.ops)
    *arg_cases("select_blocks", [
        ("cmp_stride", 3, VE, "cmp_stride (3) must be >= 1 and divide cmp_block"),
        ("sel_block", 5, VE, "cmp_stride (2) must divide sel_block (5)"),
        ("sel_block", 4.0, TE, "sel_block must be an int, got float 4.0"),
        ("num_selected", -1, VE, "num_selected must be >= 1, got -1"),
        ("num_selected", HUGE, VE, "num_selected must be <= 536870911"),
        ("num_selected", 3.0, TE, "num_selected must be an int"),
        ("q_start", 1.5, TE, "q_start must be an int, got float 1.5"),
        ("q_start", True, TE, "q_start must be an int, got bool"),
        ("scale", 0.0, VE, "scale must be finite and > 0, got 0.0"),
        ("scale", "x", TE, "scale must be a float or None, got str"),
    ]),
    case("select_blocks", "k_cmp", "H=0", VE, "kv heads H must be >= 1, got 0",
         lambda: select_blocks_with(k_cmp=rand(B, N_CMP, 0, DK))),
    case("select_blocks", "q", "dk=0", VE, "head dim dk must be >= 1, got 0",
         lambda: select_blocks_with(q=rand(B, T, HQ, 0), k_cmp=rand(B, N_CMP, H, 0))),
    case("select_blocks", "k_cmp", "too few blocks", VE, "but k_cmp holds 2",
         lambda: select_blocks_with(k_cmp=rand(B, N_CMP - 1, H, DK))),
    case("select_blocks", "k_cmp", "float64", TE, "k_cmp dtype torch.float64 differs from q",
         lambda: select_blocks_with(k_cmp=rand(B, N_CMP, H, DK, dtype=torch.float64))),
    case("select_blocks", "k_cmp", META, VE, "k_cmp is on meta but q is on cpu",
         lambda: select_blocks_with(k_cmp=rand(B, N_CMP, H, DK, device=META))),
    case("select_blocks", "cu_seqlens", "int64", TE, "cu_seqlens must be int32, got torch.int64",
         lambda: select_blocks_with(cu_seqlens=torch.tensor([0, T]))),
    # block_scores (nsa_core.reference)
    *arg_cases("block_scores", [
        ("cmp_stride", 3, VE, "cmp_stride (3) must be >= 1 and divide cmp_block"),
        ("cmp_block", 0, VE, "cmp_block must be >= 1, got 0"),
        ("sel_block", 4.0, TE, "sel_block must be an int, got float"),
        ("sel_block", 5, VE, "cmp_stride (2) must divide sel_block (5)"),
        ("q_start", 1.5, TE, "q_start must be an int, got float 1.5"),
        ("q_start", -1, VE, "q_start must be >= 0, got -1"),
        ("scale", -1.0, VE, "scale must be finite and > 0, got -1.0"),
    ]),
    case("block_scores", "k_cmp", "H=0", VE, "kv heads H must be >= 1, got 0",
         lambda: block_scores_with(k_cmp=rand(B, N_CMP, 0, DK))),
    case("block_scores", "q", "dk=0", VE, "head dim dk must be >= 1, got 0",
         lambda: block_scores_with(q=rand(B, T, HQ, 0), k_cmp=rand(B, N_CMP, H, 0))),
    case("block_scores", "k_cmp", "too few blocks", VE, "but k_cmp holds 1",
         lambda: block_scores_with(k_cmp=rand(B, 1, H, DK))),
    # topn_blocks (nsa_core.reference)
    *arg_cases("topn_blocks", [
        ("num_selected", -1, VE, "num_selected must be >= 1, got -1"),
        ("num_selected", HUGE, VE, "num_selected must be <= 536870911"),
        ("num_selected", 2.0, TE, "num_selected must be an int, got float"),
        ("sel_block", 4.0, TE, "sel_block must be an int, got float 4.0"),
        ("sel_block", 0, VE, "sel_block must be >= 1, got 0"),
        ("q_start", 1.5, TE, "q_start must be an int, got float 1.5"),
        ("q_start", -2, VE, "q_start must be >= 0, got -2"),
    ]),
    case("topn_blocks", "scores", "rank 3", VE, "scores must have rank 4",
         lambda: topn_blocks_with(scores=rand(B, T, N_BLOCKS))),
    case("topn_blocks", "scores", "too few blocks", VE, "hold 1 blocks; queries up to",
         lambda: topn_blocks_with(scores=rand(B, T, H, 1))),
    case("topn_blocks", "scores", "int64", TE, "scores must be a floating-point tensor",
         lambda: topn_blocks_with(scores=torch.zeros(B, T, H, N_BLOCKS, dtype=torch.int64))),
    # compressed / sliding / selected attention (nsa_core.ops)
    *arg_cases("compressed_attention", [
        ("cmp_stride", 3, VE, "cmp_stride (3) must be >= 1 and divide"),
        ("cmp_block", 4.0, TE, "cmp_block must be an int, got float"),
    ]),
    case("compressed_attention", "v_cmp", "float64", TE, "v_cmp dtype torch.float64 differs",
         lambda: compressed_with(v_cmp=rand(B, N_CMP, H, DV, dtype=torch.float64))),
    *arg_cases("compressed_attention", [
        ("q_start", 1.5, TE, "q_start must be an int, got float 1.5"),
    ]),
    case("compressed_attention", "v_cmp", "dv=0", VE, "head dim dv must be >= 1, got 0",
         lambda: compressed_with(v_cmp=rand(B, N_CMP, H, 0))),
    *arg_cases("sliding_attention", [
        ("window", 2.5, TE, "window must be an int, got float 2.5"),
        ("window", 0, VE, "window must be >= 1, got 0"),
        ("q_start", 1.5, TE, "q_start must be an int, got float 1.5"),
        ("q_start", 1, VE, "need keys up to 8, but k holds 8 tokens"),
    ]),
    case("sliding_attention", "v", META, VE, "v is on meta but q is on cpu",
         lambda: sliding_with(v=rand(B, T, H, DV, device=META))),
    case("sliding_attention", "q", "HQ=0", VE, "query heads HQ must be >= 1, got 0",
         lambda: sliding_with(q=rand(B, T, 0, DK))),
    *arg_cases("selected_attention", [
        ("sel_block", 4.0, TE, "sel_block must be an int, got float 4.0"),
    ]),
    case("selected_attention", "block_indices", 2, VE, "block_indices must lie in [-1, 2)",
         lambda: selected_with(block_indices=valid_indices().clamp_min(2))),
    case("selected_attention", "block_indices", "float32", TE, "must be int32 or int64",
         lambda: selected_with(block_indices=valid_indices().float())),
    case("selected_attention", "k", "H=0", VE, "kv heads H must be >= 1, got 0",
         lambda: selected_with(k=rand(B, T, 0, DK), v=rand(B, T, 0, DV))),
    # compress, split_blocks, gated_combine (nsa_core.reference)
    *arg_cases("compress", [
        ("cmp_stride", 3, VE, "cmp_stride (3) must be >= 1 and divide cmp_block (4)"),
        ("cmp_block", 4.0, TE, "cmp_block must be an int, got float 4.0"),
        ("phi", "mean", TE, "phi must be a torch.nn.Module or None, got str"),
    ]),
    case("compress", "x", "rank 3", VE, "x must have rank 4",
         lambda: compress_with(x=rand(B, T, H * DK))),
    case("compress", "cu_seqlens", [0, 3], VE, "cu_seqlens must end at T=8, got 3",
         lambda: compress_with(cu_seqlens=torch.tensor([0, 3], dtype=torch.int32))),
    *arg_cases("split_blocks", [
        ("cmp_stride", 0, VE, "cmp_stride (0) must be >= 1"),
        ("cmp_block", 2.5, TE, "cmp_block must be an int, got float 2.5"),
    ]),
    case("gated_combine", "gates", "[B, T, HQ, 2]", VE, "gates [1, 8, 4, 2] must be [B, T, HQ, 3]",
         lambda: combine_with(gates=torch.rand(B, T, HQ, 2))),
    case("gated_combine", "gates", "float64", TE, "gates dtype torch.float64 differs from o_cmp",
         lambda: combine_with(gates=torch.rand(B, T, HQ, 3, dtype=torch.float64))),
    case("gated_combine", "o_sel", META, VE, "o_sel is on meta but o_cmp is on cpu",
         lambda: combine_with(o_sel=rand(B, T, HQ, DV, device=META))),
    case("gated_combine", "o_win", "[B, T-1, HQ, dv]", VE, "o_win [1, 7, 4, 6] differs from o_cmp",
         lambda: combine_with(o_win=rand(B, T - 1, HQ, DV))),
    # NSAConfig
    *arg_cases("NSAConfig", [
        ("num_selected", HUGE, VE, "num_selected (1000000000) times"),
        ("num_selected", 2, VE, "NSAConfig.num_selected must be >= 3"),
        ("window", 2.5, TE, "NSAConfig.window must be an int, got 2.5"),
        ("sel_block", 64.0, TE, "NSAConfig.sel_block must be an int"),
        ("cmp_stride", 3, VE, "NSAConfig.cmp_stride (3) must divide cmp_block (32)"),
        ("sel_block", 40, VE, "NSAConfig.cmp_stride (16) must divide sel_block (40)"),
        ("num_kv_heads", 0, VE, "NSAConfig.num_kv_heads must be >= 1, got 0"),
        ("head_dim_qk", 0, VE, "NSAConfig.head_dim_qk must be >= 1, got 0"),
        ("head_dim_qk", 7, VE, "NSAConfig.head_dim_qk must be even"),
        ("num_q_heads", 6, VE, "NSAConfig.num_q_heads (6) must be a multiple of"),
        ("phi", "max", VE, "NSAConfig.phi must be 'avg' or 'mlp', got 'max'"),
    ]),
    case("NSAConfig", "scale", "nan", VE, "NSAConfig.scale must be positive and finite, got nan",
         lambda: paper_config(scale=float("nan"))),
    *arg_cases("NSAConfig", [
        ("rope_theta", 0.0, VE, "NSAConfig.rope_theta must be positive and finite"),
    ]),
    # NSAAttention construction and forward / prefill
    case("NSAAttention", "config", "dict", TE, "config must be an NSAConfig, got dict",
         lambda: NSAAttention({"num_q_heads": HQ}, HIDDEN)),  # type: ignore[arg-type]
    case("NSAAttention", "hidden_size", 16.0, TE, "hidden_size must be an int, got float",
         lambda: NSAAttention(config(), 16.0)),  # type: ignore[arg-type]
    case("NSAAttention", "hidden_size", 0, VE, "hidden_size must be >= 1, got 0",
         lambda: NSAAttention(config(), 0)),
    case("NSAAttention.forward", "x", "rank 2", VE, "x must have rank 3",
         lambda: layer_()(rand(T, HIDDEN))),
    case("NSAAttention.forward", "x", "float64", TE, "x dtype torch.float64 differs",
         lambda: layer_()(rand(B, T, HIDDEN, dtype=torch.float64))),
    case("NSAAttention.forward", "x", META, VE, "x is on meta but the layer is on cpu",
         lambda: layer_()(rand(B, T, HIDDEN, device=META))),
    case("NSAAttention.forward", "x", "hidden 15", VE, "must end in hidden_size=16",
         lambda: layer_()(rand(B, T, HIDDEN - 1))),
    case("NSAAttention.forward", "cu_seqlens", "B=2", VE, "pack sequences along T with B == 1",
         lambda: layer_()(rand(2, T, HIDDEN), torch.tensor([0, T], dtype=torch.int32))),
    case("NSAAttention.prefill", "capacity", -1, VE, "capacity must be >= 0, got -1",
         lambda: layer_().prefill(rand(B, T, HIDDEN), -1)),
    case("NSAAttention.prefill", "capacity", 2.5, TE, "capacity must be an int, got float",
         lambda: layer_().prefill(rand(B, T, HIDDEN), 2.5)),  # type: ignore[arg-type]
    case("NSAAttention.prefill", "capacity", 2**40, VE, "capacity must be <= 2147483647",
         lambda: layer_().prefill(rand(B, T, HIDDEN), 2**40)),
    # nsa_attention
    *arg_cases("nsa_attention", [
        ("config", None, TE, "config must be an NSAConfig, got NoneType"),
        ("k", None, TE, "k must be a tensor or a mapping with keys"),
    ]),
    case("nsa_attention", "k", "no 'win'", TE, "k must be a tensor or a mapping with keys",
         lambda: nsa_attention_with(k={"cmp": rand(B, T, H, DK), "sel": rand(B, T, H, DK)})),
    case("nsa_attention", "k", "k['win'] T-1 tokens", VE, "k['win'] [1, 7, 2, 8] must hold q's 8",
         lambda: nsa_attention_with(
             k=kv_branches(win=rand(B, T - 1, H, DK)),
             v={"cmp": rand(B, T, H, DV), "sel": rand(B, T, H, DV), "win": rand(B, T - 1, H, DV)},
         )),
    case("nsa_attention", "gates", "[B, T, HQ, 2]", VE, "gates [1, 8, 4, 2] must be [B, T, HQ, 3]",
         lambda: nsa_attention_with(gates=torch.rand(B, T, HQ, 2))),
    case("nsa_attention", "gates", "float64", TE, "gates dtype torch.float64 differs from q",
         lambda: nsa_attention_with(gates=torch.rand(B, T, HQ, 3, dtype=torch.float64))),
    case("nsa_attention", "config", "num_q_heads=8", VE, "differ from the config's (8, 2, 8, 6)",
         lambda: nsa_attention_with(config=config(num_q_heads=8))),
    case("nsa_attention", "config", "head_dim_v=4", VE, "differ from the config's (4, 2, 8, 4)",
         lambda: nsa_attention_with(config=config(head_dim_v=4))),
    *arg_cases("nsa_attention", [
        ("phi_k", "avg", TE, "phi_k must be a torch.nn.Module or None, got str"),
    ]),
    case("nsa_attention", "k", "H=0", VE, "kv heads H must be >= 1, got 0",
         lambda: nsa_attention_with(k=rand(B, T, 0, DK), v=rand(B, T, 0, DV))),
    # NSACache.empty
    case("NSACache.empty", "batch", -1, VE, "batch must be >= 0, got -1",
         lambda: NSACache.empty(config(), -1)),
    case("NSACache.empty", "capacity", -1, VE, "capacity must be >= 0, got -1",
         lambda: NSACache.empty(config(), B, capacity=-1)),
    case("NSACache.empty", "capacity", 2**40, VE, "capacity must be <= 2147483647",
         lambda: NSACache.empty(config(), B, capacity=2**40)),
    case("NSACache.empty", "dtype", "torch.int32", TE, "dtype must be a floating-point torch.dtype",
         lambda: NSACache.empty(config(), B, dtype=torch.int32)),
    case("NSACache.empty", "config", None, TE, "config must be an NSAConfig, got NoneType",
         lambda: NSACache.empty(None, B)),  # type: ignore[arg-type]
    case("NSACache.empty", "device", "nowhere", VE, "device 'nowhere' is not a device",
         lambda: NSACache.empty(config(), B, device="nowhere")),
    case("NSACache.empty", "device", 3.5, TE, "device must be a torch.device, a str or None",
         lambda: NSACache.empty(config(), B, device=3.5)),  # type: ignore[arg-type]
    # NSAAttention.decode: the cache must be unchanged after every refusal
    state_case("NSAAttention.decode", "cache", None, TE, "cache must be an NSACache, got NoneType",
               lambda fx: fx.layer.decode(rand(B, 1, HIDDEN), None)),  # type: ignore[arg-type]
    state_case("NSAAttention.decode", "x", "2 tokens", VE, "decode takes one token per sequence",
               lambda fx: decode(fx, x=rand(B, 2, HIDDEN))),
    state_case("NSAAttention.decode", "x", "float64", TE, "x dtype torch.float64 differs",
               lambda fx: decode(fx, x=rand(B, 1, HIDDEN, dtype=torch.float64))),
    state_case("NSAAttention.decode", "x", "rank 2", VE, "x must have rank 3",
               lambda fx: decode(fx, x=rand(B, HIDDEN))),
    state_case("NSAAttention.decode", "cache", "float64 cache", TE,
               "cache dtype torch.float64 differs from torch.float32, the dtype this step",
               lambda fx: decode(fx, cache=float64_cache(fx))),
    state_case("NSAAttention.decode", "cache", "meta cache", VE, "cache is on meta but x is on cpu",
               lambda fx: decode(fx, cache=cache_of(fx, device=META))),
    state_case("NSAAttention.decode", "cache", "batch 2", VE, "cache holds batch 2 but x has",
               lambda fx: decode(fx, cache=cache_of(fx, batch=2))),
    state_case("NSAAttention.decode", "cache", "window 5", VE, "cache.config",
               lambda fx: decode(fx, cache=cache_of(fx, config=config(window=5)))),
    state_case("NSAAttention.decode", "cache", "head_dim_v 4", VE, "another layer config",
               lambda fx: decode(fx, cache=cache_of(fx, config=config(head_dim_v=4)))),
    # NSACache.append_tokens / append_blocks
    state_case("NSACache.append_tokens", "v_win", "float64", TE,
               "v_win dtype torch.float64 differs from the cache dtype",
               lambda fx: fx.cache.append_tokens(
                   **tokens(fx, v_win=rand(B, 1, H, DV, dtype=torch.float64)))),
    state_case("NSACache.append_tokens", "k_raw", "H=1", VE, "k_raw [1, 1, 1, 8] must be [B=1",
               lambda fx: fx.cache.append_tokens(**tokens(fx, k_raw=rand(B, 1, 1, DK)))),
    state_case("NSACache.append_tokens", "v_sel", "2 tokens", VE, "2 entries but k_sel holds 1",
               lambda fx: fx.cache.append_tokens(**tokens(fx, v_sel=rand(B, 2, H, DV)))),
    state_case("NSACache.append_tokens", "k_win", META, VE, "k_win is on meta but the cache",
               lambda fx: fx.cache.append_tokens(
                   **tokens(fx, k_win=rand(B, 1, H, DK, device=META)))),
    state_case("NSACache.append_tokens", "k_win", "2 tokens", VE, "more tokens than the 1 new",
               lambda fx: fx.cache.append_tokens(
                   **tokens(fx, k_win=rand(B, 2, H, DK), v_win=rand(B, 2, H, DV)))),
    state_case("NSACache.append_tokens", "v_raw", "rank 3", VE, "v_raw must have rank 4",
               lambda fx: fx.cache.append_tokens(**tokens(fx, v_raw=rand(B, H, DV)))),
    state_case("NSACache.append_blocks", "consumed", PREFILL, VE, "consumed must be <= 3",
               lambda fx: fx.cache.append_blocks(
                   rand(B, 1, H, DK), rand(B, 1, H, DV), consumed=PREFILL)),
    state_case("NSACache.append_blocks", "consumed", 2.0, TE, "consumed must be an int",
               lambda fx: fx.cache.append_blocks(
                   rand(B, 1, H, DK), rand(B, 1, H, DV), consumed=2.0)),  # type: ignore[arg-type]
    state_case("NSACache.append_blocks", "v_cmp", "dv=4", VE, "v_cmp [1, 1, 2, 4] must be",
               lambda fx: fx.cache.append_blocks(rand(B, 1, H, DK), rand(B, 1, H, 4), consumed=2)),
    # the softmax scale in the work dtype of the inputs (docs/spec.md, "Argument rules")
    *[arg_case(entry, "scale", SCALE_INF_IN_FLOAT32, VE, f"scale {IN_FLOAT32}") for entry in (
        "select_blocks", "block_scores", "compressed_attention", "compressed_attention_with_lse",
        "sliding_attention", "selected_attention",
    )],
    *[config_case(entry, "scale=1e39", VE, f"config.scale {IN_FLOAT32}", scale=SCALE_INF_IN_FLOAT32)
      for entry in ("nsa_attention", "attention_core", "nsa_func", "nsa_varlen_func")],
    config_case("nsa_attention", "rope_theta=1e39", VE, f"config.rope_theta {IN_FLOAT32}",
                rope_theta=1e39),
    case("NSAAttention.forward", "config", "scale=1e39", VE, f"config.scale {IN_FLOAT32}",
         lambda: NSAAttention(config(scale=SCALE_INF_IN_FLOAT32), HIDDEN)(rand(B, T, HIDDEN))),
    case("NSAAttention.forward", "config", "rope_theta=1e39", VE, f"config.rope_theta {IN_FLOAT32}",
         lambda: NSAAttention(config(rope_theta=1e39), HIDDEN)(rand(B, T, HIDDEN))),
    # more rows of the ops
    *arg_cases("sliding_attention", [
        ("window", PAST_INT32, VE, "window must be <= 2147483647"),
    ]),
    *arg_cases("selected_attention", [
        ("scale", -0.5, VE, "scale must be finite and > 0, got -0.5"),
        ("q_start", True, TE, "q_start must be an int, got bool"),
    ]),
    case("selected_attention", "block_indices", "past its sequence", VE,
         "block_indices must lie in [-1, 1) in sequence 0 (tokens [0, 3)",
         lambda: selected_with(block_indices=valid_indices().index_fill(1, torch.tensor([0]), 1),
                               cu_seqlens=torch.tensor([0, 3, T], dtype=torch.int32))),
    *arg_cases("compressed_attention_with_lse", [
        ("cmp_stride", 3, VE, "cmp_stride (3) must be >= 1 and divide cmp_block (4)"),
        ("q_start", -1, VE, "q_start must be >= 0, got -1"),
        ("scale", "1", TE, "scale must be a float or None, got str"),
    ]),
    case("compressed_attention_with_lse", "v_cmp", "float64", TE, "v_cmp dtype torch.float64",
         lambda: compressed_with_lse(v_cmp=rand(B, N_CMP, H, DV, dtype=torch.float64))),
    *arg_cases("split_blocks", [
        ("cmp_block", PAST_INT32, VE, "cmp_block must be <= 2147483647"),
    ]),
    case("split_blocks", "x", "rank 3", VE, "x must have rank 4 [B, T, H, D]",
         lambda: split_blocks_with(x=rand(B, T, H * DK))),
    case("compress", "x", "int64", TE, "x must be a floating-point tensor, got torch.int64",
         lambda: compress_with(x=torch.ones(B, T, H, DK, dtype=torch.int64))),
    case("compress", "x", "bool", TE, "x must be a floating-point tensor, got torch.bool",
         lambda: compress_with(x=torch.ones(B, T, H, DK, dtype=torch.bool))),
    # apply_rope
    *arg_cases("apply_rope", [
        ("theta", 1e39, VE, f"theta {IN_FLOAT32}, the dtype rotary angles are computed in"),
        ("theta", 1e-39, VE, f"theta {IN_FLOAT32}"),
        ("theta", True, TE, "theta must be a float, got bool"),
        ("theta", 0.0, VE, "theta must be finite and > 0, got 0.0"),
    ]),
    case("apply_rope", "positions", "float32", TE, "positions must hold integers, got torch.float",
         lambda: apply_rope_with(positions=torch.arange(T, dtype=torch.float32))),
    case("apply_rope", "x", "D odd", VE, "rotary head_dim must be even",
         lambda: apply_rope_with(x=rand(B, T, H, DK - 1))),
    case("apply_rope", "x", "int64", TE, "x must be a floating-point tensor, got torch.int64",
         lambda: apply_rope_with(x=torch.ones(B, T, H, DK, dtype=torch.int64))),
    # attention_core
    *arg_cases("attention_core", [
        ("config", None, TE, "config must be an NSAConfig, got NoneType"),
        ("q_start", 1.5, TE, "q_start must be an int, got float"),
        ("win_start", True, TE, "win_start must be an int, got bool"),
    ]),
    case("attention_core", "k_win", "float64", TE, "k_win dtype torch.float64 differs from q",
         lambda: attention_core_with(k_win=rand(B, T, H, DK, dtype=torch.float64))),
    case("attention_core", "k_cmp", "too few blocks", VE, "3 compressed blocks, but k_cmp holds 2",
         lambda: attention_core_with(k_cmp=rand(B, 2, H, DK), v_cmp=rand(B, 2, H, DV))),
    case("attention_core", "gates", "[B, T, HQ, 2]", VE, "gates [1, 8, 4, 2] must be [B, T, HQ, 3]",
         lambda: attention_core_with(gates=torch.rand(B, T, HQ, 2))),
    # nsa_func, nsa_varlen_func (nsa_core.functional)
    *arg_cases("nsa_func", [
        ("softmax_scale", SCALE_INF_IN_FLOAT32, VE, f"softmax_scale {IN_FLOAT32}"),
        ("softmax_scale", "x", TE, "softmax_scale must be a float or None, got str"),
        ("window", 0, VE, "window must be >= 1, got 0"),
        ("window", PAST_INT32, VE, "window must be <= 2147483647"),
        ("config", {"window": 3}, TE, "config must be an NSAConfig or None, got dict"),
    ]),
    case("nsa_func", "gates", "float64", TE, "gates dtype torch.float64 differs from q",
         lambda: nsa_func_with(gates=torch.rand(B, T, HQ, 3, dtype=torch.float64))),
    # nsa_with_kvcache (nsa_core.kvcache)
    *arg_cases("nsa_with_kvcache", [
        ("cache_seqlens", [5], TE, "cache_seqlens must be an integer torch.Tensor [B], got list"),
        ("v", None, VE, "k and v go together"),
        ("softmax_scale", SCALE_INF_IN_FLOAT32, VE, f"softmax_scale {IN_FLOAT32}"),
        ("block_table", [[0]], TE, "block_table must be an integer torch.Tensor [B, max_pages]"),
    ]),
    case("nsa_with_kvcache", "cache_seqlens", "float32", TE, "cache_seqlens must hold integers",
         lambda: nsa_with_kvcache_with(cache_seqlens=torch.tensor([5.0]))),
    case("nsa_with_kvcache", "cache_seqlens", "-1", VE, "cache_seqlens[0] must be >= 0, got -1",
         lambda: nsa_with_kvcache_with(cache_seqlens=torch.tensor([-1]))),
    case("nsa_with_kvcache", "cache_seqlens", "full cache", VE,
         "would hold 9 tokens (cache_seqlens 8 + 1 new), more than the cache's 8",
         lambda: nsa_with_kvcache_with(cache_seqlens=torch.tensor([T]))),
    case("nsa_with_kvcache", "k_cache", "float64", TE, "k_cache dtype torch.float64 must be q's",
         lambda: nsa_with_kvcache_with(k_cache=rand(B, T, H, DK, dtype=torch.float64))),
    case("nsa_with_kvcache", "k", "Tn=2", VE, "k [1, 2, 2, 8] must be [B=1, Tn=1, H=2, D=8]",
         lambda: nsa_with_kvcache_with(k=rand(B, 2, H, DK))),
    case("nsa_with_kvcache", "block_table", "page 1 of 1", VE,
         "block_table[0, 0] = 1 names no page of the cache's 1",
         lambda: nsa_with_kvcache_with(block_table=torch.tensor([[1]]))),
    case("nsa_with_kvcache", "q", "no new query", VE, "at least one new query",
         lambda: nsa_with_kvcache_with(q=rand(B, 0, HQ, DK))),
    *arg_cases("nsa_varlen_func", [
        ("softmax_scale", SCALE_INF_IN_FLOAT32, VE, f"softmax_scale {IN_FLOAT32}"),
        ("max_seqlen_q", 2, VE, "max_seqlen_q must be >= the longest sequence, 5, got 2"),
        ("max_seqlen_k", 5.0, TE, "max_seqlen_k must be an int, got float"),
    ]),
    case("nsa_varlen_func", "cu_seqlens_q", "int64", TE, "cu_seqlens_q must be int32",
         lambda: nsa_varlen_func_with(cu_seqlens_q=torch.tensor([0, 3, T]))),
    case("nsa_varlen_func", "cu_seqlens_k", "decreasing", VE,
         "cu_seqlens_k must be non-decreasing, got [0, 6, 4, 8]",
         lambda: nsa_varlen_func_with(cu_seqlens_k=torch.tensor([0, 6, 4, T], dtype=torch.int32))),
    case("nsa_varlen_func", "q", "rank 4", VE, "q must have rank 3 [total_q, HQ, dk]",
         lambda: nsa_varlen_func_with(q=rand(B, T, HQ, DK))),
    # compress_avg, CompressMLP (nsa_core.reference)
    *arg_cases("compress_avg", [
        ("blocks", [1.0], TE, "blocks must be a torch.Tensor [B, N, l, H, D], got list"),
    ]),
    case("compress_avg", "blocks", "rank 4", VE, "blocks must have rank 5 [B, N, l, H, D]",
         lambda: compress_avg_with(blocks=rand(B, N_CMP, H, DK))),
    case("compress_avg", "blocks", "int64", TE, "blocks must be a floating-point tensor",
         lambda: compress_avg_with(blocks=torch.ones(B, N_CMP, L_CMP, H, DK, dtype=torch.int64))),
    *arg_cases("CompressMLP", [
        ("head_dim", 0, VE, "head_dim must be >= 1, got 0"),
        ("cmp_block", 4.0, TE, "cmp_block must be an int, got float 4.0"),
        ("cmp_block", PAST_INT32, VE, "cmp_block must be <= 2147483647"),
    ]),
    case("CompressMLP.forward", "blocks", "int64", TE, "blocks must be a floating-point tensor",
         lambda: compress_mlp_forward(torch.ones(B, N_CMP, L_CMP, H, DK, dtype=torch.int64))),
    case("CompressMLP.forward", "blocks", "float64", TE,
         "blocks dtype torch.float64 differs from phi's parameters' torch.float32",
         lambda: compress_mlp_forward(rand(B, N_CMP, L_CMP, H, DK, dtype=torch.float64))),
    case("CompressMLP.forward", "blocks", "l=2", VE, "blocks [1, 3, 2, 2, 8] must be [B, N, l=4",
         lambda: compress_mlp_forward(rand(B, N_CMP, 2, H, DK))),
    # the helpers of nsa_core.blocks and nsa_core.reads
    *arg_cases("num_cmp_blocks", [
        ("length", -1, VE, "length must be >= 0, got -1"),
        ("length", 8.0, TE, "length must be an int, got float 8.0"),
        ("length", PAST_INT32, VE, "length must be <= 2147483647"),
        ("cmp_stride", 0, VE, "cmp_stride (0) must be >= 1 and divide cmp_block (4)"),
        ("cmp_stride", 3, VE, "cmp_stride (3) must be >= 1 and divide cmp_block (4)"),
    ]),
    *arg_cases("num_sel_blocks", [
        ("length", -5, VE, "length must be >= 0, got -5"),
        ("length", True, TE, "length must be an int, got bool"),
        ("sel_block", 0, VE, "sel_block must be >= 1, got 0"),
        ("sel_block", PAST_INT32, VE, "sel_block must be <= 2147483647"),
    ]),
    *arg_cases("cmp_block_overlap", [
        ("num_cmp", -1, VE, "num_cmp must be >= 0, got -1"),
        ("num_sel", 2.0, TE, "num_sel must be an int, got float 2.0"),
        ("cmp_stride", 0, VE, "cmp_stride (0) must be >= 1 and divide cmp_block (4)"),
        ("sel_block", 5, VE, "cmp_stride (2) must divide sel_block (5)"),
        ("dtype", torch.int64, TE, "dtype must be a floating-point torch.dtype, got torch.int64"),
        ("device", 3.5, TE, "device must be a torch.device, a str or None, got float"),
    ]),
    case("cmp_cu_seqlens", "cu_seqlens", "decreasing", VE,
         "cu_seqlens must be non-decreasing, got [0, 5, 3]",
         lambda: cmp_cu_seqlens_with(cu_seqlens=torch.tensor([0, 5, 3], dtype=torch.int32))),
    case("cmp_cu_seqlens", "cu_seqlens", "start 1", VE, "cu_seqlens must start at 0, got 1",
         lambda: cmp_cu_seqlens_with(cu_seqlens=torch.tensor([1, 5], dtype=torch.int32))),
    case("cmp_cu_seqlens", "cu_seqlens", "int64", TE, "cu_seqlens must be int32, got torch.int64",
         lambda: cmp_cu_seqlens_with(cu_seqlens=torch.tensor([0, 5]))),
    *arg_cases("cmp_cu_seqlens", [
        ("cu_seqlens", [0, 5], TE, "cu_seqlens must be an int32 tensor, got list"),
        ("cmp_stride", 0, VE, "cmp_stride (0) must be >= 1 and divide cmp_block (4)"),
    ]),
    *arg_cases("expected_reads", [
        ("position", -1, VE, "position must be >= 0, got -1"),
        ("position", 2.0, TE, "position must be an int, got float 2.0"),
        ("position", 2**31 - 1, VE, "position must be <= 2147483646"),
        ("config", None, TE, "config must be an NSAConfig, got NoneType"),
    ]),
    *arg_cases("selected_reads", [
        ("position", -3, VE, "position must be >= 0, got -3"),
        ("block_indices", None, TE, "block_indices must be a list or tuple of ints, got NoneType"),
        ("block_indices", [0, -2], VE, "block_indices[1] must be >= -1, got -2"),
        ("block_indices", [0, 1.0], TE, "block_indices[1] must be an int, got float 1.0"),
        ("sel_block", 0, VE, "sel_block must be >= 1, got 0"),
    ]),
    # BranchInputs, DecodeStats (nsa_core.attention)
    case("BranchInputs", "q", "rank 3", VE, "q must have rank 4 [B, T, HQ, dk]",
         lambda: branch_inputs_with(q=rand(B, T, HQ * DK))),
    case("BranchInputs", "k", "a tensor", TE, "k must be a mapping with keys ('cmp', 'sel', 'win')",
         lambda: branch_inputs_with(k=rand(B, T, H, DK))),
    case("BranchInputs", "v", "v['win'] T-1 tokens", VE, "v['win'] [1, 7, 2, 6] must hold q's",
         lambda: branch_inputs_with(v=v_branches(win=rand(B, T - 1, H, DV)))),
    case("BranchInputs", "gates", "[B, T, HQ, 2]", VE, "gates [1, 8, 4, 2] must be [B, T, HQ, 3]",
         lambda: branch_inputs_with(gates=torch.rand(B, T, HQ, 2))),
    case("BranchInputs.tokens", "end", T + 1, VE, "end must be <= 8, got 9",
         lambda: BranchInputs(q_(), kv_branches(), v_branches(), gates_()).tokens(0, T + 1)),
    *arg_cases("DecodeStats", [
        ("position", -1, VE, "position must be >= 0, got -1"),
        ("reads_expected", 2.5, TE, "reads_expected must be an int, got float 2.5"),
    ]),
    case("DecodeStats", "reads_sel", "float32", TE, "reads_sel must hold integer counts",
         lambda: decode_stats_with(reads_sel=torch.ones(B, H))),
    case("DecodeStats", "reads_win", "[B, H+1]", VE, "reads_win [1, 3] differs from reads_cmp",
         lambda: decode_stats_with(reads_win=torch.ones(B, H + 1, dtype=torch.int64))),
    # NSACache made directly, RaggedNSACache
    *arg_cases("NSACache", [
        ("config", None, TE, "config must be an NSAConfig, got NoneType"),
        ("length", -1, VE, "length must be >= 0, got -1"),
        ("length", 5, VE, "length (5 entries) must be <= 4, what the cache holds"),
        ("num_cmp", 1.0, TE, "num_cmp must be an int, got float 1.0"),
    ]),
    case("NSACache", "_v_sel", "float64", TE, "_v_sel dtype torch.float64 differs from _k_sel",
         lambda: cache_with(_v_sel=torch.zeros(B, 4, H, DV, dtype=torch.float64))),
    case("NSACache", "k_win", "H=1", VE, "k_win [1, 0, 1, 8] must be [B=1, n, H=2, D=8]",
         lambda: cache_with(k_win=torch.zeros(B, 0, 1, DK))),
    *arg_cases("RaggedNSACache", [
        ("rows", (), TE, "rows must be a list of NSACache"),
        ("starts", [-1], VE, "starts[0] must be >= 0, got -1"),
        ("starts", [0, 0], VE, "starts must be a list with one column per row (1)"),
        ("starts", (0,), TE, "starts must be a list of int, got tuple"),
    ]),
    case("RaggedNSACache", "rows", "batch 2", VE, "rows[0] must hold one sequence, got batch 2",
         lambda: ragged_with(rows=[NSACache.empty(config(), 2)])),
    # Toggles made directly or from an environment
    *arg_cases("Toggles", [
        ("sel_triton", "yes", TE, "Toggles.sel_triton must be a bool, got 'yes'"),
        ("debug_log_limit", -1, VE, "Toggles.debug_log_limit must be >= 0, got -1"),
        ("sel_triton_min_len", 1.5, TE, "Toggles.sel_triton_min_len must be an int, got 1.5"),
        ("cmp_backend", "tri ton", VE, "Toggles.cmp_backend must be 'auto' or a backend name"),
        ("core_backend", "Reference", VE, "Toggles.core_backend must be 'auto' or a backend"),
    ]),
    case("Toggles", "debug_fa2_dense", "with debug_fa2_varlen", VE,
         "NSA_DEBUG_FA2_VARLEN and NSA_DEBUG_FA2_DENSE are both set",
         lambda: Toggles(debug_fa2_varlen=True, debug_fa2_dense=True)),
    case("Toggles.from_env", "environ", "list", TE, "environ must be a mapping or None, got list",
         lambda: Toggles.from_env(["NSA_SEL_TRITON=1"])),  # type: ignore[arg-type]
    case("Toggles.from_env", "environ", "int value", TE, "environ['NSA_SEL_TRITON'] must be a str",
         lambda: Toggles.from_env({"NSA_SEL_TRITON": 1})),  # type: ignore[dict-item]
    # NSAConfig: sizes past int32's tokens, a phi of another kind
    *arg_cases("NSAConfig", [
        (name, PAST_INT32, VE, f"NSAConfig.{name} must be <= 2147483647 (int32 token positions)")
        for name in ("num_q_heads", "num_kv_heads", "head_dim_qk", "head_dim_v", "cmp_block",
                     "cmp_stride", "sel_block", "num_selected", "window")
    ]),
    *arg_cases("NSAConfig", [
        ("phi", 1, TE, "NSAConfig.phi must be a str, 'avg' or 'mlp', got 1"),
        ("scale", True, TE, "NSAConfig.scale must be a number, got True"),
    ]),
    case("NSAAttention", "hidden_size", PAST_INT32, VE, "hidden_size must be <= 2147483647",
         lambda: NSAAttention(config(), PAST_INT32)),
]
# fmt: on


def test_table_is_large_and_unique() -> None:
    assert len(CASES) >= 60
    ids = [c.id for c in CASES]
    assert len(set(ids)) == len(ids), "every row names a distinct (entry, argument, value)"


def takes_arguments(obj: Callable[..., object]) -> bool:
    """Whether a call of ``obj`` (a function, or a class: its constructor) takes arguments."""
    return bool(inspect.signature(obj).parameters)


def test_every_public_name_that_takes_arguments_has_three_rows() -> None:
    """Each callable in nsa_core.__all__ that takes arguments (a class by its constructor) has
    three rows or more under its own name: a new export without them fails here."""
    rows = Counter(row.entry for row in CASES)
    public = {name: getattr(nsa_core, name) for name in nsa_core.__all__}
    callables = {name: obj for name, obj in public.items() if callable(obj)}
    without_arguments = sorted(name for name, obj in callables.items() if not takes_arguments(obj))
    assert without_arguments == ["get_toggles"], without_arguments
    short = {
        name: rows[name]
        for name, obj in callables.items()
        if takes_arguments(obj) and rows[name] < 3
    }
    assert not short, f"public names with fewer than 3 bad-input rows: {short}"


def run(row: Case, fx: Fixture | None) -> object:
    if row.stateful is not None:
        assert fx is not None
        return row.stateful(fx)
    assert row.call is not None
    return row.call()


@pytest.mark.parametrize("row", CASES, ids=lambda c: c.id)
def test_bad_input_is_refused(row: Case) -> None:
    fx = make_fixture() if row.stateful is not None else None
    # Any other exception type (ZeroDivisionError, AttributeError, ...) escapes and fails.
    with pytest.raises(row.error) as info:
        run(row, fx)
    assert type(info.value) is row.error, f"{type(info.value).__name__}: {info.value}"
    assert row.fragment in str(info.value)
    if fx is not None:
        for cache, before in fx.watched:
            assert same_state(before, logical_state(cache)), "a refused call changed the cache"


def test_decode_error_inside_the_step_leaves_the_cache_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An error past the checks (here from the output projection) rolls the cache back."""
    fx = make_fixture()
    before = logical_state(fx.cache)

    def broken(_: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("projection failed")

    monkeypatch.setattr(fx.layer.o_proj, "forward", broken)
    # PREFILL + 1 tokens complete a compressed block: the step appends a token and a block.
    with pytest.raises(RuntimeError, match="projection failed"):
        decode(fx)
    assert same_state(before, logical_state(fx.cache))
    monkeypatch.undo()
    decode(fx)  # the restored cache still serves the step
    assert fx.cache.length == PREFILL + 1
    assert fx.cache.num_cmp == 2


def test_huge_num_selected_within_the_bound_keeps_n_columns() -> None:
    """n beyond the blocks a sequence holds (but within n * l' <= 2^31 - 1) pads with -1."""
    n = 7
    idx, counts = select_blocks(q_(), k_cmp_(), L_CMP, D_CMP, L_SEL, n)
    assert idx.shape == (B, T, H, n)
    assert bool((idx[..., N_BLOCKS:] == -1).all())
    assert int(counts.max()) == N_BLOCKS
