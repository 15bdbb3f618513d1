"""Context-parallel NSA attention (gloo on CPU) against the single-process core.

One spawn per world size (2 and 4 processes) runs every case: each rank computes its rows of
the output and its gradients and saves them; the test unshards them and compares with
:func:`nsa_core.nsa_attention` on the whole sequence, forward and gradients of q, k, v, gates
and phi's parameters, within docs/spec.md's float32 bounds (1e-5, gradients 2e-5). T is never a
multiple of the world size; the cases cover G in {1, 4}, contiguous and zigzag shards, one K/V
shared by the branches or one per branch, the mean and the learned phi, varlen with empty and
cut sequences, chunks shorter than the window and the compressed block (halos that span several
chunks), and both selected-branch exchanges.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nsa_core import CompressMLP, NSAAttention, NSAConfig, nsa_attention
from nsa_core.blocks import num_cmp_blocks
from nsa_core.context_parallel import (
    CommTimer,
    Layout,
    SelExchange,
    ShardPlan,
    context_parallel_layer_forward,
    context_parallel_nsa_attention,
)
from nsa_core.context_parallel.attention import block_layout
from nsa_core.context_parallel.work import Sequences, plan_work

BRANCHES = ("cmp", "sel", "win")
FWD_BOUND = 1e-5  # docs/spec.md, float32 path
GRAD_BOUND = 2e-5
# phi_k's output bias shifts every compressed key of a head by the same vector: each query's
# logits move by one constant and its softmax does not change, so this gradient is exactly zero
# and both sides hold rounding noise, on which a relative error means nothing.
SHIFT_ONLY = ("grad_phi_k.fc2.bias", "grad_param.phi_k.fc2.bias")
# Gradients of weights every rank applies to its own rows: each rank holds its share.
SHARED_WEIGHTS = ("grad_phi", "grad_param.")


@dataclass(frozen=True)
class Case:
    """One comparison: geometry, sharding and what the inputs look like."""

    name: str
    tokens: int
    groups: int
    layout: Layout
    per_branch_kv: bool = False
    phi: str = "avg"
    cu_seqlens: tuple[int, ...] | None = None
    sel_exchange: SelExchange = "all_gather"
    batch: int = 1
    window: int = 8
    repeat: bool = False  # run twice and require bit-equal results
    zero: tuple[str, ...] = ()  # results that are exactly zero (e.g. no compressed block)

    def config(self) -> NSAConfig:
        return NSAConfig(
            num_q_heads=2 * self.groups,
            num_kv_heads=2,
            head_dim_qk=8,
            head_dim_v=4,
            cmp_block=8,
            cmp_stride=4,
            sel_block=8,
            num_selected=4,
            window=self.window,
            phi="mlp" if self.phi == "mlp" else "avg",
        )


CASES = (
    Case("dense-g1-contiguous-shared", 45, 1, "contiguous", batch=2, repeat=True),
    Case("dense-g4-zigzag-branches-mlp", 45, 4, "zigzag", per_branch_kv=True, phi="mlp"),
    Case("dense-g4-zigzag-shared-prefix", 37, 4, "zigzag", sel_exchange="prefix", window=16),
    Case(
        "varlen-g1-zigzag-branches-prefix",
        45,
        1,
        "zigzag",
        per_branch_kv=True,
        cu_seqlens=(0, 3, 20, 20, 31, 45),
        sel_exchange="prefix",
    ),
    Case(
        "varlen-g4-contiguous-shared-mlp",
        45,
        4,
        "contiguous",
        phi="mlp",
        cu_seqlens=(0, 13, 14, 45),
    ),
    # Shorter than one compressed block: no rank owns a block, every rank still exchanges.
    Case(
        "tiny-no-blocks",
        8,
        1,
        "zigzag",
        per_branch_kv=True,
        cu_seqlens=(0, 2, 8),
        zero=("grad_k_cmp", "grad_v_cmp"),
    ),
)
# Run by each pair of a 4-rank world on its own group of two.
SUBGROUP_CASE = Case(
    "subgroup-g4-contiguous-branches-prefix",
    29,
    4,
    "contiguous",
    per_branch_kv=True,
    sel_exchange="prefix",
)
SUBGROUP_SEED = len(CASES)
# A whole NSAAttention layer (per-branch projections, RoPE at each sequence's positions).
LAYER_CASE = Case("layer-varlen-g4-zigzag-mlp", 45, 4, "zigzag", phi="mlp", cu_seqlens=(0, 13, 45))
LAYER_SEED = len(CASES) + 1
HIDDEN = 16


@dataclass
class Inputs:
    q: torch.Tensor
    k: dict[str, torch.Tensor]
    v: dict[str, torch.Tensor]
    gates: torch.Tensor
    grad_out: torch.Tensor
    phi_k: CompressMLP | None
    phi_v: CompressMLP | None


def make_inputs(case: Case, seed: int) -> Inputs:
    """The global inputs of a case, the same in the test process and in every rank."""
    gen = torch.Generator().manual_seed(seed)
    cfg = case.config()
    b, t = case.batch, case.tokens
    hq, h, dk, dv = cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim_qk, cfg.head_dim_v

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    q = rand(b, t, hq, dk)
    if case.per_branch_kv:
        k = {br: rand(b, t, h, dk) for br in BRANCHES}
        v = {br: rand(b, t, h, dv) for br in BRANCHES}
    else:
        k_all, v_all = rand(b, t, h, dk), rand(b, t, h, dv)
        k = dict.fromkeys(BRANCHES, k_all)
        v = dict.fromkeys(BRANCHES, v_all)
    gates = torch.rand(b, t, hq, 3, generator=gen)
    grad_out = rand(b, t, hq, dv)
    phis: list[CompressMLP | None] = [None, None]
    if case.phi == "mlp":
        phis = [CompressMLP(dk, cfg.cmp_block), CompressMLP(dv, cfg.cmp_block)]
        for phi in phis:
            assert phi is not None
            with torch.no_grad():
                for p in phi.parameters():
                    p.copy_(rand(*p.shape) / p.shape[-1] ** 0.5)
    return Inputs(q, k, v, gates, grad_out, phis[0], phis[1])


def leaves(
    case: Case,
    q: torch.Tensor,
    k: dict[str, torch.Tensor],
    v: dict[str, torch.Tensor],
    gates: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """The tensors that take gradients, by name (one k/v when the branches share it)."""
    named = {"q": q, "gates": gates}
    for br in BRANCHES if case.per_branch_kv else ("sel",):
        named[f"k_{br}"] = k[br]
        named[f"v_{br}"] = v[br]
    return named


def gradients(inp: Inputs, named_leaves: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``grad_<name>`` of every named leaf and of phi_k/phi_v's parameters (each must have one)."""
    result = {}
    for name, x in named_leaves.items():
        assert x.grad is not None
        result[f"grad_{name}"] = x.grad
    for name, phi in (("phi_k", inp.phi_k), ("phi_v", inp.phi_v)):
        if phi is not None:
            for pname, p in phi.named_parameters():
                assert p.grad is not None
                result[f"grad_{name}.{pname}"] = p.grad
    return result


