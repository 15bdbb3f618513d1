"""Every public entry point refuses bad arguments before it changes anything (docs/spec.md).

One row per bad input: the entry point, the argument, the bad value, the exception type and a
fragment of its message (which names the argument and the rule). Rows that touch a decode cache
also check that the cache is exactly as it was (length, num_cmp and every tensor). A row that
reaches ZeroDivisionError, AttributeError, an allocator error or any other exception type fails.
"""

from __future__ import annotations

import copy
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

from nsa_core import (
    NSAAttention,
    NSACache,
    NSAConfig,
    block_scores,
    compress,
    compressed_attention,
    gated_combine,
    nsa_attention,
    select_blocks,
    selected_attention,
    sliding_attention,
    split_blocks,
    topn_blocks,
)

PREFILL = 5  # tokens in the decode cache of the stateful rows
HUGE = 10**9  # would ask the allocator for gigabytes if it were not refused


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
    return call_with(selected_attention, args, (), over)


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
}


def arg_case(entry: str, arg: str, bad: object, error: type[Exception], fragment: str) -> Case:
    """The row whose call is ``entry``'s valid call with ``bad`` passed as ``arg``."""
    return case(entry, arg, bad, error, fragment, lambda: CALL_WITH[entry](**{arg: bad}))


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
]
# fmt: on


def test_table_is_large_and_unique() -> None:
    assert len(CASES) >= 60
    ids = [c.id for c in CASES]
    assert len(set(ids)) == len(ids), "every row names a distinct (entry, argument, value)"


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
