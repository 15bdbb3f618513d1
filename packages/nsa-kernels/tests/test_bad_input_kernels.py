"""Every public entry point of nsa-kernels refuses bad arguments before it launches anything.

One row per bad input (docs/spec.md, "Argument rules"): the entry point (as named in
``nsa_kernels.public.PUBLIC_ENTRY_POINTS``), the argument, the bad value, the exception type and
a fragment of its message, which names the argument and the rule. Each entry point has at least
three rows. A row that reaches another exception type (an AttributeError, a launch on CPU
tensors without the interpreter) fails.

Plain CPU tests: a row's call is refused before any kernel runs, so no GPU and no interpreter is
needed. ``TRITON_INTERPRET`` is set for the rows that check the interpreter's refusals (the
setting is read at each call; nothing is launched), and unset for the rows that check that
Triton refuses CPU tensors without it.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from nsa_core import NSAAttention, NSACache, NSAConfig
from nsa_kernels import (
    sel_attn_fwd_dense,
    sel_attn_fwd_varlen,
    selected_attention_triton,
)
from nsa_kernels.combine.function import gated_combine_triton, sum3_triton
from nsa_kernels.common.flex import compressed_attention_flex, sliding_attention_flex
from nsa_kernels.common.sdpa import compressed_attention_sdpa, sliding_attention_sdpa
from nsa_kernels.compressed.config import CmpConfig
from nsa_kernels.compressed.cudnn import (
    compressed_attention_cudnn,
    compressed_attention_cudnn_with_lse,
)
from nsa_kernels.compressed.fa2 import compressed_attention_fa2
from nsa_kernels.compressed.function import (
    compressed_attention_bwd,
    compressed_attention_fwd,
    compressed_attention_triton,
    compressed_attention_triton_with_lse,
)
from nsa_kernels.decode import (
    DecodeGraph,
    DecodeKernelConfig,
    DecodePlan,
    DecodeState,
    LayerDecoder,
    StepInputs,
    block_phi,
    decode_step,
)
from nsa_kernels.pairing import pairing
from nsa_kernels.public import PUBLIC_ENTRY_POINTS
from nsa_kernels.registration import register
from nsa_kernels.rope.function import apply_rope_triton
from nsa_kernels.scoring.contract import check_index_contract
from nsa_kernels.scoring.function import ScoreConfig, select_blocks_triton
from nsa_kernels.selected.cuda.selected import selected_attention_cuda
from nsa_kernels.selected.function import (
    SelConfig,
    parse_config,
    selected_attention_bwd,
    selected_attention_fwd,
    selected_attention_gated_triton,
)
from nsa_kernels.sliding.fa2 import sliding_attention_fa2
from nsa_kernels.sliding.triton_function import (
    sliding_attention_triton,
    sliding_attention_triton_with_local,
)

# B=1, T=8, HQ=4, H=2, dk=dv=16; l=4, d=2 (3 compressed blocks), l'=4 (2 selection blocks), n=3.
B, T, HQ, H, DK, DV = 1, 8, 4, 2, 16, 16
L_CMP, D_CMP, L_SEL, N_SEL, W = 4, 2, 4, 3, 4
N_CMP = (T - L_CMP) // D_CMP + 1
F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16
META = "meta"
VE, TE = ValueError, TypeError

# The refusals' own words (nsa_kernels.common.triton_inputs).
DOT = "under TRITON_INTERPRET=1: Triton's interpreter multiplies bfloat16 tl.dot operands"
ROUNDING = "under TRITON_INTERPRET=1: Triton's interpreter rounds float32 to bfloat16 toward zero"
ON_CPU = "is on cpu: the Triton kernels run on CUDA tensors (or on CPU tensors under"


def rand(*shape: int, dtype: torch.dtype = F32, device: str = "cpu") -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, device=device)


def q_(dtype: torch.dtype = F32) -> torch.Tensor:
    return rand(B, T, HQ, DK, dtype=dtype)


def kv_(dim: int = DK, dtype: torch.dtype = F32, tokens: int = T) -> torch.Tensor:
    return rand(B, tokens, H, dim, dtype=dtype)


def o_(dim: int = DV, dtype: torch.dtype = F32) -> torch.Tensor:
    """A branch output (or its gradient) [B, T, HQ, dv]."""
    return rand(B, T, HQ, dim, dtype=dtype)


def gates_(dtype: torch.dtype = F32) -> torch.Tensor:
    return torch.rand(B, T, HQ, 3, dtype=dtype)


def lse_(heads: int = HQ, dtype: torch.dtype = F32) -> torch.Tensor:
    return rand(B, T, heads, dtype=dtype)


def indices_() -> torch.Tensor:
    """[B, T, H, n]: block 0, the current block, -1: always in range."""
    idx = torch.full((B, T, H, N_SEL), -1, dtype=torch.int32)
    idx[..., 0] = 0
    idx[..., 1] = (torch.arange(T) // L_SEL).view(1, T, 1).to(torch.int32)
    return idx


def with_(fn: Callable[..., object], base: dict[str, Any], keywords: tuple[str, ...]) -> Any:
    """A caller of ``fn`` on ``base`` (built afresh per call) with some arguments replaced: the
    names in ``keywords`` go by keyword, the rest by position in ``base``'s order."""

    def call(**over: Any) -> object:
        args = base | over
        kw = {name: args.pop(name) for name in keywords if name in args}
        return fn(*args.values(), **kw)

    return call


def attention_args(dtype: torch.dtype = F32) -> dict[str, Any]:
    return {"q": q_(dtype), "k": kv_(DK, dtype), "v": kv_(DV, dtype)}


