"""Selected-branch attention forward on the experimental CUDA kernel (``csrc/sel_fwd.cu``)."""

from __future__ import annotations

import torch
from torch import Tensor

from nsa_core.checks import check_selected_attention
from nsa_kernels.common.op_calls import SelectedBackend, SelectedCall
from nsa_kernels.selected.cuda.build import load_extension

CUDA_SEL_DTYPES = (torch.float16, torch.bfloat16)
CUDA_SEL_MAX_HEAD_DIM = 256


def sequence_starts(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """int32 [T]: for each packed token, the packed index where its sequence starts."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    return torch.repeat_interleave(cu_seqlens[:-1], lengths).to(torch.int32).contiguous()


def _cuda(q: Tensor, k: Tensor, v: Tensor, block_indices: Tensor, call: SelectedCall) -> Tensor:
    """nsa_core ``selected_attention`` on the CUDA kernel (forward only).

    q [B, Tq, HQ, dk], k [B, Tk, H, dk], v [B, Tk, H, dv] (fp16 or bf16, CUDA), block_indices
    [B, Tq, H, n] int32/int64 (-1 padded) -> o [B, Tq, HQ, dv]. Query t (= q_start + row, or its
    position inside its packed sequence) attends to the union of the tokens p <= t of its selected
    blocks of sel_block tokens. Varlen: B == 1, int32 cu_seqlens [S+1], q_start == 0, Tk == Tq.

    Called by name (``call.validated`` False) it checks the op's rules (nsa_core's
    ``check_selected_attention``), then its own: float16 or bfloat16 (TypeError), CUDA tensors,
    even head dims up to 256 (ValueError). Raises RuntimeError when gradients are required (the
    kernel has no backward) or when the extension cannot be built here.
    """
    sel_block, q_start, cu_seqlens = call.sel_block, call.q_start, call.cu_seqlens
    if not call.validated:
        check_selected_attention(
            q, k, v, block_indices, sel_block, call.scale, q_start=q_start, cu_seqlens=cu_seqlens
        )
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise RuntimeError(
            "cuda_sel is forward only and these inputs require grad; "
            "call it under torch.no_grad() or use another selected_attention backend"
        )
    if not call.validated:
        check_cuda_sel_inputs(q, v)
    scale = q.shape[-1] ** -0.5 if call.scale is None else call.scale
    seq_start = None if cu_seqlens is None else sequence_starts(cu_seqlens)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    indices = block_indices.to(torch.int32)
    if indices.stride(-1) != 1:
        indices = indices.contiguous()
    ext = load_extension()
    out: torch.Tensor = ext.sel_fwd(q, k, v, indices, seq_start, sel_block, float(scale), q_start)
    return out


def check_cuda_sel_inputs(q: Tensor, v: Tensor) -> None:
    """What the kernel takes beyond the op's rules: float16/bfloat16 CUDA tensors, even head dims
    up to CUDA_SEL_MAX_HEAD_DIM."""
    if q.dtype not in CUDA_SEL_DTYPES:
        raise TypeError(f"cuda_sel takes float16 or bfloat16, got q of dtype {q.dtype}")
    if q.device.type != "cuda":
        raise ValueError(f"q is on {q.device}: cuda_sel runs on CUDA tensors")
    dk, dv = q.shape[3], v.shape[3]
    if dk % 2 or dv % 2 or max(dk, dv) > CUDA_SEL_MAX_HEAD_DIM:
        raise ValueError(
            f"cuda_sel needs even head dims <= {CUDA_SEL_MAX_HEAD_DIM}, got dk={dk}, dv={dv}"
        )


# nsa_core's selected_attention on the CUDA kernel, with its signature.
selected_attention_cuda = SelectedBackend(_cuda)
