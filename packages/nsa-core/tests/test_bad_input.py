"""Bad input is refused with an error that names the argument (and its shape); rows with nothing
visible give finite outputs and gradients, never NaN."""

from __future__ import annotations

import itertools
import re
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
    compress,
    compressed_attention,
    gated_combine,
    reference,
    select_blocks,
    selected_attention,
    sliding_attention,
    split_blocks,
    topn_blocks,
)
from nsa_core.reference.common import query_chunk


def call_op(op: str, **over: Any) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Run ``op`` on the valid inputs with some of them replaced by ``over``."""
    q = over.pop("q", rand(B, T, HQ, DK))
    cu = over.pop("cu_seqlens", None)
    if op == "sliding_attention":
        k = over.pop("k", rand(B, T, H, DK))
        v = over.pop("v", rand(B, T, H, DV))
        return sliding_attention(q, k, v, over.pop("window", W), cu_seqlens=cu, **over)
    if op == "selected_attention":
        k = over.pop("k", rand(B, T, H, DK))
        v = over.pop("v", rand(B, T, H, DV))
        idx = over.pop("block_indices", valid_indices())
        return selected_attention(q, k, v, idx, L_SEL, cu_seqlens=cu, **over)
    if op == "compressed_attention":
        k = over.pop("k", rand(B, N_CMP, H, DK))
        v = over.pop("v", rand(B, N_CMP, H, DV))
        stride = over.pop("cmp_stride", D_CMP)
        return compressed_attention(q, k, v, L_CMP, stride, cu_seqlens=cu, **over)
    if op == "select_blocks":
        k = over.pop("k", rand(B, N_CMP, H, DK))
        over.pop("v", None)  # selection reads keys only
        return select_blocks(q, k, L_CMP, D_CMP, L_SEL, N_SEL, cu_seqlens=cu, **over)
    raise AssertionError(op)


ATTENTION_OPS = ["sliding_attention", "selected_attention", "compressed_attention"]
K_NAME = {"sliding_attention": "k", "selected_attention": "k", "compressed_attention": "k_cmp"}
V_NAME = {"sliding_attention": "v", "selected_attention": "v", "compressed_attention": "v_cmp"}
K_TOKENS = {"sliding_attention": T, "selected_attention": T, "compressed_attention": N_CMP}


def shp(*dims: int) -> str:
    return re.escape("[" + ", ".join(str(d) for d in dims) + "]")


# ------------------------------------------------------------------------------ attention ops


@pytest.mark.parametrize("op", ATTENTION_OPS)
def test_wrong_rank(op: str) -> None:
    k, v, nk = K_NAME[op], V_NAME[op], K_TOKENS[op]
    with pytest.raises(ValueError, match=r"q must have rank 4 .*got shape " + shp(B, T, HQ * DK)):
        call_op(op, q=rand(B, T, HQ * DK))
    with pytest.raises(ValueError, match=rf"{k} must have rank 4 .*got shape " + shp(nk, H, DK)):
        call_op(op, k=rand(nk, H, DK))
    with pytest.raises(
        ValueError, match=rf"{v} must have rank 4 .*got shape " + shp(B, nk, H, DV, 1)
    ):
        call_op(op, v=rand(B, nk, H, DV, 1))


@pytest.mark.parametrize("op", [*ATTENTION_OPS, "select_blocks"])
def test_not_a_tensor(op: str) -> None:
    with pytest.raises(TypeError, match=r"q must be a torch.Tensor .*got list"):
        call_op(op, q=[[1.0]])


@pytest.mark.parametrize("op", ATTENTION_OPS)
def test_query_heads_not_multiple_of_kv_heads(op: str) -> None:
    nk = K_TOKENS[op]
    hq, h = 5, 2
    message = (
        rf"query heads HQ={hq} \(q {shp(B, T, hq, DK)}\) must be a multiple of kv heads H={h} "
        rf"\({K_NAME[op]} {shp(B, nk, h, DK)}\)"
    )
    with pytest.raises(ValueError, match=message):
        call_op(op, q=rand(B, T, hq, DK))


@pytest.mark.parametrize("op", ATTENTION_OPS)
def test_keys_and_values_disagree_in_tokens_or_heads(op: str) -> None:
    k, v, nk = K_NAME[op], V_NAME[op], K_TOKENS[op]
    message = rf"{k} {shp(B, nk, H, DK)} and {v} {shp(B, nk - 1, H, DV)} differ in tokens or heads"
    with pytest.raises(ValueError, match=message):
        call_op(op, v=rand(B, nk - 1, H, DV))
    message = rf"{k} {shp(B, nk, H, DK)} and {v} {shp(B, nk, 1, DV)} differ in tokens or heads"
    with pytest.raises(ValueError, match=message):
        call_op(op, v=rand(B, nk, 1, DV))


@pytest.mark.parametrize("op", ATTENTION_OPS)
def test_batch_sizes_differ(op: str) -> None:
    nk = K_TOKENS[op]
    with pytest.raises(ValueError, match=r"batch sizes differ: q " + shp(B, T, HQ, DK)):
        call_op(op, k=rand(2, nk, H, DK), v=rand(2, nk, H, DV))


@pytest.mark.parametrize("op", ATTENTION_OPS)
def test_head_dims_differ(op: str) -> None:
    k, nk = K_NAME[op], K_TOKENS[op]
    message = rf"head dims differ: q {shp(B, T, HQ, DK)} has dk={DK}, {k} {shp(B, nk, H, DK - 2)}"
    with pytest.raises(ValueError, match=message):
        call_op(op, k=rand(B, nk, H, DK - 2))


@pytest.mark.parametrize("op", ["sliding_attention", "selected_attention"])
def test_more_queries_than_keys(op: str) -> None:
    """Queries at [0, T) need keys [0, T): T differs between q and k/v."""
    message = (
        rf"queries at positions \[0, {T}\) need keys up to {T - 1}, but k holds {T - 2} tokens"
    )
    with pytest.raises(ValueError, match=message):
        call_op(op, k=rand(B, T - 2, H, DK), v=rand(B, T - 2, H, DV))
    with pytest.raises(ValueError, match=r"q_start must be >= 0, got -1"):
        call_op(op, q_start=-1)


@pytest.mark.parametrize("op", ["compressed_attention", "select_blocks"])
def test_too_few_compressed_blocks(op: str) -> None:
    message = rf"queries up to position {T - 1} see {N_CMP} compressed blocks, but k_cmp holds 2"
    with pytest.raises(ValueError, match=message):
        call_op(op, k=rand(B, 2, H, DK), v=rand(B, 2, H, DV))


@pytest.mark.parametrize("op", ATTENTION_OPS)
@pytest.mark.parametrize("which", ["k", "v"])
def test_dtype_mismatch(op: str, which: str) -> None:
    name = K_NAME[op] if which == "k" else V_NAME[op]
    dim = DK if which == "k" else DV
    bad = rand(B, K_TOKENS[op], H, dim, dtype=torch.float64)
    message = rf"{name} dtype torch.float64 differs from q dtype torch.float32"
    with pytest.raises(TypeError, match=message):
        call_op(op, **{which: bad})


@pytest.mark.parametrize("op", ATTENTION_OPS)
def test_integer_inputs(op: str) -> None:
    nk = K_TOKENS[op]
    q = torch.ones(B, T, HQ, DK, dtype=torch.int64)
    k = torch.ones(B, nk, H, DK, dtype=torch.int64)
    v = torch.ones(B, nk, H, DV, dtype=torch.int64)
    with pytest.raises(TypeError, match=r"q must be a floating-point tensor, got torch.int64"):
        call_op(op, q=q, k=k, v=v)


@pytest.mark.parametrize("op", ATTENTION_OPS)
@pytest.mark.parametrize("which", ["k", "v"])
def test_device_mismatch(op: str, which: str) -> None:
    """'meta' stands in for a second device: the check must fire before any compute."""
    name = K_NAME[op] if which == "k" else V_NAME[op]
    dim = DK if which == "k" else DV
    bad = rand(B, K_TOKENS[op], H, dim, device="meta")
    with pytest.raises(ValueError, match=rf"{name} is on meta but q is on cpu"):
        call_op(op, **{which: bad})


@pytest.mark.parametrize("op", ATTENTION_OPS)
def test_query_on_other_device(op: str) -> None:
    with pytest.raises(ValueError, match=rf"{K_NAME[op]} is on cpu but q is on meta"):
        call_op(op, q=rand(B, T, HQ, DK, device="meta"))


def test_window_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"window must be >= 1, got 0"):
        call_op("sliding_attention", window=0)


# ------------------------------------------------------------------------------ block indices


@pytest.mark.parametrize("bad_value", [N_BLOCKS, N_BLOCKS + 5, -2])
def test_block_indices_out_of_range(bad_value: int) -> None:
    idx = valid_indices()
    idx[0, T - 1, 1, 2] = bad_value
    lo, hi = min(-1, bad_value), max(N_BLOCKS - 1, bad_value)
    message = rf"block_indices must lie in \[-1, {N_BLOCKS}\).*got values in \[{lo}, {hi}\]"
    with pytest.raises(ValueError, match=message):
        call_op("selected_attention", block_indices=idx)


def test_block_indices_dtype() -> None:
    with pytest.raises(TypeError, match=r"block_indices must be int32 or int64, got torch.float32"):
        call_op("selected_attention", block_indices=valid_indices().float())


def test_block_indices_shape() -> None:
    idx = torch.zeros(B, T, HQ, N_SEL, dtype=torch.int32)  # per query head instead of per group
    message = rf"block_indices {shp(B, T, HQ, N_SEL)} must be \[B={B}, T={T}, H={H}, n\]"
    with pytest.raises(ValueError, match=message):
        call_op("selected_attention", block_indices=idx)
    with pytest.raises(ValueError, match=r"block_indices must have rank 4 .*" + shp(B, T, H)):
        call_op("selected_attention", block_indices=torch.zeros(B, T, H, dtype=torch.int32))


def test_block_indices_device() -> None:
    idx = valid_indices().to("meta")
    with pytest.raises(ValueError, match=r"block_indices is on meta but q is on cpu"):
        call_op("selected_attention", block_indices=idx)


VARLEN_CU = [0, 3, 3, T]  # sequences of 3, 0 and 5 tokens: 1, 0 and 2 blocks of l'=4


def varlen_indices() -> torch.Tensor:
    """[1, T, H, n] for VARLEN_CU: each row's block 0 and its current block, in its sequence."""
    local = torch.tensor([0, 1, 2, 0, 1, 2, 3, 4])  # each token's position in its sequence
    idx = torch.full((B, T, H, N_SEL), -1, dtype=torch.int32)
    idx[..., 0] = 0
    idx[..., 1] = (local // L_SEL).view(1, T, 1).to(torch.int32)
    return idx


@pytest.mark.parametrize(
    ("token", "value", "message"),
    [
        # Block 1 exists in the packed T=8 but not in sequence 0 (3 tokens).
        (2, 1, r"must lie in \[-1, 1\) in sequence 0 \(tokens \[0, 3\) .*got 1 at token 2"),
        # Sequence 2 follows an empty sequence: its rows are checked against its 2 blocks.
        (3, 2, r"must lie in \[-1, 2\) in sequence 2 \(tokens \[3, 8\) .*got 2 at token 3"),
        (7, -2, r"must lie in \[-1, 2\) in sequence 2 \(tokens \[3, 8\) .*got -2 at token 7"),
    ],
)
@pytest.mark.parametrize("entry", ["ops", "reference"])
def test_varlen_block_indices_are_checked_per_sequence(
    entry: str, token: int, value: int, message: str
) -> None:
    """Varlen indices count the blocks of their own sequence (docs/spec.md, "Argument rules"):
    each row's entries lie in [-1, ceil(L_s / l')), not in the packed T's range."""
    fn = selected_attention if entry == "ops" else reference.selected_attention
    idx = varlen_indices()
    idx[0, token, 1, 2] = value
    cu = torch.tensor(VARLEN_CU, dtype=torch.int32)
    with pytest.raises(ValueError, match=message + r", kv head 1"):
        fn(rand(B, T, HQ, DK), rand(B, T, H, DK), rand(B, T, H, DV), idx, L_SEL, cu_seqlens=cu)


def test_varlen_block_index_valid_in_its_sequence_is_accepted() -> None:
    """Block 1 of sequence 2 (tokens [3, 8)) is accepted in its rows, and each sequence's rows
    equal a call on that sequence alone."""
    q = rand(B, T, HQ, DK, dtype=torch.float64)
    k = rand(B, T, H, DK, dtype=torch.float64)
    v = rand(B, T, H, DV, dtype=torch.float64)
    idx = varlen_indices()
    idx[0, 3, :, 2] = 1  # position 0 of sequence 2: block 1 lies in its future, selects nothing
    cu = torch.tensor(VARLEN_CU, dtype=torch.int32)
    out = selected_attention(q, k, v, idx, L_SEL, cu_seqlens=cu)
    for start, end in itertools.pairwise(VARLEN_CU):
        alone = selected_attention(
            q[:, start:end], k[:, start:end], v[:, start:end], idx[:, start:end], L_SEL
        )
        assert torch.equal(out[:, start:end], alone)


def test_a_later_block_index_selects_nothing_in_every_query_chunk() -> None:
    """The reference runs a long call in chunks of queries whose keys end at the chunk's last
    position; a valid index of a later block (row 0 naming the last block) selects nothing in
    every chunk, as -1 does, instead of indexing past the chunk's blocks."""
    hq, h, t = 16, 4, 1100  # 16 * 1100^2 elements > CHUNK_ELEMENTS: several query chunks
    assert query_chunk(hq * t) < t
    q, k, v = rand(B, t, hq, DK), rand(B, t, h, DK), rand(B, t, h, DV)
    idx = torch.full((B, t, h, N_SEL), -1, dtype=torch.int32)
    idx[..., 0] = 0
    idx[..., 1] = (torch.arange(t) // L_SEL).view(1, t, 1).to(torch.int32)
    later = idx.clone()
    later[0, 0, :, 2] = t // L_SEL - 1
    out = selected_attention(q, k, v, later, L_SEL)
    assert torch.equal(out, selected_attention(q, k, v, idx, L_SEL))


def test_topn_scores_too_few_blocks() -> None:
    scores = torch.zeros(B, T, H, 1)
    with pytest.raises(ValueError, match=r"scores \[1, 8, 2, 1\] hold 1 blocks.*need 2"):
        topn_blocks(scores, N_SEL, L_SEL)
    with pytest.raises(ValueError, match=r"scores must have rank 4"):
        topn_blocks(torch.zeros(T, H, 2), N_SEL, L_SEL)


# ------------------------------------------------------------------------------ cu_seqlens

CU_OPS = [*ATTENTION_OPS, "select_blocks", "compress", "module"]

CU_CASES: list[tuple[str, Any, type[Exception], str]] = [
    ("int64", torch.tensor([0, 3, T], dtype=torch.int64), TypeError,
     r"cu_seqlens must be int32, got torch.int64"),
    ("float", torch.tensor([0.0, 3.0, T]), TypeError,
     r"cu_seqlens must be int32, got torch.float32"),
    ("list", [0, 3, T], TypeError, r"cu_seqlens must be an int32 tensor, got list"),
    ("start", torch.tensor([1, 3, T], dtype=torch.int32), ValueError,
     r"cu_seqlens must start at 0, got 1"),
    ("decreasing", torch.tensor([0, 6, 4, T], dtype=torch.int32), ValueError,
     r"cu_seqlens must be non-decreasing, got \[0, 6, 4, 8\]"),
    ("short-end", torch.tensor([0, 3, T - 1], dtype=torch.int32), ValueError,
     rf"cu_seqlens must end at T={T}, got {T - 1}"),
    ("long-end", torch.tensor([0, 3, T + 4], dtype=torch.int32), ValueError,
     rf"cu_seqlens must end at T={T}, got {T + 4}"),
    ("2d", torch.tensor([[0, 3, T]], dtype=torch.int32), ValueError,
     r"cu_seqlens must be 1-D with at least 2 entries, got \[1, 3\]"),
    ("one-entry", torch.tensor([0], dtype=torch.int32), ValueError,
     r"cu_seqlens must be 1-D with at least 2 entries, got \[1\]"),
    ("device", torch.tensor([0, 3, T], dtype=torch.int32, device="meta"), ValueError,
     r"cu_seqlens is on meta but q is on cpu"),
]  # fmt: skip


def call_with_cu(op: str, cu: Any, batch: int = B, n_cmp: int = N_CMP) -> Any:
    if op == "compress":
        return compress(rand(batch, T, H, DK), L_CMP, D_CMP, cu_seqlens=cu)
    if op == "module":
        layer = NSAAttention(config(), HIDDEN)
        return layer(rand(batch, T, HIDDEN), cu_seqlens=cu)
    over: dict[str, Any] = {"q": rand(batch, T, HQ, DK), "cu_seqlens": cu}
    if op in ("compressed_attention", "select_blocks"):
        over["k"] = rand(batch, n_cmp, H, DK)
        if op == "compressed_attention":
            over["v"] = rand(batch, n_cmp, H, DV)
    else:
        over["k"] = rand(batch, T, H, DK)
        over["v"] = rand(batch, T, H, DV)
        if op == "selected_attention":
            over["block_indices"] = valid_indices(batch)
    return call_op(op, **over)


@pytest.mark.parametrize("op", CU_OPS)
@pytest.mark.parametrize(("case", "cu", "error", "message"), CU_CASES, ids=[c[0] for c in CU_CASES])
def test_malformed_cu_seqlens(
    op: str, case: str, cu: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        call_with_cu(op, cu)


@pytest.mark.parametrize("op", CU_OPS)
def test_varlen_needs_batch_one(op: str) -> None:
    cu = torch.tensor([0, 3, T], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens.*B == 1, got B=2|B == 1, got B=2"):
        call_with_cu(op, cu, batch=2)


@pytest.mark.parametrize("op", CU_OPS)
def test_valid_cu_seqlens_accepted(op: str) -> None:
    """The same calls with a well-formed cu_seqlens (an empty sequence included) succeed.

    Lengths 3, 0, 5 hold 0, 0, 1 compressed blocks (l=4, d=2).
    """
    call_with_cu(op, torch.tensor([0, 3, 3, T], dtype=torch.int32), n_cmp=1)


# ------------------------------------------------------------------------------ block geometry


@pytest.mark.parametrize(("cmp_block", "cmp_stride"), [(4, 3), (6, 4), (4, 0)])
def test_stride_must_divide_cmp_block_in_ops(cmp_block: int, cmp_stride: int) -> None:
    message = rf"cmp_stride \({cmp_stride}\) must be >= 1 and divide cmp_block \({cmp_block}\)"
    with pytest.raises(ValueError, match=message):
        split_blocks(rand(B, T, H, DK), cmp_block, cmp_stride)
    with pytest.raises(ValueError, match=message):
        compress(rand(B, T, H, DK), cmp_block, cmp_stride)
    with pytest.raises(ValueError, match=message):
        compressed_attention(
            rand(B, T, HQ, DK), rand(B, 1, H, DK), rand(B, 1, H, DV), cmp_block, cmp_stride
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"cmp_block": 32, "cmp_stride": 12},
            r"NSAConfig.cmp_stride \(12\) must divide cmp_block \(32\)",
        ),
        ({"sel_block": 72}, r"NSAConfig.cmp_stride \(16\) must divide sel_block \(72\)"),
        ({"num_selected": 2}, r"NSAConfig.num_selected must be >= 3"),
    ],
)
def test_config_geometry(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        NSAConfig(**kwargs)


def test_compress_rank() -> None:
    with pytest.raises(
        ValueError, match=r"x must have rank 4 \[B, T, H, D\], got shape \[8, 2, 8\]"
    ):
        compress(rand(T, H, DK), L_CMP, D_CMP)


def test_gated_combine_shapes() -> None:
    o = rand(B, T, HQ, DV)
    with pytest.raises(ValueError, match=r"gates \[1, 8, 4, 2\] must be \[B, T, HQ, 3\]"):
        gated_combine(o, o, o, rand(B, T, HQ, 2))
    with pytest.raises(ValueError, match=r"o_sel \[1, 8, 4, 5\] differs from o_cmp \[1, 8, 4, 6\]"):
        gated_combine(o, rand(B, T, HQ, DV - 1), o, rand(B, T, HQ, 3))
    with pytest.raises(ValueError, match=r"o_win must have rank 4"):
        gated_combine(o, o, rand(T, HQ, DV), rand(B, T, HQ, 3))


# ------------------------------------------------------------------------------ the module


def test_module_bad_x() -> None:
    layer = NSAAttention(config(), HIDDEN)
    with pytest.raises(
        ValueError, match=r"x must have rank 3 \[B, T, hidden\], got shape \[8, 16\]"
    ):
        layer(rand(T, HIDDEN))
    with pytest.raises(ValueError, match=r"x \[1, 8, 12\] must end in hidden_size=16"):
        layer(rand(B, T, 12))
    with pytest.raises(
        TypeError, match=r"x dtype torch.float64 differs from the layer's torch.float32"
    ):
        layer(rand(B, T, HIDDEN, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"x is on meta but the layer is on cpu"):
        layer(rand(B, T, HIDDEN, device="meta"))
    with pytest.raises(ValueError, match=r"x must have rank 3"):
        layer.prefill(rand(T, HIDDEN))


def test_module_hidden_size() -> None:
    with pytest.raises(ValueError, match=r"hidden_size must be >= 1, got 0"):
        NSAAttention(config(), 0)


def test_decode_bad_input() -> None:
    layer = NSAAttention(config(), HIDDEN)
    _, cache = layer.prefill(rand(2, 5, HIDDEN))
    with pytest.raises(ValueError, match=r"decode takes one token per sequence, x \[2, 2, 16\]"):
        layer.decode(rand(2, 2, HIDDEN), cache)
    with pytest.raises(ValueError, match=r"cache was built for another layer config or batch size"):
        layer.decode(rand(1, 1, HIDDEN), cache)
    other = NSACache.empty(config(window=5), 2)
    with pytest.raises(ValueError, match=r"cache was built for another layer config or batch size"):
        layer.decode(rand(2, 1, HIDDEN), other)
    with pytest.raises(TypeError, match=r"x dtype torch.float64"):
        layer.decode(rand(2, 1, HIDDEN, dtype=torch.float64), cache)
    assert cache.length == 5  # nothing was appended by the refused calls


# ------------------------------------------------------------------------------ nothing visible


def all_finite(*tensors: torch.Tensor | None) -> bool:
    return all(t is not None and bool(torch.isfinite(t).all()) for t in tensors)


def grads_of(layer: NSAAttention) -> list[torch.Tensor | None]:
    return [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("phi", ["avg", "mlp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("t", [1, 2, L_CMP - 1])
def test_short_sequence_is_finite(phi: str, dtype: torch.dtype, t: int) -> None:
    """T < l: no compressed block exists for any query; outputs and gradients stay finite."""
    torch.manual_seed(t)
    layer = NSAAttention(config(phi=phi), HIDDEN).to(dtype)
    x = rand(2, t, HIDDEN, dtype=dtype).requires_grad_()
    y = layer(x)
    assert y.shape == (2, t, HIDDEN)
    assert all_finite(y)
    y.square().sum().backward()
    assert all_finite(x.grad)
    # Every parameter gets a finite gradient (phi's may be exactly zero: no block was formed).
    assert all(g is None or all_finite(g) for g in grads_of(layer))
    assert all_finite(layer.q_proj.weight.grad, layer.o_proj.weight.grad)


@pytest.mark.parametrize("phi", ["avg", "mlp"])
def test_varlen_with_tiny_sequences_is_finite(phi: str) -> None:
    """Packed sequences of lengths 1, 0, 3 and 12: the short ones see no compressed block."""
    torch.manual_seed(0)
    layer = NSAAttention(config(phi=phi), HIDDEN).double()
    cu = torch.tensor([0, 1, 1, 4, 16], dtype=torch.int32)
    x = rand(1, 16, HIDDEN, dtype=torch.float64).requires_grad_()
    y = layer(x, cu_seqlens=cu)
    assert all_finite(y)
    y.sum().backward()
    assert all_finite(x.grad)
    assert all(g is None or all_finite(g) for g in grads_of(layer))


def test_compressed_rows_without_blocks_are_zero_with_zero_gradient() -> None:
    """Rows t < l - 1 see no compressed block: o_cmp = 0 and no gradient flows from them."""
    q = rand(B, T, HQ, DK, dtype=torch.float64).requires_grad_()
    k = rand(B, N_CMP, H, DK, dtype=torch.float64).requires_grad_()
    v = rand(B, N_CMP, H, DV, dtype=torch.float64).requires_grad_()
    o = compressed_attention(q, k, v, L_CMP, D_CMP)
    blind = L_CMP - 1  # rows 0 .. l-2
    assert torch.equal(o[:, :blind], torch.zeros_like(o[:, :blind]))
    assert all_finite(o)
    o.sum().backward()
    assert q.grad is not None
    assert all_finite(q.grad, k.grad, v.grad)
    assert torch.equal(q.grad[:, :blind], torch.zeros_like(q.grad[:, :blind]))


def test_compressed_no_blocks_at_all() -> None:
    """T < l: no block exists. The output is zero yet stays part of the autograd graph, so a
    loss built on it back-propagates (zero gradient) instead of raising."""
    q = rand(B, L_CMP - 1, HQ, DK, dtype=torch.float64).requires_grad_()
    k = rand(B, 0, H, DK, dtype=torch.float64).requires_grad_()
    v = rand(B, 0, H, DV, dtype=torch.float64).requires_grad_()
    o = compressed_attention(q, k, v, L_CMP, D_CMP)
    assert o.shape == (B, L_CMP - 1, HQ, DV)
    assert torch.equal(o, torch.zeros_like(o))
    assert o.requires_grad
    o.sum().backward()
    assert q.grad is not None
    assert torch.equal(q.grad, torch.zeros_like(q.grad))


def test_selected_rows_with_only_padding_are_zero() -> None:
    q = rand(B, T, HQ, DK, dtype=torch.float64).requires_grad_()
    k = rand(B, T, H, DK, dtype=torch.float64).requires_grad_()
    v = rand(B, T, H, DV, dtype=torch.float64).requires_grad_()
    idx = valid_indices()
    idx[:, 2:5] = -1  # rows 2, 3, 4 select nothing
    o = selected_attention(q, k, v, idx, L_SEL)
    assert torch.equal(o[:, 2:5], torch.zeros_like(o[:, 2:5]))
    assert all_finite(o)
    o.sum().backward()
    assert q.grad is not None
    assert all_finite(q.grad, k.grad, v.grad)
    assert torch.equal(q.grad[:, 2:5], torch.zeros_like(q.grad[:, 2:5]))


def test_selected_block_in_the_future_is_invisible() -> None:
    """A block entirely after t contributes no visible token: the row stays finite (zero)."""
    q = rand(B, T, HQ, DK, dtype=torch.float64)
    k = rand(B, T, H, DK, dtype=torch.float64)
    v = rand(B, T, H, DV, dtype=torch.float64)
    idx = torch.full((B, T, H, N_SEL), -1, dtype=torch.int32)
    idx[..., 0] = 1  # block 1 = tokens [4, 8): invisible to rows 0 .. 3
    o = selected_attention(q, k, v, idx, L_SEL)
    assert torch.equal(o[:, :L_SEL], torch.zeros_like(o[:, :L_SEL]))
    assert all_finite(o)
    assert o[:, L_SEL:].abs().sum() > 0
