"""NSAAttention: one Native Sparse Attention layer with prefill and KV-cached decode."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Concatenate, ParamSpec, TypeVar, overload

import torch
from torch import nn

from nsa_core import ops
from nsa_core.block_math import cmp_cu_seqlens, num_cmp_blocks
from nsa_core.cache import NSACache
from nsa_core.checks import (
    check_attention_args,
    check_branch_inputs,
    check_config,
    check_config_numbers,
    check_cu_seqlens,
    check_decode_stats,
    check_int,
    check_layer_input,
    check_rank,
    per_head_context,
    shape,
)
from nsa_core.config import NSAConfig
from nsa_core.core import check_heads_and_gates, run_attention_core
from nsa_core.limits import MAX_TOKENS
from nsa_core.padding import TokenLayout, check_attention_mask, check_position_ids
from nsa_core.ragged_cache import RaggedNSACache
from nsa_core.reads import expected_reads
from nsa_core.reference.compress import CompressMLP, compress, compress_impl
from nsa_core.reference.compressed_attention import cmp_visible
from nsa_core.reference.selected_attention import selected_visibility
from nsa_core.registry import resolve_fn
from nsa_core.toggles import get_toggles
from nsa_core.tracing import TraceConstant, compiling, nonstrict_region

BRANCHES = ("cmp", "sel", "win")

_P = ParamSpec("_P")
_R = TypeVar("_R")


@dataclass
class BranchInputs:
    """Projected inputs of the three branches for T tokens.

    q [B, T, HQ, dk] and every key are rotated by token position; values are not.
    ``k["cmp"]``/``v["cmp"]`` are the raw (uncompressed) compressed-branch keys and values.
    gates [B, T, HQ, 3] in (0, 1), ordered (cmp, sel, win).
    """

    q: torch.Tensor
    k: dict[str, torch.Tensor]
    v: dict[str, torch.Tensor]
    gates: torch.Tensor

    def __post_init__(self) -> None:
        check_branch_inputs(self.q, self.k, self.v, self.gates, BRANCHES)

    def tokens(self, start: int, end: int) -> BranchInputs:
        """The inputs of tokens [start, end) alone, 0 <= start <= end <= T."""
        t = self.q.shape[1]
        check_int("end", end, check_int("start", start, 0, t), t)
        return BranchInputs(
            q=self.q[:, start:end],
            k={b: k[:, start:end] for b, k in self.k.items()},
            v={b: v[:, start:end] for b, v in self.v.items()},
            gates=self.gates[:, start:end],
        )


@dataclass
class DecodeStats:
    """What one decode step at ``position`` read, per sequence and kv head ([B, H] each).

    ``reads_*`` count the key/value tokens each branch actually gathered; ``reads_expected`` is
    docs/spec.md's formula for that position.
    """

    position: int
    reads_cmp: torch.Tensor
    reads_sel: torch.Tensor
    reads_win: torch.Tensor
    reads_expected: int

    def __post_init__(self) -> None:
        reads = (
            ("reads_cmp", self.reads_cmp),
            ("reads_sel", self.reads_sel),
            ("reads_win", self.reads_win),
        )
        check_decode_stats(self.position, reads, self.reads_expected)

    @property
    def reads_actual(self) -> torch.Tensor:
        """[B, H] total tokens read by the step."""
        return self.reads_cmp + self.reads_sel + self.reads_win


def positions_of(
    batch_t: int, cu_seqlens: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """[T] token positions; with cu_seqlens they restart at 0 in each packed sequence."""
    positions = torch.arange(batch_t, device=device)
    if cu_seqlens is None:
        return positions
    starts = cu_seqlens[:-1].to(torch.int64)
    seq = torch.bucketize(positions, cu_seqlens[1:].to(torch.int64), right=True)
    return positions - starts[seq.clamp_max(starts.numel() - 1)]


def branch_outputs(
    config: NSAConfig,
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    k_sel: torch.Tensor,
    v_sel: torch.Tensor,
    k_win: torch.Tensor,
    v_win: torch.Tensor,
    *,
    q_start: int = 0,
    win_start: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """o_cmp, o_sel, o_win [B, Tq, HQ, dv] and the block indices [B, Tq, H, n] used: the step ops
    one by one, for a caller that needs the branches apart (the decode step and its statistics;
    the gated output is :func:`nsa_core.core.attention_core`).

    q [B, Tq, HQ, dk] at positions ``q_start + r``; k_sel/v_sel hold every token from 0;
    k_win/v_win hold tokens from position ``q_start - win_start`` on (default: from 0).
    Block scoring takes the compressed branch's log-sum-exp when its backend yields one
    (:func:`nsa_core.ops.compressed_attention_with_lse`), detached. The ops compute in q's dtype
    also under ``torch.autocast``, as the attention core does.
    """
    with torch.autocast(q.device.type, enabled=False):
        o_cmp, indices = _compressed_and_indices(
            config, q, k_cmp, v_cmp, q_start=q_start, cu_seqlens=cu_seqlens
        )
        o_sel = ops.selected_attention(
            q, k_sel, v_sel, indices, config.sel_block, config.softmax_scale,
            q_start=q_start, cu_seqlens=cu_seqlens,
        )  # fmt: skip
        o_win = _sliding(config, q, k_win, v_win, q_start, win_start, cu_seqlens)
    return o_cmp, o_sel, o_win, indices


def _compressed_and_indices(
    config: NSAConfig,
    q: torch.Tensor,
    k_cmp: torch.Tensor,
    v_cmp: torch.Tensor,
    *,
    q_start: int,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """o_cmp [B, Tq, HQ, dv] and the selected block indices [B, Tq, H, n]."""
    cfg = config
    # The compressed branch runs first: where its backend yields the softmax's log-sum-exp,
    # block scoring reuses it instead of recomputing the normaliser (same q, k_cmp and scale).
    o_cmp, lse = ops.compressed_attention_with_lse(
        q, k_cmp, v_cmp, cfg.cmp_block, cfg.cmp_stride, cfg.softmax_scale, q_start=q_start,
        cu_seqlens=cu_seqlens,
    )  # fmt: skip
    indices, _ = ops.select_blocks(
        q, k_cmp, cfg.cmp_block, cfg.cmp_stride, cfg.sel_block, cfg.num_selected,
        cfg.softmax_scale, q_start=q_start, cu_seqlens=cu_seqlens, lse=lse,
    )  # fmt: skip
    return o_cmp, indices


def _sliding(
    config: NSAConfig,
    q: torch.Tensor,
    k_win: torch.Tensor,
    v_win: torch.Tensor,
    q_start: int,
    win_start: int | None,
    cu_seqlens: torch.Tensor | None,
) -> torch.Tensor:
    """o_win [B, Tq, HQ, dv] (``win_start`` as :func:`branch_outputs` takes it)."""
    return ops.sliding_attention(
        q,
        k_win,
        v_win,
        config.window,
        config.softmax_scale,
        q_start=q_start if win_start is None else win_start,
        cu_seqlens=cu_seqlens,
    )


def run_apply_rope(x: torch.Tensor, positions: torch.Tensor, config: NSAConfig) -> torch.Tensor:
    """x [B, T, H, D] rotated at ``positions`` with ``config.rope_theta``, on arguments the layer
    made itself (its projections at its positions): one resolution, no checks. Under
    torch.compile, a non-strict region (:mod:`nsa_core.tracing`)."""
    if compiling():
        return _rope_region(x, positions, config.trace_constant)
    return _rope(x, positions, config.rope_theta)


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    toggles = get_toggles()
    rope = resolve_fn("apply_rope", per_head_context(x), toggles)
    out: torch.Tensor = rope(x, positions, theta, toggles=toggles)
    return out


@nonstrict_region
def _rope_region(
    x: torch.Tensor, positions: torch.Tensor, config: TraceConstant[NSAConfig]
) -> torch.Tensor:
    return _rope(x, positions, config.value.rope_theta)


def _with_layer_config(
    fn: Callable[Concatenate[NSAConfig, _P], _R],
) -> Callable[Concatenate[NSAAttention, _P], _R]:
    """``fn`` as a method of the layer: the layer's config is its first argument."""

    def method(layer: NSAAttention, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        return fn(layer.config, *args, **kwargs)

    method.__name__ = fn.__name__
    method.__doc__ = f":func:`{fn.__name__}` with this layer's config."
    return method


def branch_parts(
    k: object, v: object, names: tuple[str, str] = ("k", "v")
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """k and v per branch: one tensor shared by the three, or a mapping with their names (the
    tensors themselves unchecked). ``names`` are the arguments' names in the error."""
    parts: list[dict[str, torch.Tensor]] = []
    for name, given in zip(names, (k, v), strict=True):
        if isinstance(given, torch.Tensor):
            parts.append(dict.fromkeys(BRANCHES, given))
        elif isinstance(given, Mapping) and set(given) == set(BRANCHES):
            parts.append(dict(given))
        else:
            raise TypeError(
                f"{name} must be a tensor or a mapping with keys {BRANCHES}, "
                f"got {type(given).__name__}"
            )
    return parts[0], parts[1]


def check_nsa_attention(
    q: torch.Tensor,
    k: object,
    v: object,
    gates: torch.Tensor,
    config: object,
    phi_k: object,
    phi_v: object,
    cu_seqlens: torch.Tensor | None,
    *,
    chunked: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Every rule of :func:`nsa_attention`; -> the per-branch keys and values.

    ``chunked``: the keys may hold more tokens than q, the same Tk >= Tq in every branch, q being
    the last Tq of them (:func:`nsa_core.functional.nsa_func`).
    """
    config = check_config(config)
    ks, vs = branch_parts(k, v)
    check_rank("q", q, 4, "[B, T, HQ, dk]")
    first = BRANCHES[0]
    for b in BRANCHES:
        check_attention_args(q, ks[b], vs[b], k_name=f"k[{b!r}]", v_name=f"v[{b!r}]")
        if not chunked and ks[b].shape[1] != q.shape[1]:
            raise ValueError(f"k[{b!r}] {shape(ks[b])} must hold q's {q.shape[1]} tokens")
        if chunked and ks[b].shape[1] != ks[first].shape[1]:
            raise ValueError(
                f"k[{b!r}] {shape(ks[b])} must hold as many tokens as k[{first!r}] "
                f"{shape(ks[first])}"
            )
    if chunked and ks[first].shape[1] < q.shape[1]:
        raise ValueError(
            f"q {shape(q)} holds more tokens than k {shape(ks[first])}: the queries are the "
            "last Tq positions of the keys, so Tq <= Tk"
        )
    check_heads_and_gates(q, ks["sel"], vs["sel"], gates, config)
    check_config_numbers(config, q.dtype)
    for name, phi in (("phi_k", phi_k), ("phi_v", phi_v)):
        if phi is not None and not isinstance(phi, nn.Module):
            raise TypeError(f"{name} must be a torch.nn.Module or None, got {type(phi).__name__}")
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, q.shape[1], q.shape[0], q.device)
    return ks, vs


def nsa_attention(
    q: torch.Tensor,
    k: torch.Tensor | Mapping[str, torch.Tensor],
    v: torch.Tensor | Mapping[str, torch.Tensor],
    gates: torch.Tensor,
    config: NSAConfig,
    *,
    phi_k: nn.Module | None = None,
    phi_v: nn.Module | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """The NSA attention core: compress, select, the three branches and the gated combine.

    Args:
        q: [B, T, HQ, dk], rotated.
        k, v: [B, T, H, dk] and [B, T, H, dv] shared by the three branches (the spec's allowed
            special case), or mappings ``{"cmp": ..., "sel": ..., "win": ...}`` of them.
        gates: [B, T, HQ, 3] in (0, 1), ordered (cmp, sel, win).
        config: the NSA geometry (l, d, l', n, w, scale); its head counts must match q and k.
        phi_k, phi_v: learned compression (``CompressMLP``); None means the mean.
        cu_seqlens: int32 [S+1] for packed sequences (B == 1).

    Returns:
        o [B, T, HQ, dv]. The arguments are validated once; compression runs here, the rest is
        the attention core (:func:`nsa_core.core.attention_core`) on the backend the registry
        picks for it.
    """
    ks, vs = check_nsa_attention(q, k, v, gates, config, phi_k, phi_v, cu_seqlens)
    l_cmp, d = config.cmp_block, config.cmp_stride
    k_cmp = compress_impl(ks["cmp"], l_cmp, d, phi_k, cu_seqlens=cu_seqlens)
    v_cmp = compress_impl(vs["cmp"], l_cmp, d, phi_v, cu_seqlens=cu_seqlens)
    return run_attention_core(
        q, k_cmp, v_cmp, ks["sel"], vs["sel"], ks["win"], vs["win"], gates, config,
        cu_seqlens=cu_seqlens,
    )  # fmt: skip


class NSAAttention(nn.Module):
    """Native Sparse Attention over hidden states x [B, T, hidden_size].

    Projections: q (HQ*dk), per branch k (H*dk) and v (H*dv), a gate MLP (hidden -> hidden ->
    3*HQ, GELU, sigmoid) and the output projection (HQ*dv -> hidden). With ``config.phi ==
    "mlp"`` the compressed branch learns ``phi_k`` and ``phi_v``; otherwise phi is the mean.
    Each attention op goes through nsa_core's backend registry (the reference unless a faster
    backend accepts the call).

    Mixed precision: under ``torch.autocast`` the learned parts (projections, gate MLP, phi, the
    output projection) run as autocast casts them, and everything between the projections and
    the output projection (RoPE, compression, the attention ops, the decode cache) computes in
    :meth:`compute_dtype` (docs/spec.md, "Decode").
    """

    def __init__(self, config: NSAConfig, hidden_size: int, *, bias: bool = False) -> None:
        check_config(config)
        check_int("hidden_size", hidden_size, 1, MAX_TOKENS)
        if not isinstance(bias, bool):
            raise TypeError(f"bias must be a bool, got {type(bias).__name__}")
        super().__init__()
        self.config = config
        self.hidden_size = hidden_size
        hq, h = config.num_q_heads, config.num_kv_heads
        dk, dv = config.head_dim_qk, config.head_dim_v
        self.q_proj = nn.Linear(hidden_size, hq * dk, bias=bias)
        self.k_proj = nn.ModuleDict(
            {b: nn.Linear(hidden_size, h * dk, bias=bias) for b in BRANCHES}
        )
        self.v_proj = nn.ModuleDict(
            {b: nn.Linear(hidden_size, h * dv, bias=bias) for b in BRANCHES}
        )
        self.gate = nn.Sequential(
            nn.Linear(hidden_size, hidden_size), nn.GELU(), nn.Linear(hidden_size, 3 * hq)
        )
        self.o_proj = nn.Linear(hq * dv, hidden_size, bias=bias)
        self.phi_k: CompressMLP | None = None
        self.phi_v: CompressMLP | None = None
        if config.phi == "mlp":
            self.phi_k = CompressMLP(dk, config.cmp_block)
            self.phi_v = CompressMLP(dv, config.cmp_block)

    # ----------------------------------------------------------------------------- pieces

    def branch_inputs(self, x: torch.Tensor, positions: torch.Tensor) -> BranchInputs:
        """Project x [B, T, hidden] at RoPE ``positions`` [T] or [B | 1, T] into q, per-branch
        k/v and gates."""
        cfg = self.config
        batch, t, _ = x.shape
        hq, h = cfg.num_q_heads, cfg.num_kv_heads

        def rotate(y: torch.Tensor) -> torch.Tensor:
            return run_apply_rope(y, positions, cfg)

        q = rotate(self.q_proj(x).view(batch, t, hq, cfg.head_dim_qk))
        k = {b: rotate(self.k_proj[b](x).view(batch, t, h, cfg.head_dim_qk)) for b in BRANCHES}
        v = {b: self.v_proj[b](x).view(batch, t, h, cfg.head_dim_v) for b in BRANCHES}
        gates = torch.sigmoid(self.gate(x)).view(batch, t, hq, 3)
        return BranchInputs(q=q, k=k, v=v, gates=gates)

    def compress_kv(
        self, k_raw: torch.Tensor, v_raw: torch.Tensor, cu_seqlens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """phi over every complete block.

        k_raw [B, T, H, dk], v_raw [B, T, H, dv] -> k_cmp [B, N, H, dk], v_cmp [B, N, H, dv].
        """
        cfg = self.config
        k_cmp = compress(k_raw, cfg.cmp_block, cfg.cmp_stride, self.phi_k, cu_seqlens=cu_seqlens)
        v_cmp = compress(v_raw, cfg.cmp_block, cfg.cmp_stride, self.phi_v, cu_seqlens=cu_seqlens)
        return k_cmp, v_cmp

    def _attend(
        self, inp: BranchInputs, cu_seqlens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """o [B, T, HQ, dv] of the validated layer inputs, and the compressed k and v.

        The inputs come from the layer's own projections of a checked x: compression and the
        attention core run unchecked (:func:`nsa_core.core.run_attention_core`).
        """
        cfg = self.config
        l_cmp, d = cfg.cmp_block, cfg.cmp_stride
        k_cmp = compress_impl(inp.k["cmp"], l_cmp, d, self.phi_k, cu_seqlens=cu_seqlens)
        v_cmp = compress_impl(inp.v["cmp"], l_cmp, d, self.phi_v, cu_seqlens=cu_seqlens)
        o = run_attention_core(
            inp.q, k_cmp, v_cmp, inp.k["sel"], inp.v["sel"], inp.k["win"], inp.v["win"],
            inp.gates, cfg, cu_seqlens=cu_seqlens,
        )  # fmt: skip
        return o, k_cmp, v_cmp

    branch_outputs = _with_layer_config(branch_outputs)

    # ----------------------------------------------------------------------------- entry points

    def compute_dtype(self) -> torch.dtype:
        """The dtype the layer computes q, k, v, the gates and attention in, and its cache holds:
        autocast's dtype where autocast is on for the layer's device type, the layer's dtype
        otherwise (docs/spec.md, "Decode"). A float64 layer stays float64: autocast leaves
        float64 tensors as they are.
        """
        w = self.q_proj.weight
        if w.dtype != torch.float64 and torch.is_autocast_enabled(w.device.type):
            return torch.get_autocast_dtype(w.device.type)
        return w.dtype

    def check_input(self, x: torch.Tensor) -> None:
        """The checks of x [B, T, hidden] that forward, prefill, decode and the context-parallel
        forward run first: its shape, dtype and device, and the config's scale and rope_theta
        in the dtype the layer computes in (docs/spec.md, "Argument rules")."""
        compute = self.compute_dtype()
        check_layer_input(x, self.hidden_size, self.q_proj.weight, compute)
        check_config_numbers(self.config, compute)

    def _tokens_to_run(
        self,
        x: torch.Tensor,
        cu_seqlens: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, TokenLayout | None]:
        """Check a call's arguments; -> the tokens to run [B', T', hidden], their cu_seqlens, their
        RoPE positions [T'] or [B' | 1, T'], and the layout to scatter the output back with.

        With a mask the real tokens run packed, one sequence per row (B' = 1); block geometry
        follows each token's index within its own sequence, whatever its RoPE position.
        """
        self.check_input(x)
        layout = None
        if attention_mask is not None:
            if cu_seqlens is not None:
                raise ValueError(
                    "attention_mask and cu_seqlens both mark sequences: pass one of them"
                )
            layout = check_attention_mask(attention_mask, x)
        elif cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens, x.shape[1], x.shape[0], x.device)
        positions = None
        if position_ids is not None:
            positions = check_position_ids(position_ids, x, layout)
        if layout is not None:
            if positions is not None:
                positions = layout.pack(positions.expand(x.shape[0], -1))
            x, cu_seqlens = layout.pack(x), layout.cu_seqlens
        if positions is None:
            positions = positions_of(x.shape[1], cu_seqlens, x.device)
        return x, cu_seqlens, positions, layout

    def forward(
        self,
        x: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal NSA over x [B, T, hidden] -> [B, T, hidden].

        Args:
            cu_seqlens: int32 [S+1], packed sequences along T (B == 1).
            attention_mask: [B, T] bool or integer 0/1 (1 = token); each row's tokens are one
                contiguous run (left or right padding). Each row runs as its own sequence, its
                padding's output rows are exactly 0. Not together with cu_seqlens.
            position_ids: [B, T], [1, T] or [T] integers >= 0, the RoPE positions of the tokens.
                Default: each sequence's tokens at 0, 1, 2, ... (a masked row's from its first
                token).
        """
        x, cu_seqlens, positions, layout = self._tokens_to_run(
            x, cu_seqlens, attention_mask, position_ids
        )
        inp = self.branch_inputs(x, positions)
        o, _, _ = self._attend(inp, cu_seqlens)
        y: torch.Tensor = self.o_proj(o.flatten(2))
        return y if layout is None else layout.unpack(y)

    @overload
    def prefill(
        self,
        x: torch.Tensor,
        capacity: int = 0,
        *,
        attention_mask: None = None,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, NSACache]: ...

    @overload
    def prefill(
        self,
        x: torch.Tensor,
        capacity: int = 0,
        *,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, RaggedNSACache]: ...

    def prefill(
        self,
        x: torch.Tensor,
        capacity: int = 0,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, NSACache | RaggedNSACache]:
        """forward(x) and a cache holding exactly what len(x) decode steps would leave.

        With an attention_mask (as :meth:`forward` takes it) the cache is a
        :class:`RaggedNSACache`: each row's sequence with its own length. ``capacity``
        pre-allocates that many tokens per sequence.
        """
        x_run, cu_seqlens, positions, layout = self._tokens_to_run(
            x, None, attention_mask, position_ids
        )
        check_int("capacity", capacity, 0, MAX_TOKENS)
        inp = self.branch_inputs(x_run, positions)
        o, k_cmp, v_cmp = self._attend(inp, cu_seqlens)
        y: torch.Tensor = self.o_proj(o.flatten(2))
        if layout is None:
            return y, self._cache_of(inp, k_cmp, v_cmp, capacity, self.compute_dtype())
        cfg = self.config
        spans = layout.cu_seqlens.tolist()
        blocks = cmp_cu_seqlens(layout.cu_seqlens, cfg.cmp_block, cfg.cmp_stride).tolist()
        rows = [
            self._cache_of(
                inp.tokens(spans[b], spans[b + 1]),
                k_cmp[:, blocks[b] : blocks[b + 1]],
                v_cmp[:, blocks[b] : blocks[b + 1]],
                capacity,
                self.compute_dtype(),
            )
            for b in range(layout.batch)
        ]
        return layout.unpack(y), RaggedNSACache(rows, list(layout.starts))

    def _cache_of(
        self,
        inp: BranchInputs,
        k_cmp: torch.Tensor,
        v_cmp: torch.Tensor,
        capacity: int,
        dtype: torch.dtype,
    ) -> NSACache:
        """A cache of ``dtype`` holding the prefilled tokens of ``inp`` and their compressed
        blocks k_cmp [B, N, H, dk], v_cmp [B, N, H, dv]: what len(inp) decode steps leave. The
        cache holds k and v as the layer computed them (docs/spec.md, "Decode")."""
        cfg = self.config
        batch, t = inp.q.shape[:2]
        cache = NSACache.empty(
            cfg, batch, capacity=max(capacity, t), device=inp.q.device, dtype=dtype
        )
        with torch.no_grad():
            cache.append_tokens(
                inp.k["sel"], inp.v["sel"], inp.k["win"], inp.v["win"], inp.k["cmp"], inp.v["cmp"]
            )
            cache.append_blocks(k_cmp, v_cmp, consumed=k_cmp.shape[1] * cfg.cmp_stride)
        return cache

    @overload
    def decode(
        self, x: torch.Tensor, cache: NSACache, *, position_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, DecodeStats]: ...

    @overload
    def decode(
        self, x: torch.Tensor, cache: RaggedNSACache, *, position_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[DecodeStats]]: ...

    def decode(
        self,
        x: torch.Tensor,
        cache: NSACache | RaggedNSACache,
        *,
        position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, DecodeStats | list[DecodeStats]]:
        """One step: x [B, 1, hidden] is the token at position ``cache.length``; advances cache.

        With a :class:`RaggedNSACache` row b's token is at that row's own length, and the
        statistics come per row. position_ids ([B, 1], [1, 1] or [1]) overrides the RoPE
        positions only: the blocks and the window follow the cache's lengths.

        Every argument is checked before the cache changes, and an error inside the step puts
        the cache back as it was (every row of a ragged cache): a failed step leaves no partial
        token behind.
        """
        self.check_input(x)
        if x.shape[1] != 1:
            raise ValueError(f"decode takes one token per sequence, x {shape(x)}")
        if not isinstance(cache, (NSACache, RaggedNSACache)):
            raise TypeError(
                f"cache must be an NSACache, got {type(cache).__name__} (a RaggedNSACache is "
                "also accepted)"
            )
        cache.check_compatible(self.config, x.shape[0], self.compute_dtype(), x.device)
        rows = cache.rows if isinstance(cache, RaggedNSACache) else [cache]
        for row in rows:
            if row.length >= MAX_TOKENS:
                raise ValueError(f"the cache is full: {row.length} tokens is what int32 addresses")
        positions = None
        if position_ids is not None:
            positions = check_position_ids(position_ids, x, None)
        snapshots = [row.snapshot() for row in rows]
        try:
            if isinstance(cache, NSACache):
                return self._decode_step(x, cache, positions)
            return self._decode_rows(x, cache, positions)
        except BaseException:
            for row, snapshot in zip(rows, snapshots, strict=True):
                row.restore(snapshot)
            raise

    def _decode_rows(
        self, x: torch.Tensor, cache: RaggedNSACache, positions: torch.Tensor | None
    ) -> tuple[torch.Tensor, list[DecodeStats]]:
        """:meth:`decode` of a ragged cache, row by row (the reference semantics; see
        :class:`RaggedNSACache`). positions [B | 1, 1] or None."""
        ys, stats = [], []
        for b, row in enumerate(cache.rows):
            row_positions = None
            if positions is not None:
                row_positions = positions[b : b + 1] if positions.shape[0] > 1 else positions
            y, row_stats = self._decode_step(x[b : b + 1], row, row_positions)
            ys.append(y)
            stats.append(row_stats)
        return torch.cat(ys, dim=0), stats

    def _decode_step(
        self, x: torch.Tensor, cache: NSACache, rope_positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, DecodeStats]:
        """:meth:`decode` on arguments that passed its checks; RoPE at ``rope_positions``
        [B | 1, 1] when given, else at the cache's length."""
        cfg = self.config
        t = cache.length
        positions = torch.arange(t, t + 1, device=x.device)  # no host copy: graph-capturable
        inp = self.branch_inputs(x, positions if rope_positions is None else rope_positions)
        cache.append_tokens(
            inp.k["sel"], inp.v["sel"], inp.k["win"], inp.v["win"], inp.k["cmp"], inp.v["cmp"]
        )
        if num_cmp_blocks(t + 1, cfg.cmp_block, cfg.cmp_stride) > cache.num_cmp:
            # The token at i*d + l - 1 completes block i: the first l raw tokens.
            k_blk, v_blk = self.compress_kv(
                cache.k_raw[:, : cfg.cmp_block], cache.v_raw[:, : cfg.cmp_block]
            )
            cache.append_blocks(k_blk, v_blk, consumed=cfg.cmp_stride)
        o_cmp, o_sel, o_win, indices = self.branch_outputs(
            inp.q,
            cache.k_cmp,
            cache.v_cmp,
            cache.k_sel,
            cache.v_sel,
            cache.k_win,
            cache.v_win,
            q_start=t,
            win_start=cache.k_win.shape[1] - 1,
        )
        y = self.o_proj(ops.gated_combine(o_cmp, o_sel, o_win, inp.gates).flatten(2))
        # Count the keys each branch's softmax actually covered, from the masks the ops use.
        sel = selected_visibility(indices, cfg.sel_block, t, t + 1)[:, 0].sum(-1)  # [B, H]
        cmp = cmp_visible(positions, cache.num_cmp, cfg.cmp_block, cfg.cmp_stride).sum(-1)
        stats = DecodeStats(
            position=t,
            reads_cmp=cmp.expand_as(sel),
            reads_sel=sel,
            reads_win=torch.full_like(sel, cache.k_win.shape[1]),
            reads_expected=expected_reads(t, cfg),
        )
        return y, stats