def _with_grad(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_()


KV = torch.Tensor | dict[str, torch.Tensor]


def _branch_args(
    case: Case, k: dict[str, torch.Tensor], v: dict[str, torch.Tensor]
) -> tuple[KV, KV]:
    """k/v as the core takes them: one shared tensor, or the per-branch mapping."""
    if case.per_branch_kv:
        return k, v
    return k["sel"], v["sel"]


def run_rank(
    case: Case, seed: int, plan: ShardPlan, group: dist.ProcessGroup | None = None
) -> dict[str, torch.Tensor]:
    """This rank's output rows and gradients for one case, on ``group`` (default: the world)."""
    rank = dist.get_rank(group)
    inp = make_inputs(case, seed)
    q = _with_grad(plan.shard(inp.q, rank))
    gates = _with_grad(plan.shard(inp.gates, rank))
    if case.per_branch_kv:
        k = {br: _with_grad(plan.shard(inp.k[br], rank)) for br in BRANCHES}
        v = {br: _with_grad(plan.shard(inp.v[br], rank)) for br in BRANCHES}
    else:
        k_one, v_one = (
            _with_grad(plan.shard(inp.k["sel"], rank)),
            _with_grad(plan.shard(inp.v["sel"], rank)),
        )
        k, v = dict.fromkeys(BRANCHES, k_one), dict.fromkeys(BRANCHES, v_one)
    cu = None if case.cu_seqlens is None else torch.tensor(case.cu_seqlens, dtype=torch.int32)
    k_arg, v_arg = _branch_args(case, k, v)
    timer = CommTimer()
    out = context_parallel_nsa_attention(
        q,
        k_arg,
        v_arg,
        gates,
        case.config(),
        plan,
        phi_k=inp.phi_k,
        phi_v=inp.phi_v,
        cu_seqlens=cu,
        sel_exchange=case.sel_exchange,
        group=group,
        timer=timer,
    )
    out.backward(plan.shard(inp.grad_out, rank))
    result = {"out": out.detach(), **gradients(inp, leaves(case, q, k, v, gates))}
    # Every exchange ran forward and backward (the timer counts each once per call).
    assert all(timer.calls.get(f"{d}:cmp_blocks_k") == 1 for d in ("fwd", "bwd")), timer.calls
    return result


def make_layer(case: Case, seed: int) -> tuple[NSAAttention, torch.Tensor, torch.Tensor]:
    """The layer (parameters drawn from ``seed``), x [1, T, hidden] and the output gradient."""
    gen = torch.Generator().manual_seed(seed)
    layer = NSAAttention(case.config(), HIDDEN)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    x = torch.randn(1, case.tokens, HIDDEN, generator=gen)
    return layer, x, torch.randn(1, case.tokens, HIDDEN, generator=gen)


def layer_results(layer: NSAAttention, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    result = {"out": y.detach()}
    assert x.grad is not None
    result["grad_x"] = x.grad
    for name, p in layer.named_parameters():
        assert p.grad is not None, name
        result[f"grad_param.{name}"] = p.grad
    return result


def run_layer_rank(case: Case, seed: int, plan: ShardPlan) -> dict[str, torch.Tensor]:
    """This rank's rows of ``layer(x)`` and its gradients (x's rows, its share of the weights')."""
    layer, x, grad_out = make_layer(case, seed)
    rank = dist.get_rank()
    x_local = _with_grad(plan.shard(x, rank))
    cu = None if case.cu_seqlens is None else torch.tensor(case.cu_seqlens, dtype=torch.int32)
    y = context_parallel_layer_forward(layer, x_local, plan, cu_seqlens=cu)
    y.backward(plan.shard(grad_out, rank))
    return layer_results(layer, x_local, y)


def reference_layer(case: Case, seed: int) -> dict[str, torch.Tensor]:
    layer, x, grad_out = make_layer(case, seed)
    x = _with_grad(x)
    cu = None if case.cu_seqlens is None else torch.tensor(case.cu_seqlens, dtype=torch.int32)
    y = layer(x, cu)
    y.backward(grad_out)
    return layer_results(layer, x, y)


def worker(rank: int, world: int, store_path: str, out_dir: str) -> None:
    """One rank: every case, its results saved under ``out_dir``."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_path, world),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        for index, case in enumerate(CASES):
            plan = ShardPlan(case.tokens, world, case.layout)
            result = run_rank(case, index, plan)
            if case.repeat:
                again = run_rank(case, index, plan)
                result["repeat_equal"] = torch.tensor(
                    all(torch.equal(result[n], again[n]) for n in result)
                )
            torch.save(result, os.path.join(out_dir, f"{case.name}-{rank}.pt"))
        plan = ShardPlan(LAYER_CASE.tokens, world, LAYER_CASE.layout)
        result = run_layer_rank(LAYER_CASE, LAYER_SEED, plan)
        torch.save(result, os.path.join(out_dir, f"{LAYER_CASE.name}-{rank}.pt"))
        if world == 4:
            # Two groups of two side by side: point-to-point peers are group ranks, not world
            # ranks, and the two groups must not see each other's messages.
            pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
            plan = ShardPlan(SUBGROUP_CASE.tokens, 2, SUBGROUP_CASE.layout)
            result = run_rank(SUBGROUP_CASE, SUBGROUP_SEED, plan, pairs[rank // 2])
            torch.save(result, os.path.join(out_dir, f"{SUBGROUP_CASE.name}-{rank}.pt"))
    finally:
        dist.destroy_process_group()


def reference(case: Case, seed: int) -> dict[str, torch.Tensor]:
    """Single-process output and gradients of the whole sequence."""
    inp = make_inputs(case, seed)
    q, gates = _with_grad(inp.q), _with_grad(inp.gates)
    if case.per_branch_kv:
        k = {br: _with_grad(inp.k[br]) for br in BRANCHES}
        v = {br: _with_grad(inp.v[br]) for br in BRANCHES}
    else:
        k_one, v_one = _with_grad(inp.k["sel"]), _with_grad(inp.v["sel"])
        k, v = dict.fromkeys(BRANCHES, k_one), dict.fromkeys(BRANCHES, v_one)
    cu = None if case.cu_seqlens is None else torch.tensor(case.cu_seqlens, dtype=torch.int32)
    k_arg, v_arg = _branch_args(case, k, v)
    out = nsa_attention(
        q,
        k_arg,
        v_arg,
        gates,
        case.config(),
        phi_k=inp.phi_k,
        phi_v=inp.phi_v,
        cu_seqlens=cu,
    )
    out.backward(inp.grad_out)
    result = {"out": out.detach(), **gradients(inp, leaves(case, q, k, v, gates))}
    return result


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).norm() / ref.norm())


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_equals_single_process(world: int, tmp_path: Path) -> None:
    mp.spawn(
        worker,
        args=(world, str(tmp_path / "store"), str(tmp_path)),
        nprocs=world,
        join=True,
    )
    for index, case in enumerate(CASES):
        parts = [torch.load(tmp_path / f"{case.name}-{r}.pt") for r in range(world)]
        check_against_reference(case, index, parts, f"{case.name} W={world}")
    parts = [torch.load(tmp_path / f"{LAYER_CASE.name}-{r}.pt") for r in range(world)]
    check_against_reference(
        LAYER_CASE, LAYER_SEED, parts, f"{LAYER_CASE.name} W={world}", reference_layer
    )
    if world == 4:
        parts = [torch.load(tmp_path / f"{SUBGROUP_CASE.name}-{r}.pt") for r in range(4)]
        for pair in (parts[:2], parts[2:]):
            check_against_reference(SUBGROUP_CASE, SUBGROUP_SEED, pair, SUBGROUP_CASE.name)


def check_against_reference(
    case: Case,
    seed: int,
    parts: list[dict[str, torch.Tensor]],
    label: str,
    single_process: Callable[[Case, int], dict[str, torch.Tensor]] | None = None,
) -> None:
    """The ranks' results ``parts`` (in rank order) against the single-process ones."""
    plan = ShardPlan(case.tokens, len(parts), case.layout)
    ref = (single_process or reference)(case, seed)
    for name, expected in ref.items():
        where = f"{label}: {name}"
        if name in SHIFT_ONLY:
            # Exactly zero (see SHIFT_ONLY): the ranks' shares must cancel to rounding.
            shares = [p[name] for p in parts]
            scale = sum(float(x.norm()) for x in shares)
            residue = float(sum(shares, torch.zeros_like(expected)).norm())
            assert residue <= GRAD_BOUND * scale, f"{where}: {residue:.2e} of {scale:.2e}"
            continue
        if name.startswith(SHARED_WEIGHTS):
            # Each rank holds its share of the weights' gradient: the group's sum is the whole.
            got = sum((p[name] for p in parts), torch.zeros_like(expected))
        else:
            got = plan.unshard([p[name] for p in parts])
        if name in case.zero:
            assert not expected.any(), f"{where}: the reference is not zero"
            assert not got.any(), f"{where} must be exactly zero"
            continue
        assert expected.norm() > 0, f"{where} is all zero, the check is empty"
        bound = FWD_BOUND if name == "out" else GRAD_BOUND
        err = rel_err(got, expected)
        assert err <= bound, f"{where} rel err {err:.2e} > {bound:.0e}"
    if case.repeat:
        assert all(bool(p["repeat_equal"]) for p in parts), f"{label}: not bit-reproducible"


# ------------------------------------------------------------------------ plan and work (no ranks)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize(("tokens", "world"), [(45, 2), (45, 4), (8, 4), (1001, 3)])
def test_plan_tiles_the_sequence(layout: Layout, tokens: int, world: int) -> None:
    plan = ShardPlan(tokens, world, layout)
    chunks = plan.chunks()
    assert chunks[0].start == 0
    assert chunks[-1].end == tokens
    assert all(a.end == b.start for a, b in itertools.pairwise(chunks))
    lengths = [c.length for c in chunks]
    assert max(lengths) - min(lengths) <= 1
    assert min(lengths) >= 1
    if layout == "zigzag":
        for r in range(world):
            assert [c.index for c in plan.chunks_of(r)] == [r, 2 * world - 1 - r]
    x = torch.arange(2 * tokens).view(2, tokens)
    parts = [plan.shard(x, r) for r in range(world)]
    assert sum(p.shape[1] for p in parts) == tokens
    assert torch.equal(plan.unshard(parts), x)
    for r in range(world):
        assert torch.equal(plan.positions(r), plan.shard(torch.arange(tokens)[None], r)[0])


def test_plan_refuses_empty_chunks() -> None:
    with pytest.raises(ValueError, match="total_tokens"):
        ShardPlan(7, 4, "zigzag")
    with pytest.raises(ValueError, match="layout"):
        ShardPlan(64, 2, "striped")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="world_size"):
        ShardPlan(64, 2.0, "zigzag")  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("cu", [None, (0, 3, 20, 20, 31, 45), (0, 45)])
def test_owned_blocks_tile_and_halos_are_bounded(
    layout: Layout, cu: tuple[int, ...] | None
) -> None:
    config = CASES[0].config()
    bounds = (0, 45) if cu is None else cu
    seqs = Sequences.build(bounds, config, varlen=cu is not None)
    plan = ShardPlan(45, 4, layout)
    works = plan_work(plan, seqs, config)
    layout_blocks = block_layout(works, plan.world_size)
    expected = sum(
        num_cmp_blocks(b - a, config.cmp_block, config.cmp_stride)
        for a, b in itertools.pairwise(bounds)
    )
    assert layout_blocks.total == expected == seqs.cmp_bounds[-1]
    for work in works:
        s = work.chunk.start
        assert s - work.win_halo_start <= config.window - 1
        if work.owned_blocks[1] > work.owned_blocks[0]:
            assert s - work.cmp_raw_start <= config.cmp_block - 1
        rows = [(seg.start, seg.end) for seg in work.segments]
        assert rows[0][0] == s
        assert rows[-1][1] == work.chunk.end
        assert all(a[1] == b[0] for a, b in itertools.pairwise(rows))


# ---------------------------------------------------------------- one process: W = 1 and bad input


@pytest.fixture
def single_rank_group(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store1"), 1), rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def test_one_rank_equals_single_process(single_rank_group: None) -> None:
    case = CASES[3]
    ref = reference(case, 3)
    got = run_rank(case, 3, ShardPlan(case.tokens, 1, "zigzag"))
    for name, expected in ref.items():
        if name in SHIFT_ONLY:
            continue  # exactly zero: see SHIFT_ONLY
        bound = FWD_BOUND if name == "out" else GRAD_BOUND
        assert rel_err(got[name], expected) <= bound, name


def test_bad_arguments(single_rank_group: None) -> None:
    case = CASES[0]
    inp = make_inputs(case, 0)
    cfg = case.config()
    args = (inp.q, inp.k["sel"], inp.v["sel"], inp.gates, cfg)
    with pytest.raises(TypeError, match="plan must be a ShardPlan"):
        context_parallel_nsa_attention(*args, (45, 1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="plan is for 2 ranks"):
        context_parallel_nsa_attention(*args, ShardPlan(45, 2))
    with pytest.raises(ValueError, match="must hold rank 0's 44 tokens"):
        context_parallel_nsa_attention(*args, ShardPlan(44, 1))
    with pytest.raises(ValueError, match="sel_exchange"):
        context_parallel_nsa_attention(*args, ShardPlan(45, 1), sel_exchange="ring")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cu_seqlens must end at T=45"):
        context_parallel_nsa_attention(
            inp.q[:1],
            inp.k["sel"][:1],
            inp.v["sel"][:1],
            inp.gates[:1],
            cfg,
            ShardPlan(45, 1),
            cu_seqlens=torch.tensor([0, 40], dtype=torch.int32),
        )


# ---------------------------------------------------------------- the same errors as one process


def raised(call: Callable[[], object]) -> TypeError | ValueError:
    """The TypeError or ValueError ``call`` raises (any other outcome fails the test)."""
    with pytest.raises((TypeError, ValueError)) as info:
        call()
    return info.value


def same_error(single: Exception, sharded: Exception) -> None:
    """The same exception type with the same message."""
    assert type(sharded) is type(single), (sharded, single)
    assert str(sharded) == str(single)


# Bad layer inputs: x against a float32 layer of HIDDEN, T = 45 tokens on one rank.
LAYER_INPUTS = {
    "float64": torch.zeros(1, 45, HIDDEN, dtype=torch.float64),
    "bfloat16": torch.zeros(1, 45, HIDDEN, dtype=torch.bfloat16),
    "rank 2": torch.zeros(45, HIDDEN),
    "hidden 15": torch.zeros(1, 45, HIDDEN - 1),
    "meta": torch.zeros(1, 45, HIDDEN, device="meta"),
}


@pytest.mark.parametrize("bad", list(LAYER_INPUTS))
def test_the_layer_entry_refuses_x_as_the_layer_does(single_rank_group: None, bad: str) -> None:
    layer = NSAAttention(CASES[0].config(), HIDDEN)
    x = LAYER_INPUTS[bad]
    single = raised(lambda: layer(x))
    same_error(single, raised(lambda: context_parallel_layer_forward(layer, x, ShardPlan(45, 1))))


@pytest.mark.parametrize("number", ["scale", "rope_theta"])
def test_the_layer_entry_refuses_config_numbers_as_the_layer_does(
    single_rank_group: None, number: str
) -> None:
    """1e39 is not finite in float32, the layer's compute dtype (docs/spec.md)."""
    layer = NSAAttention(dataclasses.replace(CASES[0].config(), **{number: 1e39}), HIDDEN)
    x = torch.zeros(1, 45, HIDDEN)
    single = raised(lambda: layer(x))
    assert f"config.{number} must be finite and > 0 in torch.float32" in str(single)
    same_error(single, raised(lambda: context_parallel_layer_forward(layer, x, ShardPlan(45, 1))))


def core_call_with(case: Case = CASES[1], **over: Any) -> dict[str, Any]:
    """The arguments of one core call on ``case``'s inputs (CASES[1]: per-branch k and v and a
    learned phi), some replaced by ``over``."""
    inp = make_inputs(case, 0)
    args: dict[str, Any] = {
        "q": inp.q, "k": inp.k, "v": inp.v, "gates": inp.gates, "config": case.config(),
        "phi_k": inp.phi_k, "phi_v": inp.phi_v,
    }  # fmt: skip
    return args | over


def core_bad_inputs() -> dict[str, dict[str, Any]]:
    case = CASES[1]
    inp = make_inputs(case, 0)
    cfg = case.config()
    return {
        "k['win'] float64": core_call_with(k=inp.k | {"win": inp.k["win"].double()}),
        "gates [B, T, HQ, 2]": core_call_with(gates=inp.gates[..., :2]),
        "config heads": core_call_with(config=dataclasses.replace(cfg, num_q_heads=2)),
        "config None": core_call_with(config=None),
        "config scale": core_call_with(config=dataclasses.replace(cfg, scale=1e39)),
        "q int64": core_call_with(q=inp.q.to(torch.int64)),
        "phi_k str": core_call_with(phi_k="avg"),
    }


@pytest.mark.parametrize("bad", list(core_bad_inputs()))
def test_the_core_entry_refuses_inputs_as_nsa_attention_does(
    single_rank_group: None, bad: str
) -> None:
    args = core_bad_inputs()[bad]
    single = raised(lambda: nsa_attention(**args))
    sharded = raised(lambda: context_parallel_nsa_attention(**args, plan=ShardPlan(45, 1)))
    same_error(single, sharded)


def test_both_entries_refuse_a_missing_process_group_alike() -> None:
    """Without torch.distributed initialized, group=None names no group: both entries say so
    with one ValueError, before any collective."""
    assert not dist.is_initialized()
    case = CASES[0]
    layer = NSAAttention(case.config(), HIDDEN)
    args = core_call_with(case)
    core = raised(lambda: context_parallel_nsa_attention(**args, plan=ShardPlan(45, 1)))
    x = torch.zeros(2, 45, HIDDEN)
    layer_error = raised(lambda: context_parallel_layer_forward(layer, x, ShardPlan(45, 1)))
    same_error(core, layer_error)
    assert "group needs an initialized torch.distributed" in str(core)


def test_both_entries_refuse_a_group_of_another_kind(single_rank_group: None) -> None:
    case = CASES[0]
    inp = make_inputs(case, 0)
    plan = ShardPlan(45, 1)
    core = raised(
        lambda: context_parallel_nsa_attention(
            inp.q,
            inp.k,
            inp.v,
            inp.gates,
            case.config(),
            plan,
            group="world",  # type: ignore[arg-type]
        )
    )
    layer = NSAAttention(case.config(), HIDDEN)
    x = torch.zeros(2, 45, HIDDEN)
    layer_error = raised(
        lambda: context_parallel_layer_forward(layer, x, plan, group="world")  # type: ignore[arg-type]
    )
    same_error(core, layer_error)
    assert "group must be a torch.distributed.ProcessGroup or None, got str" in str(core)
