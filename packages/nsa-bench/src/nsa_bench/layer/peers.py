"""The layer bench's peers: fla-core's ``parallel_nsa``, torch SDPA and FA-2's
``flash_attn_func``, each on the case's inputs in its own layout; a peer that is missing or
refuses the shape becomes a row that says why."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nsa_bench.layer.inputs import Inputs, timed_call
from nsa_bench.layer.measure import measure
from nsa_bench.layer.rows import LayerShape, Row
from nsa_bench.timing import Timer


@dataclass(frozen=True)
class Peer:
    """A peer's callable, or the reason it cannot run here; ``info`` names the version."""

    fn: Callable[..., torch.Tensor] | None
    info: str


def load_fla() -> Peer:
    """fla-core's ``parallel_nsa``, or why it cannot be imported."""
    try:
        import fla
        from fla.ops.nsa.parallel import parallel_nsa
    except Exception as exc:  # any import failure means "no peer", with the reason recorded
        return Peer(None, f"fla-core not importable ({type(exc).__name__}: {exc})")
    return Peer(parallel_nsa, f"fla-core {getattr(fla, '__version__', '?')}")


def load_fa2() -> Peer:
    """flash_attn's ``flash_attn_func``, or why it cannot be imported."""
    try:
        import flash_attn
    except Exception as exc:  # a broken build raises more than ImportError
        return Peer(None, f"flash_attn not importable ({type(exc).__name__}: {exc})")
    return Peer(flash_attn.flash_attn_func, f"flash_attn {getattr(flash_attn, '__version__', '?')}")


def sdpa_has_gqa() -> bool:
    """Whether this torch's SDPA takes ``enable_gqa`` (torch >= 2.5)."""
    q = torch.zeros(1, 2, 1, 8)
    kv = torch.zeros(1, 1, 1, 8)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except TypeError:
        return False
    return True


def bench_fla(
    shape: LayerShape, inp: Inputs, mode: str, peer: Peer, timer: Timer, device: torch.device
) -> Row:
    row = shape.row(
        "method",
        "fla",
        mode,
        backend=peer.info,
        note=(
            f"parallel_nsa: compression pools l'={shape.sel_block}-token blocks (l = d = l'), "
            f"its own top-n with block_counts={shape.num_selected}, cmp and sel gates, no window"
        ),
    )
    if peer.fn is None:
        row.status = "skipped: " + peer.info
        return row
    fla_nsa = peer.fn
    g_cmp = inp.gates[..., 0].contiguous()
    g_sel = inp.gates[..., 1].contiguous()

    def forward(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gc_: torch.Tensor, gs: torch.Tensor
    ) -> torch.Tensor:
        return fla_nsa(
            q,
            k,
            v,
            g_cmp=gc_,
            g_slc=gs,  # fla-core's keyword (the paper's spelling)
            block_counts=shape.num_selected,
            block_size=shape.sel_block,
            window_size=0,
            scale=shape.scale,
        )

    call, leaves = timed_call(forward, (inp.q, inp.k, inp.v, g_cmp, g_sel), inp.do, mode)
    return measure(row, call, leaves, timer, device)


def bench_sdpa(
    shape: LayerShape, inp: Inputs, mode: str, has_gqa: bool, timer: Timer, device: torch.device
) -> Row:
    g = shape.group
    if has_gqa:
        note = "causal, enable_gqa=True, inputs in SDPA's [B, H, T, D] layout"
    else:
        note = (
            "causal; this torch's SDPA lacks enable_gqa: kv heads repeated with "
            "repeat_interleave inside the timed call"
        )
    row = shape.row("method", "sdpa", mode, backend=f"torch {torch.__version__}", note=note)
    # SDPA's own layout, made once outside the timed call: [B, heads, T, D].
    q, k, v, do = (x.transpose(1, 2).contiguous() for x in (inp.q, inp.k, inp.v, inp.do))

    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if has_gqa:
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=shape.scale, enable_gqa=True
            )
        k_rep = k.repeat_interleave(g, dim=1)
        v_rep = v.repeat_interleave(g, dim=1)
        return F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True, scale=shape.scale)

    call, leaves = timed_call(forward, (q, k, v), do, mode)
    measure(row, call, leaves, timer, device)
    del q, k, v, do, call, leaves
    return row


def bench_fa2(
    shape: LayerShape, inp: Inputs, mode: str, peer: Peer, timer: Timer, device: torch.device
) -> Row:
    dk, dv = shape.head_dim_qk, shape.head_dim_v
    note = "causal, native GQA"
    if dv != dk:
        note += f"; v (and the upstream gradient) zero-padded from dv={dv} to dk={dk}"
    row = shape.row("method", "fa2", mode, backend=peer.info, note=note)
    if peer.fn is None:
        row.status = "skipped: " + peer.info
        return row
    if device.type != "cuda":
        row.status = f"skipped: FA-2 needs a CUDA device, this run is on {device.type}"
        return row
    flash = peer.fn
    # FA-2 takes one head dim for q, k and v.
    v = F.pad(inp.v, (0, dk - dv)) if dv < dk else inp.v
    do = F.pad(inp.do, (0, dk - dv)) if dv < dk else inp.do

    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return flash(q, k, v, softmax_scale=shape.scale, causal=True)

    call, leaves = timed_call(forward, (inp.q, inp.k, v), do, mode)
    measure(row, call, leaves, timer, device)
    del v, do, call, leaves
    return row
