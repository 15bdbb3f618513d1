"""Inputs, references and checks shared by the decode-step tests.

A :class:`Stream` holds random per-token inputs (q, per-branch K/V, gates) for B sequences; a
sequence at length L takes the stream's token L as its next step. The reference is nsa_core's
ops in float64: either the decode path (an ``NSACache`` per sequence advanced like
``NSAAttention.decode``) or the prefill path (the ops over the whole prefix at q_start = t).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from kernel_testlib import rel_err

from nsa_core import NSACache, NSAConfig, expected_reads, num_cmp_blocks, reference, selected_reads
from nsa_core.attention import BranchInputs
from nsa_kernels.decode.state import BRANCHES, DecodeState
from nsa_kernels.decode.step import TOPN_REL_GAP, StepInputs, StepOutputs


def small_config(
    group: int,
    *,
    heads: int = 2,
    dk: int = 16,
    dv: int = 16,
    phi: str = "avg",
    window: int = 24,
    num_selected: int = 4,
) -> NSAConfig:
    """l=8, d=4, l'=16: selection block j takes compressed blocks 4j-1 .. 4j+3 (1,2,2,2,1)."""
    return NSAConfig(
        num_q_heads=heads * group,
        num_kv_heads=heads,
        head_dim_qk=dk,
        head_dim_v=dv,
        cmp_block=8,
        cmp_stride=4,
        sel_block=16,
        num_selected=num_selected,
        window=window,
        phi="mlp" if phi == "mlp" else "avg",
    )