def cmp_args(dtype: torch.dtype = F32) -> dict[str, Any]:
    return {
        "q": q_(dtype),
        "k_cmp": kv_(DK, dtype, N_CMP),
        "v_cmp": kv_(DV, dtype, N_CMP),
        "cmp_block": L_CMP,
        "cmp_stride": D_CMP,
    }


def selected(fn: Callable[..., object], dtype: torch.dtype = F32, **over: Any) -> object:
    args = attention_args(dtype) | {"block_indices": indices_(), "sel_block": L_SEL}
    keywords = ("scale", "q_start", "cu_seqlens", "config", "toggles", "local", "o_cmp")
    keywords += ("o_win", "gates")
    return with_(fn, args, keywords)(**over)


def gated(dtype: torch.dtype = F32, **over: Any) -> object:
    branches = {"o_cmp": o_(dtype=dtype), "o_win": o_(dtype=dtype), "gates": gates_(dtype)}
    return selected(selected_attention_gated_triton, dtype, **(branches | over))


def selected_bwd(dtype: torch.dtype = F32, **over: Any) -> object:
    args = {"do": o_(dtype=dtype)} | attention_args(dtype)
    args |= {"o": o_(dtype=dtype), "lse": lse_(), "block_indices": indices_(), "sel_block": L_SEL}
    return with_(selected_attention_bwd, args, ("scale", "q_start", "config"))(**over)


def compressed(fn: Callable[..., object], dtype: torch.dtype = F32, **over: Any) -> object:
    return with_(fn, cmp_args(dtype), ("scale", "q_start", "cu_seqlens", "config"))(**over)


def compressed_bwd(dtype: torch.dtype = F32, **over: Any) -> object:
    args = {"do": o_(dtype=dtype)} | cmp_args(dtype)
    args = {k: args[k] for k in ("do", "q", "k_cmp", "v_cmp")} | {"o": o_(dtype=dtype)}
    args |= {"lse": lse_(), "cmp_block": L_CMP, "cmp_stride": D_CMP}
    return with_(compressed_attention_bwd, args, ("scale", "q_start", "config"))(**over)


def sliding(fn: Callable[..., object], dtype: torch.dtype = F32, **over: Any) -> object:
    args = attention_args(dtype) | {"window": W}
    keywords = ("scale", "q_start", "cu_seqlens", "config", "sel_block")
    return with_(fn, args, keywords)(**over)


def scoring(dtype: torch.dtype = F32, **over: Any) -> object:
    args = cmp_args(dtype)
    args = {k: args[k] for k in ("q", "k_cmp", "cmp_block", "cmp_stride")}
    args |= {"sel_block": L_SEL, "num_selected": N_SEL}
    keywords = ("scale", "q_start", "cu_seqlens", "lse", "config")
    return with_(select_blocks_triton, args, keywords)(**over)


def contract(**over: Any) -> object:
    args = {
        "indices": indices_(),
        "counts": torch.full((B, T, H), 2, dtype=torch.int32),
        "ref_indices": indices_(),
        "ref_scores": rand(B, T, H, T // L_SEL),
        "positions": torch.arange(T),
        "sel_block": L_SEL,
    }
    return with_(check_index_contract, args, ("rel_tol", "abs_tol", "exact_ties"))(**over)


def combine(dtype: torch.dtype = F32, **over: Any) -> object:
    args = {"o_cmp": o_(dtype=dtype), "o_sel": o_(dtype=dtype), "o_win": o_(dtype=dtype)}
    return with_(gated_combine_triton, args | {"gates": gates_(dtype)}, ())(**over)


def sum3(dtype: torch.dtype = F32, **over: Any) -> object:
    args = {"a": o_(dtype=dtype), "b": o_(dtype=dtype), "c": o_(dtype=dtype)}
    return with_(sum3_triton, args, ())(**over)


def rope(dtype: torch.dtype = F32, **over: Any) -> object:
    args = {"x": q_(dtype), "positions": torch.arange(T), "theta": 10000.0}
    return with_(apply_rope_triton, args, ())(**over)


def quick_dense(dtype: torch.dtype = F32, **over: Any) -> object:
    args = {"q": rand(3, 2, 16, dtype=dtype), "k": rand(3, 20, 16, dtype=dtype)}
    args |= {"v": rand(3, 20, 8, dtype=dtype)}
    return with_(sel_attn_fwd_dense, args, ("scale", "block_l"))(**over)


def quick_varlen(dtype: torch.dtype = F32, **over: Any) -> object:
    args = {"q": rand(2, 2, 16, dtype=dtype), "k": rand(9, 16, dtype=dtype)}
    args |= {"v": rand(9, 8, dtype=dtype), "cu_seqlens": torch.tensor([0, 4, 9], dtype=torch.int32)}
    return with_(sel_attn_fwd_varlen, args, ("scale", "block_l"))(**over)


# ------------------------------------------------------------------------------ decode


def decode_config(**over: Any) -> NSAConfig:
    """A decode geometry: l'/d a power of two, as the fused step needs."""
    base: dict[str, Any] = {
        "num_q_heads": HQ,
        "num_kv_heads": H,
        "head_dim_qk": DK,
        "head_dim_v": DV,
        "cmp_block": L_CMP,
        "cmp_stride": D_CMP,
        "sel_block": L_SEL,
        "num_selected": N_SEL,
        "window": W,
    }
    return NSAConfig(**(base | over))


def state_(dtype: torch.dtype = F32, config: NSAConfig | None = None) -> DecodeState:
    return DecodeState.empty(config or decode_config(), B, 16, device="cpu", dtype=dtype)


def branches(dim: int, dtype: torch.dtype = F32, **over: torch.Tensor) -> dict[str, Any]:
    return {name: kv_(dim, dtype) for name in ("cmp", "sel", "win")} | over


def from_prefixes(**over: Any) -> object:
    args = {
        "config": decode_config(),
        "k": branches(DK),
        "v": branches(DV),
        "lengths": [5],
        "capacity": 16,
    }
    return with_(DecodeState.from_prefixes, args, ("phi_k", "phi_v"))(**over)


def empty(**over: Any) -> object:
    args = {"config": decode_config(), "batch": B, "capacity": 16}
    keywords = ("device", "dtype")
    return with_(DecodeState.empty, args | {"device": "cpu", "dtype": F32}, keywords)(**over)


def cache_(length: int = 5) -> NSACache:
    layer = NSAAttention(decode_config(), HIDDEN)
    with torch.no_grad():
        _, cache = layer.prefill(rand(B, length, HIDDEN))
    return cache


def step(dtype: torch.dtype = F32, **over: Any) -> object:
    state = state_(dtype)
    args = {"state": state, "inputs": StepInputs.zeros(state)}
    return with_(decode_step, args, ("phi_k", "phi_v", "plan"))(**over)


def inputs_with(**over: torch.Tensor) -> StepInputs:
    fields = StepInputs.zeros(state_()).__dict__
    return StepInputs(**(fields | over))


HIDDEN = 16


def layer_(**config: Any) -> NSAAttention:
    return NSAAttention(decode_config(**config), HIDDEN)


def decoder(**over: Any) -> object:
    args = {"module": layer_(), "state": state_()}
    return with_(LayerDecoder, args, ("config", "graph", "warmup"))(**over)


def decoder_step(x: object) -> object:
    return LayerDecoder(layer_(), state_()).step(x)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ the table


@dataclass(frozen=True)
class Case:
    """One refused call: ``entry`` (a name of PUBLIC_ENTRY_POINTS, without its module), the
    argument and bad value it shows, the exception and a fragment of its message; ``interpreter``
    "on" sets TRITON_INTERPRET=1 for the call, "off" unsets it, None leaves it."""

    entry: str
    arg: str
    bad: str
    error: type[Exception]
    fragment: str
    call: Callable[[], object]
    interpreter: str | None = None

    @property
    def id(self) -> str:
        return f"{self.entry}-{self.arg}={self.bad}"


def describe(value: object) -> str:
    """A short name of a bad value for the test id: a tensor by dtype and shape."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}@{value.device.type}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {describe(v)}" for k, v in value.items()) + "}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # By field, so that a dataclass of tensors is named by dtypes and shapes, not by values:
        # pytest-xdist workers must all collect the same ids.
        fields = ", ".join(f"{f.name}={describe(getattr(value, f.name))}"
                           for f in dataclasses.fields(value))  # fmt: skip
        return f"{type(value).__name__}({fields})"
    if callable(value) and not isinstance(value, type):
        return getattr(value, "__qualname__", type(value).__name__)  # never its address
    return str(value)


def case(
    entry: str,
    arg: str,
    bad: object,
    error: type[Exception],
    fragment: str,
    call: Callable[[], object],
    interpreter: str | None = None,
) -> Case:
    return Case(entry, arg, describe(bad), error, fragment, call, interpreter)


def arg_rows(
    entry: str, call: Callable[..., object], rows: list[tuple[str, object, type[Exception], str]]
) -> list[Case]:
    """One row per (argument, bad value, error, fragment): ``call`` with that argument replaced."""
    return [
        case(entry, arg, bad, error, fragment, lambda arg=arg, bad=bad: call(**{arg: bad}))
        for arg, bad, error, fragment in rows
    ]


def triton_rows(entry: str, call: Callable[..., object], name: str = "q") -> list[Case]:
    """The two refusals of a Triton kernel on where it runs: bfloat16 under the interpreter,
    whose bfloat16 tl.dot is wrong, and CPU tensors without it."""
    return [
        case(entry, name, "bfloat16", TE, f"bfloat16 {name} {DOT}", lambda: call(BF16), "on"),
        case(entry, name, "cpu", VE, f"{name} {ON_CPU}", lambda: call(F32), "off"),
    ]


def paper_config_with(**fields: Any) -> DecodeKernelConfig:
    return DecodeKernelConfig(**fields)


# fmt: off
CASES: list[Case] = [
    # ---- the selected branch's quick-sanity entries
    *arg_rows("sel_attn_fwd_dense", quick_dense, [
        ("q", rand(1, 3, 2, 16), VE, "q must have rank 3 [N, H, D], got shape [1, 3, 2, 16]"),
        ("k", rand(3, 20, 16, dtype=F64), TE, "k dtype torch.float64 differs from q dtype"),
        ("block_l", 24, VE, "block_l must be a power of two >= 16, got 24"),
        ("block_l", 64.0, TE, "block_l must be an int, got float 64.0"),
        ("scale", -1.0, VE, "scale must be finite and > 0, got -1.0"),
    ]),
    case("sel_attn_fwd_dense", "k", "2 rows", VE, "k has 2 rows, q has 3",
         lambda: quick_dense(k=rand(2, 20, 16), v=rand(2, 20, 8))),
    case("sel_attn_fwd_dense", "q", "float64", TE,
         "Triton selection (quick) supports float16, bfloat16 and float32, got q of dtype "
         "torch.float64", lambda: quick_dense(F64)),
    *triton_rows("sel_attn_fwd_dense", quick_dense),
    *arg_rows("sel_attn_fwd_varlen", quick_varlen, [
        ("cu_seqlens", torch.tensor([0, 4, 9]), TE, "cu_seqlens must be int32, got torch.int64"),
        ("cu_seqlens", torch.tensor([0, 5, 4], dtype=torch.int32), VE,
         "cu_seqlens must be non-decreasing"),
        ("cu_seqlens", torch.tensor([0, 9], dtype=torch.int32), VE,
         "cu_seqlens must hold N+1=3 entries"),
        ("k", rand(1, 9, 16), VE, "k must have rank 2 [TotalL, D]"),
        ("v", rand(8, 8), VE, "k [9, 16] and v [8, 8] differ in keys"),
    ]),
    *triton_rows("sel_attn_fwd_varlen", quick_varlen),
    # ---- the selected branch on Triton
    *arg_rows("selected_attention_triton", lambda **o: selected(selected_attention_triton, **o), [
        ("sel_block", 4.0, TE, "sel_block must be an int, got float 4.0"),
        ("q_start", True, TE, "q_start must be an int, got bool"),
        ("block_indices", indices_().float(), TE, "block_indices must be int32 or int64"),
        ("config", {"block_l": 64}, TE, "config must be a SelConfig or None, got dict"),
        ("config", CmpConfig(), TE, "config must be a SelConfig or None, got CmpConfig"),
        ("config", SelConfig(block_l=64.0), TE,  # type: ignore[arg-type]
         "SelConfig.block_l must be an int, got float 64.0"),
        ("config", SelConfig(block_l=-16), VE, "SelConfig.block_l must be >= 0 (0 = choose)"),
        ("toggles", "sel_triton=1", TE, "toggles must be an nsa_core.toggles.Toggles or None"),
        ("v", kv_(272), VE, "head dims dk=16, dv=272 exceed 256"),
    ]),
    case("selected_attention_triton", "q", "float64", TE,
         "Triton selected attention supports float16, bfloat16 and float32, got q of dtype "
         "torch.float64", lambda: selected(selected_attention_triton, F64)),
    *triton_rows("selected_attention_triton", lambda d: selected(selected_attention_triton, d)),
    *arg_rows("selected_attention_fwd", lambda **o: selected(selected_attention_fwd, **o), [
        ("local", "forced", TE, "local must be a LocalSoftmax or None, got str"),
        ("sel_block", 0, VE, "sel_block must be >= 1, got 0"),
        ("scale", "x", TE, "scale must be a float or None, got str"),
        ("q_start", -1, VE, "q_start must be >= 0, got -1"),
    ]),
    *triton_rows("selected_attention_fwd", lambda d: selected(selected_attention_fwd, d)),
    *arg_rows("selected_attention_bwd", selected_bwd, [
        ("do", rand(B, T, HQ), VE, "do must have rank 4 [B, Tq, HQ, dv]"),
        ("do", o_(8), VE, "do [1, 8, 4, 8] must be [B, Tq, HQ, dv] = [1, 8, 4, 16]"),
        ("o", o_(dtype=F64), TE, "o dtype torch.float64 differs from q dtype torch.float32"),
        ("lse", lse_(dtype=torch.float16), TE, "lse must be float32, got torch.float16"),
        ("lse", lse_(heads=3), VE, "lse [1, 8, 3] must be [B, Tq, HQ] = [1, 8, 4]"),
    ]),
    case("selected_attention_bwd", "q", "bfloat16", TE, f"bfloat16 q {DOT}",
         lambda: selected_bwd(BF16, lse=lse_()), "on"),
    *arg_rows("selected_attention_gated_triton", gated, [
        ("gates", torch.rand(B, T, HQ, 2), VE, "gates [1, 8, 4, 2] must be [B, T, HQ, 3]"),
        ("o_win", o_(dtype=F64), TE, "o_win dtype torch.float64 differs from o_cmp dtype"),
        ("local", 1, TE, "local must be a LocalSoftmax or None, got int"),
    ]),
    case("selected_attention_gated_triton", "o_cmp", "dv=8", VE,
         "o_cmp [1, 8, 4, 8] must be [B, Tq, HQ, dv] = [1, 8, 4, 16]",
         lambda: gated(o_cmp=o_(8), o_win=o_(8))),
    *triton_rows("selected_attention_gated_triton", lambda d: gated(d)),
    # ---- the experimental CUDA kernel
    *arg_rows("selected_attention_cuda", lambda **o: selected(selected_attention_cuda, **o), [
        ("sel_block", 2.5, TE, "sel_block must be an int, got float 2.5"),
        ("block_indices", indices_().clamp_min(2), VE, "block_indices must lie in [-1, 2)"),
    ]),
    case("selected_attention_cuda", "q", "float32", TE,
         "cuda_sel takes float16 or bfloat16, got q of dtype torch.float32",
         lambda: selected(selected_attention_cuda)),
    case("selected_attention_cuda", "q", "cpu", VE, "q is on cpu: cuda_sel runs on CUDA tensors",
         lambda: selected(selected_attention_cuda, torch.float16)),
    # ---- the compressed branch on Triton
    *arg_rows("compressed_attention_triton",
              lambda **o: compressed(compressed_attention_triton, **o), [
        ("cmp_stride", 3, VE, "cmp_stride (3) must be >= 1 and divide cmp_block (4)"),
        ("config", SelConfig(), TE, "config must be a CmpConfig or None, got SelConfig"),
        ("config", CmpConfig(block_m=2.5), TE,  # type: ignore[arg-type]
         "CmpConfig.block_m must be an int, got float 2.5"),
        ("v_cmp", kv_(300, tokens=N_CMP), VE, "head dims dk=16, dv=300 exceed 256"),
    ]),
    case("compressed_attention_triton", "k_cmp", "2 blocks", VE, "but k_cmp holds 2",
         lambda: compressed(compressed_attention_triton, k_cmp=kv_(DK, tokens=N_CMP - 1),
                            v_cmp=kv_(DV, tokens=N_CMP - 1))),
    case("compressed_attention_triton", "q", "float64", TE,
         "Triton compressed attention supports float16, bfloat16 and float32, got q of dtype "
         "torch.float64", lambda: compressed(compressed_attention_triton, F64)),
    *triton_rows("compressed_attention_triton",
                 lambda d: compressed(compressed_attention_triton, d)),
    *arg_rows("compressed_attention_triton_with_lse",
              lambda **o: compressed(compressed_attention_triton_with_lse, **o), [
        ("cmp_block", 4.0, TE, "cmp_block must be an int, got float 4.0"),
        ("q_start", -1, VE, "q_start must be >= 0, got -1"),
        ("scale", float("nan"), VE, "scale must be finite and > 0, got nan"),
    ]),
    *triton_rows("compressed_attention_triton_with_lse",
                 lambda d: compressed(compressed_attention_triton_with_lse, d)),
    *arg_rows("compressed_attention_fwd", lambda **o: compressed(compressed_attention_fwd, **o), [
        ("cmp_stride", 0, VE, "cmp_stride (0) must be >= 1"),
        ("cu_seqlens", torch.tensor([0, T]), TE, "cu_seqlens must be int32, got torch.int64"),
        ("config", "block_m=16", TE, "config must be a CmpConfig or None, got str"),
    ]),
    *triton_rows("compressed_attention_fwd", lambda d: compressed(compressed_attention_fwd, d)),
    *arg_rows("compressed_attention_bwd", compressed_bwd, [
        ("do", o_(dtype=F64), TE, "do dtype torch.float64 differs from q dtype torch.float32"),
        ("o", "o", TE, "o must be a torch.Tensor [B, Tq, HQ, dv], got str"),
        ("lse", lse_(heads=2), VE, "lse [1, 8, 2] must be [B, Tq, HQ] = [1, 8, 4]"),
        ("cmp_stride", 3, VE, "cmp_stride (3) must be >= 1 and divide cmp_block (4)"),
    ]),
    case("compressed_attention_bwd", "q", "bfloat16", TE, f"bfloat16 q {DOT}",
         lambda: compressed_bwd(BF16, lse=lse_()), "on"),
    # ---- the compressed and sliding adapters: cuDNN, FA-2, Flex, SDPA
    *arg_rows("compressed_attention_cudnn",
              lambda **o: compressed(compressed_attention_cudnn, **o), [
        ("cu_seqlens", torch.tensor([0, T], dtype=torch.int32), VE,
         "the cuDNN compressed backend takes dense inputs (no cu_seqlens)"),
        ("cmp_stride", 3, VE, "cmp_stride (3) must be >= 1 and divide cmp_block (4)"),
        ("v_cmp", kv_(DV, F64, N_CMP), TE, "v_cmp dtype torch.float64 differs from q dtype"),
    ]),
    *arg_rows("compressed_attention_cudnn_with_lse",
              lambda **o: compressed(compressed_attention_cudnn_with_lse, **o), [
        ("cu_seqlens", torch.tensor([0, T], dtype=torch.int32), VE,
         "the cuDNN compressed backend takes dense inputs (no cu_seqlens)"),
        ("cmp_block", 0, VE, "cmp_block must be >= 1, got 0"),
        ("q_start", 0.0, TE, "q_start must be an int, got float 0.0"),
    ]),
    *arg_rows("compressed_attention_fa2", lambda **o: compressed(compressed_attention_fa2, **o), [
        ("cmp_stride", 3, VE, "cmp_stride (3) must be >= 1 and divide cmp_block (4)"),
        ("k_cmp", rand(B, N_CMP, 3, DK), VE, "k_cmp [1, 3, 3, 16] and v_cmp [1, 3, 2, 16] differ"),
        ("scale", 0.0, VE, "scale must be finite and > 0, got 0.0"),
    ]),
    *arg_rows("sliding_attention_fa2", lambda **o: sliding(sliding_attention_fa2, **o), [
        ("window", 2.5, TE, "window must be an int, got float 2.5"),
        ("window", 0, VE, "window must be >= 1, got 0"),
        ("q_start", 1, VE, "need keys up to 8, but k holds 8 tokens"),
    ]),
    *arg_rows("compressed_attention_flex",
              lambda **o: compressed(compressed_attention_flex, **o), [
        ("cmp_block", 2.0, TE, "cmp_block must be an int, got float 2.0"),
        ("v_cmp", kv_(DV, tokens=1), VE, "k_cmp [1, 3, 2, 16] and v_cmp [1, 1, 2, 16] differ"),
        ("q", rand(B, T, 3, DK), VE, "query heads HQ=3 (q [1, 8, 3, 16]) must be a multiple"),
    ]),
    *arg_rows("sliding_attention_flex", lambda **o: sliding(sliding_attention_flex, **o), [
        ("window", True, TE, "window must be an int, got bool"),
        ("v", kv_(DV, F64), TE, "v dtype torch.float64 differs from q dtype"),
        ("v", rand(B, T, H, DV, device=META), VE, "v is on meta but q is on cpu"),
    ]),
    *arg_rows("compressed_attention_sdpa",
              lambda **o: compressed(compressed_attention_sdpa, **o), [
        ("cmp_stride", 8, VE, "cmp_stride (8) must be >= 1 and divide cmp_block (4)"),
        ("q_start", "0", TE, "q_start must be an int, got str"),
        ("v_cmp", rand(B, N_CMP, H, 0), VE, "head dim dv must be >= 1, got 0"),
    ]),
    *arg_rows("sliding_attention_sdpa", lambda **o: sliding(sliding_attention_sdpa, **o), [
        ("window", -1, VE, "window must be >= 1, got -1"),
        ("k", rand(B, T, H, DK + 1), VE, "head dims differ: q [1, 8, 4, 16] has dk=16"),
        ("cu_seqlens", torch.tensor([0, 3, T - 1], dtype=torch.int32), VE,
         "cu_seqlens must end at T=8, got 7"),
    ]),
    # ---- the sliding branch on Triton
    *arg_rows("sliding_attention_triton", lambda **o: sliding(sliding_attention_triton, **o), [
        ("window", 0, VE, "window must be >= 1, got 0"),
        ("config", ScoreConfig(), TE, "config must be a CmpConfig or None, got ScoreConfig"),
        ("config", CmpConfig(block_m=-1), VE, "CmpConfig.block_m must be >= 0 (0 = choose)"),
        ("k", kv_(DK, tokens=T - 1), VE, "k [1, 7, 2, 16] and v [1, 8, 2, 16] differ"),
    ]),
    case("sliding_attention_triton", "q", "float64", TE,
         "Triton sliding attention supports float16, bfloat16 and float32, got q of dtype "
         "torch.float64", lambda: sliding(sliding_attention_triton, F64)),
    *triton_rows("sliding_attention_triton", lambda d: sliding(sliding_attention_triton, d)),
    *arg_rows("sliding_attention_triton_with_local",
              lambda **o: sliding(sliding_attention_triton_with_local, **({"sel_block": 2} | o)), [
        ("sel_block", 2.5, TE, "sel_block must be an int, got float 2.5"),
        ("sel_block", 0, VE, "sel_block must be >= 1, got 0"),
        ("sel_block", 3, VE, "window=4 < 2 * sel_block=6: the window does not hold every"),
        ("window", 4.0, TE, "window must be an int, got float 4.0"),
    ]),
    *triton_rows("sliding_attention_triton_with_local",
                 lambda d: sliding(sliding_attention_triton_with_local, d, sel_block=2)),
    # ---- block scoring and its index contract
    *arg_rows("select_blocks_triton", scoring, [
        ("q", 3, TE, "q must be a torch.Tensor [B, T, HQ, dk], got int"),
        ("k_cmp", torch.zeros(N_CMP, H, DK), VE, "k_cmp must have rank 4 [B, T, H, dk]"),
        ("num_selected", 3.0, TE, "num_selected must be an int, got float 3.0"),
        ("sel_block", 5, VE, "cmp_stride (2) must divide sel_block (5)"),
        ("lse", lse_(dtype=F64), TE, "lse must be float32, got torch.float64"),
        ("config", SelConfig(), TE, "config must be a ScoreConfig or None, got SelConfig"),
        ("config", ScoreConfig(warps=True), TE, "ScoreConfig.warps must be an int, got bool"),
    ]),
    case("select_blocks_triton", "q", "dk=272", VE, "head dim dk=272 exceeds 256",
         lambda: scoring(q=rand(B, T, HQ, 272), k_cmp=rand(B, N_CMP, H, 272))),
    *triton_rows("select_blocks_triton", scoring),
    *arg_rows("check_index_contract", contract, [
        ("indices", indices_().float(), TE, "indices must hold integers, got torch.float32"),
        ("ref_scores", torch.zeros(B, T, H, 2, dtype=torch.int64), TE,
         "ref_scores must be a floating-point tensor, got torch.int64"),
        ("positions", torch.arange(T - 1), VE, "positions [7] must hold one position per row"),
        ("counts", torch.zeros(B, T, H, 1, dtype=torch.int32), VE, "counts must have rank 3"),
        ("sel_block", 0, VE, "sel_block must be >= 1, got 0"),
        ("rel_tol", -1e-3, VE, "rel_tol must be finite and >= 0, got -0.001"),
        ("exact_ties", 1, TE, "exact_ties must be a bool, got int 1"),
    ]),
    # ---- the gated combine and the three-way sum
    *arg_rows("gated_combine_triton", combine, [
        ("gates", torch.rand(B, T, HQ, 2), VE, "gates [1, 8, 4, 2] must be [B, T, HQ, 3]"),
        ("o_sel", o_(dtype=F64), TE, "o_sel dtype torch.float64 differs from o_cmp dtype"),
        ("o_win", o_(dtype=F32)[:, :-1], VE, "o_win [1, 7, 4, 16] differs from o_cmp"),
    ]),
    case("gated_combine_triton", "o_cmp", "float64", TE,
         "Triton gated combine supports float16, bfloat16 and float32, got o_cmp of dtype "
         "torch.float64", lambda: combine(F64)),
    case("gated_combine_triton", "o_cmp", "cpu", VE, f"o_cmp {ON_CPU}", lambda: combine(), "off"),
    *arg_rows("sum3_triton", sum3, [
        ("a", "x", TE, "a must be a torch.Tensor, got str"),
        ("c", o_(8), VE, "c [1, 8, 4, 8] differs from a [1, 8, 4, 16]"),
        ("c", o_(dtype=torch.float16), TE, "c dtype torch.float16 differs from a dtype"),
    ]),
    case("sum3_triton", "a", "bfloat16", TE, f"bfloat16 a {ROUNDING}", lambda: sum3(BF16), "on"),
    case("sum3_triton", "a", "cpu", VE, f"a {ON_CPU}", lambda: sum3(), "off"),
    # ---- rotary embedding
    *arg_rows("apply_rope_triton", rope, [
        ("x", q_()[..., :15], VE, "rotary head_dim must be even"),
        ("positions", torch.arange(T).float(), TE, "positions must hold integers"),
        ("theta", 0.0, VE, "theta must be finite and > 0, got 0.0"),
    ]),
    case("apply_rope_triton", "x", "float64", TE,
         "Triton rotary embedding supports float16, bfloat16 and float32, got x of dtype "
         "torch.float64", lambda: rope(F64)),
    case("apply_rope_triton", "x", "bfloat16", TE, f"bfloat16 x {ROUNDING}", lambda: rope(BF16),
         "on"),
    case("apply_rope_triton", "x", "cpu", VE, f"x {ON_CPU}", lambda: rope(), "off"),
    # ---- decode: the state, the plan, the step, the graph, the layer
    *arg_rows("DecodeState.empty", empty, [
        ("config", None, TE, "config must be an NSAConfig, got NoneType"),
        ("batch", 0, VE, "batch must be >= 1, got 0"),
        ("capacity", 2.5, TE, "capacity must be an int, got float 2.5"),
        ("capacity", 2**31, VE, "capacity must be <= 2147483647"),
        ("dtype", torch.int32, TE, "dtype must be a floating-point torch.dtype"),
        ("device", "nowhere", VE, "device 'nowhere' is not a device"),
        ("device", 3.5, TE, "device must be a torch.device or a str, got float"),
    ]),
    case("DecodeState.from_cache", "cache", None, TE, "cache must be an NSACache, got NoneType",
         lambda: DecodeState.from_cache(None, 16)),  # type: ignore[arg-type]
    case("DecodeState.from_cache", "capacity", 2.5, TE, "capacity must be an int, got float",
         lambda: DecodeState.from_cache(cache_(), 2.5)),  # type: ignore[arg-type]
    case("DecodeState.from_cache", "capacity", 2, VE, "capacity 2 is below the cache length 5",
         lambda: DecodeState.from_cache(cache_(), 2)),
    *arg_rows("DecodeState.from_prefixes", from_prefixes, [
        ("config", "small", TE, "config must be an NSAConfig, got str"),
        ("k", {"cmp": kv_(), "sel": kv_()}, TE, "k must be a mapping with keys ['cmp', 'sel',"),
        ("v", branches(DV, win=kv_(8)), VE, "v['win'] [1, 8, 2, 8] must be [B, T, H, dv]"),
        ("v", branches(DV, F64), TE, "v['cmp'] dtype torch.float64 differs from k['sel'] dtype"),
        ("lengths", [5.0], TE, "lengths must hold ints, got float 5.0"),
        ("lengths", [9], VE, "lengths [9] must lie in [0, 8]"),
        ("lengths", [3, 4], VE, "2 lengths for a batch of 1"),
        ("capacity", 0, VE, "capacity must be >= 1, got 0"),
        ("phi_k", "mlp", TE, "phi_k must be None or a callable"),
    ]),
    *arg_rows("block_phi", lambda module: block_phi(module), [
        ("module", None, TE, "module must be callable (e.g. a CompressMLP), got NoneType"),
        ("module", "mlp", TE, "module must be callable (e.g. a CompressMLP), got str"),
        ("module", 3, TE, "module must be callable (e.g. a CompressMLP), got int"),
    ]),
    case("DecodePlan", "state", None, TE, "state must be a DecodeState, got NoneType",
         lambda: DecodePlan(None)),  # type: ignore[arg-type]
    case("DecodePlan", "config", "dict", TE, "config must be a DecodeKernelConfig or None",
         lambda: DecodePlan(state_(), {"key_tile": 16})),  # type: ignore[arg-type]
    case("DecodePlan", "config", "key_tile=24", VE, "key_tile=24 must be 0 or a power of two",
         lambda: DecodePlan(state_(), paper_config_with(key_tile=24))),
    case("DecodePlan", "config", "warps=4.0", TE, "DecodeKernelConfig.warps must be an int",
         lambda: DecodePlan(state_(), paper_config_with(warps=4.0))),
    case("DecodePlan", "state", "float64", TE,
         "Triton decode supports float16, bfloat16 and float32, got state of dtype torch.float64",
         lambda: DecodePlan(state_(F64))),
    *arg_rows("decode_step", step, [
        ("inputs", None, TE, "inputs must be a StepInputs, got NoneType"),
        ("inputs", inputs_with(q=rand(B, 1, DK)), VE, "q [1, 1, 16] must be [1, 4, 16]"),
        ("inputs", inputs_with(gates=torch.rand(B, HQ, 3, dtype=F64)), TE, "gates dtype"),
        ("plan", "fast", TE, "plan must be a DecodePlan or None, got str"),
        ("phi_k", lambda x: x[..., 0, :], VE, "config.phi == 'avg' compresses by the mean"),
        ("state", None, TE, "state must be a DecodeState, got NoneType"),
    ]),
    case("decode_step", "state", "bfloat16", TE, f"bfloat16 state {DOT}", lambda: step(BF16), "on"),
    case("decode_step", "state", "cpu", VE, f"state {ON_CPU}", lambda: step(), "off"),
    case("DecodeGraph", "state", None, TE, "state must be a DecodeState, got NoneType",
         lambda: DecodeGraph(None)),  # type: ignore[arg-type]
    case("DecodeGraph", "warmup", 0, VE, "warmup must be >= 1, got 0",
         lambda: DecodeGraph(state_(), warmup=0)),
    case("DecodeGraph", "warmup", 1.5, TE, "warmup must be an int, got float 1.5",
         lambda: DecodeGraph(state_(), warmup=1.5)),  # type: ignore[arg-type]
    case("DecodeGraph", "state", "cpu", VE, "CUDA graphs need a CUDA state, got cpu",
         lambda: DecodeGraph(state_())),
    *arg_rows("LayerDecoder", decoder, [
        ("module", None, TE, "module must be an NSAAttention, got NoneType"),
        ("state", "state", TE, "state must be a DecodeState, got str"),
        ("graph", "yes", TE, "graph must be a bool, got str 'yes'"),
        ("warmup", 0, VE, "warmup must be >= 1, got 0"),
        ("state", state_(config=decode_config(window=8)), VE,
         "module.config differs from the state's config"),
        ("config", DecodeKernelConfig(sel_tile=8), VE, "sel_tile=8 must be 0 or a power of two"),
    ]),
    case("LayerDecoder.prefill", "module", None, TE, "module must be an NSAAttention",
         lambda: LayerDecoder.prefill(None, rand(B, 5, HIDDEN), 16)),  # type: ignore[arg-type]
    case("LayerDecoder.prefill", "capacity", 0, VE, "capacity must be >= 1, got 0",
         lambda: LayerDecoder.prefill(layer_(), rand(B, 5, HIDDEN), 0)),
    case("LayerDecoder.prefill", "capacity", 2.5, TE, "capacity must be an int, got float",
         lambda: LayerDecoder.prefill(layer_(), rand(B, 5, HIDDEN), 2.5)),  # type: ignore[arg-type]
    case("LayerDecoder.prefill", "graph", 1, TE, "graph must be a bool, got int 1",
         lambda: LayerDecoder.prefill(layer_(), rand(B, 5, HIDDEN), 16, graph=1)),  # type: ignore[arg-type]
    *arg_rows("LayerDecoder.step", lambda x: decoder_step(x), [
        ("x", rand(B, 1, HIDDEN), VE, "x must have rank 2 [B, hidden]"),
        ("x", rand(B, HIDDEN, dtype=F64), TE, "x dtype torch.float64 differs from the state dtype"),
        ("x", rand(B, HIDDEN + 1), VE, "x [1, 17] must be [B, hidden] = [1, 16]"),
        ("x", "token", TE, "x must be a torch.Tensor [B, hidden], got str"),
    ]),
    # ---- tiles, the version check, the registration
    *arg_rows("parse_config", lambda text: parse_config(text), [
        ("text", 64, TE, "text must be a str such as 'block_l=64', got int"),
        ("text", "block=64", VE, "unknown SelConfig field 'block'"),
        ("text", "block_l=x", VE, "SelConfig field 'block_l' needs an int, got 'x'"),
        ("text", "block_l=-16", VE, "SelConfig.block_l must be >= 0 (0 = choose), got -16"),
    ]),
    *arg_rows("pairing", lambda **o: pairing(**({"torch_version": "2.13.0",
                                                 "triton_version": "3.7.1"} | o)), [
        ("torch_version", 2.13, TE, "torch_version must be a str or None, got float 2.13"),
        ("triton_version", 3, TE, "triton_version must be a str or None, got int 3"),
        ("torch_version", b"2.13.0", TE, "torch_version must be a str or None, got bytes"),
    ]),
    *arg_rows("register", lambda register_backend: register(register_backend), [
        ("register_backend", None, TE, "register_backend must be callable"),
        ("register_backend", "registry", TE, "register_backend must be callable"),
        ("register_backend", [], TE, "register_backend must be callable"),
    ]),
]
# fmt: on


def entry_name(dotted: str) -> str:
    """``"nsa_kernels.decode:DecodeState.empty"`` -> ``"DecodeState.empty"``."""
    return dotted.split(":")[1]


def test_every_public_entry_point_exists_and_has_three_rows() -> None:
    counts: dict[str, int] = {}
    for row in CASES:
        counts[row.entry] = counts.get(row.entry, 0) + 1
    names = [entry_name(dotted) for dotted in PUBLIC_ENTRY_POINTS]
    assert len(set(names)) == len(names), "entry point names are distinct without their module"
    for dotted in PUBLIC_ENTRY_POINTS:
        module, qualname = dotted.split(":")
        target: Any = importlib.import_module(module)
        for part in qualname.split("."):
            target = getattr(target, part)
        assert callable(target), dotted
        assert counts.get(entry_name(dotted), 0) >= 3, f"{dotted} has fewer than three rows"
    assert set(counts) <= set(names), f"rows of unlisted entries: {set(counts) - set(names)}"


def test_table_rows_are_unique() -> None:
    ids = [row.id for row in CASES]
    assert len(set(ids)) == len(ids), "every row names a distinct (entry, argument, value)"


@pytest.mark.parametrize("row", CASES, ids=lambda c: c.id)
def test_bad_input_is_refused(row: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    if row.interpreter == "on":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    elif row.interpreter == "off":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    # Any other exception type (AttributeError, a launch's RuntimeError, ...) escapes and fails.
    with pytest.raises(row.error) as info:
        row.call()
    assert type(info.value) is row.error, f"{type(info.value).__name__}: {info.value}"
    assert row.fragment in str(info.value)