@dataclass
class Stream(BranchInputs):
    """Per-token inputs of B sequences: q [B, T, HQ, dk], k/v per branch [B, T, H, *], gates."""

    @classmethod
    def random(
        cls,
        cfg: NSAConfig,
        batch: int,
        tokens: int,
        gen: torch.Generator,
        *,
        dtype: torch.dtype,
        device: str,
    ) -> Stream:
        hq, h = cfg.num_q_heads, cfg.num_kv_heads
        dk, dv = cfg.head_dim_qk, cfg.head_dim_v

        def draw(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(device, dtype)

        return cls(
            q=draw(batch, tokens, hq, dk),
            k={b: draw(batch, tokens, h, dk) for b in BRANCHES},
            v={b: draw(batch, tokens, h, dv) for b in BRANCHES},
            gates=torch.rand(batch, tokens, hq, 3, generator=gen).to(device, dtype),
        )

    def inputs_at(self, positions: Sequence[int]) -> StepInputs:
        """The token at ``positions[b]`` of each sequence b, as one step's inputs."""
        seq = torch.arange(len(positions), device=self.q.device)
        pos = torch.tensor(list(positions), device=self.q.device)
        return StepInputs(
            q=self.q[seq, pos],
            k_cmp=self.k["cmp"][seq, pos],
            v_cmp=self.v["cmp"][seq, pos],
            k_sel=self.k["sel"][seq, pos],
            v_sel=self.v["sel"][seq, pos],
            k_win=self.k["win"][seq, pos],
            v_win=self.v["win"][seq, pos],
            gates=self.gates[seq, pos],
        )


@dataclass
class RefStep:
    """The float64 reference at position t of one sequence, given the kernel's indices."""

    o: torch.Tensor  # [HQ, dv], with the kernel's indices
    indices: torch.Tensor  # [H, n], the reference's own choice
    scores: torch.Tensor  # [H, Nsel]


def reference_at(
    cfg: NSAConfig,
    stream: Stream,
    b: int,
    t: int,
    kernel_indices: torch.Tensor,
    phi_k: torch.nn.Module | None = None,
    phi_v: torch.nn.Module | None = None,
    blocks: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> RefStep:
    """The prefill path: nsa_core ops over sequence b's prefix [0, t] with the query at t.

    ``kernel_indices [H, n]`` are the blocks the kernel chose; the output uses them so that the
    comparison of outputs does not depend on near ties of top-n (checked by :func:`check_topn`).
    ``blocks``: the compressed K~/V~ [N_cmp(t+1), H, D] to use instead of compressing the raw
    K/V here (low precision: the kernel's own rounded blocks, so that scores see the same keys).
    """
    f64 = torch.float64
    q = stream.q[b : b + 1, t : t + 1].to(f64)
    k = {name: x[b : b + 1, : t + 1].to(f64) for name, x in stream.k.items()}
    v = {name: x[b : b + 1, : t + 1].to(f64) for name, x in stream.v.items()}
    with torch.no_grad():
        if blocks is None:
            k_cmp = reference.compress(k["cmp"], cfg.cmp_block, cfg.cmp_stride, _as(phi_k, f64))
            v_cmp = reference.compress(v["cmp"], cfg.cmp_block, cfg.cmp_stride, _as(phi_v, f64))
        else:
            k_cmp = blocks[0].unsqueeze(0).to(f64)
            v_cmp = blocks[1].unsqueeze(0).to(f64)
        scale = cfg.softmax_scale
        geometry = (cfg.cmp_block, cfg.cmp_stride, cfg.sel_block)
        ref_idx, _ = reference.select_blocks(
            q, k_cmp, *geometry, cfg.num_selected, scale, q_start=t
        )
        scores = reference.block_scores(q, k_cmp, *geometry, scale, q_start=t)
        idx = kernel_indices.to(q.device, torch.int64).view(1, 1, *kernel_indices.shape)
        o_cmp = reference.compressed_attention(
            q, k_cmp, v_cmp, cfg.cmp_block, cfg.cmp_stride, scale, q_start=t
        )
        o_sel = reference.selected_attention(
            q, k["sel"], v["sel"], idx, cfg.sel_block, scale, q_start=t
        )
        o_win = reference.sliding_attention(q, k["win"], v["win"], cfg.window, scale, q_start=t)
        g = stream.gates[b : b + 1, t : t + 1].to(f64)
        o = reference.gated_combine(o_cmp, o_sel, o_win, g)
    return RefStep(o=o[0, 0], indices=ref_idx[0, 0], scores=scores[0, 0])


def _as(
    module: torch.nn.Module | None, dtype: torch.dtype, device: str | None = None
) -> torch.nn.Module | None:
    if module is None:
        return None
    import copy

    return copy.deepcopy(module).to(device=device, dtype=dtype)


def forced_blocks(t: int, sel_block: int) -> set[int]:
    jt = t // sel_block
    return {j for j in (0, jt - 1, jt) if 0 <= j <= jt}


def near_tie(scores: torch.Tensor, t: int, cfg: NSAConfig) -> bool:
    """Whether the n-th and (n+1)-th best non-forced valid scores differ by < TOPN_REL_GAP."""
    jt = t // cfg.sel_block
    forced = forced_blocks(t, cfg.sel_block)
    free = sorted((float(scores[j]) for j in range(jt + 1) if j not in forced), reverse=True)
    slots = cfg.num_selected - len(forced)
    if slots <= 0 or len(free) <= slots:
        return False
    nth, next_ = free[slots - 1], free[slots]
    return nth - next_ <= TOPN_REL_GAP * nth + 1e-30


def check_topn(kernel_idx: torch.Tensor, t: int, cfg: NSAConfig, where: str) -> None:
    """The part of the index contract that holds in every row, near ties included.

    Ascending distinct valid blocks, -1 padded, min(n, jt + 1) of them, the forced ones among
    them. Outside near ties the caller also asserts equality with the reference's choice.
    """
    jt = t // cfg.sel_block
    row = [int(j) for j in kernel_idx.tolist()]
    count = min(cfg.num_selected, jt + 1)
    chosen = row[:count]
    assert row[count:] == [-1] * (len(row) - count), f"{where}: padding {row}"
    assert chosen == sorted(set(chosen)), f"{where}: not ascending distinct {row}"
    assert all(0 <= j <= jt for j in chosen), f"{where}: invalid block in {row} (jt={jt})"
    assert forced_blocks(t, cfg.sel_block) <= set(chosen), f"{where}: forced missing {row}"


def check_step(
    cfg: NSAConfig,
    stream: Stream,
    positions: Sequence[int],
    out: StepOutputs,
    bound: float,
    *,
    phi_k: torch.nn.Module | None = None,
    phi_v: torch.nn.Module | None = None,
    state: DecodeState | None = None,
) -> tuple[int, int]:
    """Check one step of every sequence against the prefill reference; (exact rows, tie rows).

    Per sequence b at position t: the index contract per kv head, the output against the
    float64 reference with the kernel's indices (bound), and the reads against the formula.
    With ``state`` the reference takes the state's compressed blocks (see :func:`reference_at`).
    """
    exact = ties = 0
    for b, t in enumerate(positions):
        idx = out.indices[b].cpu()
        blocks = None
        if state is not None:
            n = num_cmp_blocks(t + 1, cfg.cmp_block, cfg.cmp_stride)
            blocks = (state.k_cmp[b, :n], state.v_cmp[b, :n])
        ref = reference_at(cfg, stream, b, t, idx, phi_k, phi_v, blocks)
        for h in range(cfg.num_kv_heads):
            where = f"seq {b} t={t} head {h}"
            check_topn(idx[h], t, cfg, where)
            if near_tie(ref.scores[h], t, cfg):
                ties += 1
            else:
                exact += 1
                assert idx[h].tolist() == ref.indices[h].tolist(), (
                    f"{where}: kernel {idx[h].tolist()} vs reference {ref.indices[h].tolist()}"
                )
        err = rel_err(out.o[b], ref.o)
        assert err <= bound, f"seq {b} t={t}: output rel err {err:.3g} > {bound}"
        check_reads(cfg, out, b, t)
    return exact, ties


def check_reads(cfg: NSAConfig, out: StepOutputs, b: int, t: int) -> None:
    """Counted reads equal docs/spec.md's formula, per branch and in total."""
    for h in range(cfg.num_kv_heads):
        idx = [int(j) for j in out.indices[b, h].tolist()]
        got = (int(out.reads_cmp[b, h]), int(out.reads_sel[b, h]), int(out.reads_win[b, h]))
        want = (
            num_cmp_blocks(t + 1, cfg.cmp_block, cfg.cmp_stride),
            selected_reads(t, idx, cfg.sel_block),
            min(cfg.window, t + 1),
        )
        assert got == want, f"seq {b} t={t} head {h}: reads {got} != {want}"
        assert sum(got) == expected_reads(t, cfg), f"seq {b} t={t}: total {sum(got)}"


class ReferenceDecoder:
    """nsa_core's decode path in float64: an NSACache per sequence, advanced token by token.

    Mirrors ``NSAAttention.decode`` with the projections replaced by the stream's inputs.
    """

    def __init__(
        self,
        cfg: NSAConfig,
        stream: Stream,
        lengths: Sequence[int],
        phi_k: torch.nn.Module | None = None,
        phi_v: torch.nn.Module | None = None,
    ) -> None:
        self.cfg = cfg
        self.stream = stream
        # The reference caches live on the CPU in float64, and so do their copies of phi.
        self.phi_k = _as(phi_k, torch.float64, "cpu")
        self.phi_v = _as(phi_v, torch.float64, "cpu")
        self.caches = []
        for b, n in enumerate(lengths):
            cache = NSACache.empty(cfg, 1, capacity=n, device="cpu", dtype=torch.float64)
            for t in range(n):
                self._append(cache, b, t)
            self.caches.append(cache)

    def _token(self, b: int, t: int) -> dict[str, torch.Tensor]:
        s = self.stream
        f64 = torch.float64
        out = {f"k_{n}": s.k[n][b : b + 1, t : t + 1].cpu().to(f64) for n in BRANCHES}
        out.update({f"v_{n}": s.v[n][b : b + 1, t : t + 1].cpu().to(f64) for n in BRANCHES})
        return out

    def _append(self, cache: NSACache, b: int, t: int) -> None:
        cfg = self.cfg
        x = self._token(b, t)
        cache.append_tokens(x["k_sel"], x["v_sel"], x["k_win"], x["v_win"], x["k_cmp"], x["v_cmp"])
        if num_cmp_blocks(t + 1, cfg.cmp_block, cfg.cmp_stride) > cache.num_cmp:
            with torch.no_grad():
                k_blk = reference.compress(
                    cache.k_raw[:, : cfg.cmp_block], cfg.cmp_block, cfg.cmp_stride, self.phi_k
                )
                v_blk = reference.compress(
                    cache.v_raw[:, : cfg.cmp_block], cfg.cmp_block, cfg.cmp_stride, self.phi_v
                )
            cache.append_blocks(k_blk, v_blk, consumed=cfg.cmp_stride)

    def step(self, b: int, kernel_indices: torch.Tensor) -> torch.Tensor:
        """Advance sequence b by its next token; o [HQ, dv] with the kernel's indices."""
        cfg = self.cfg
        cache = self.caches[b]
        t = cache.length
        self._append(cache, b, t)
        s = self.stream
        f64 = torch.float64
        q = s.q[b : b + 1, t : t + 1].cpu().to(f64)
        idx = kernel_indices.cpu().to(torch.int64).view(1, 1, *kernel_indices.shape)
        scale = cfg.softmax_scale
        with torch.no_grad():
            o_cmp = reference.compressed_attention(
                q, cache.k_cmp, cache.v_cmp, cfg.cmp_block, cfg.cmp_stride, scale, q_start=t
            )
            o_sel = reference.selected_attention(
                q, cache.k_sel, cache.v_sel, idx, cfg.sel_block, scale, q_start=t
            )
            o_win = reference.sliding_attention(
                q, cache.k_win, cache.v_win, cfg.window, scale, q_start=cache.k_win.shape[1] - 1
            )
            g = s.gates[b : b + 1, t : t + 1].cpu().to(f64)
            return reference.gated_combine(o_cmp, o_sel, o_win, g)[0, 0]


def assert_same_cache(got: NSACache, want: NSACache, bound: float, where: str) -> None:
    """Equal logical content (lengths exact, tensors within ``bound`` relative error)."""
    assert got.length == want.length, f"{where}: length {got.length} != {want.length}"
    assert got.num_cmp == want.num_cmp, f"{where}: blocks {got.num_cmp} != {want.num_cmp}"
    for name, x in want.state().items():
        y = got.state()[name]
        assert y.shape == x.shape, f"{where}: {name} {list(y.shape)} vs {list(x.shape)}"
        if x.numel():
            err = rel_err(y, x)
            assert err <= bound, f"{where}: {name} rel err {err:.3g}"
