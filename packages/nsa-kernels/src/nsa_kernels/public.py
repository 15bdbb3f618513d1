"""The entry points of nsa-kernels that users call by name, and what each checks.

nsa-core's ops reach the kernels through the registry with arguments they validated already
(each backend's ``unchecked`` body, or ``validated=True``), so the hot paths check nothing
twice. A user who calls a kernel by name instead gets every rule of docs/spec.md ("Argument
rules") before any launch: TypeError for a wrong kind of value (a float where an int is meant,
a bool, another dtype), ValueError for a wrong value, each naming the argument and the rule.
The rules of an op come from :mod:`nsa_core.checks`; a kernel adds its own
(:mod:`nsa_kernels.common.entry_checks`, :mod:`nsa_kernels.common.triton_inputs`): its tile
config (:func:`~nsa_kernels.common.tile_config.check_config`), its dtypes and head dims, and
last whether Triton runs the call here: CUDA tensors, or CPU tensors under
``TRITON_INTERPRET=1``, where a dtype the interpreter computes wrongly is refused with the
reason (bfloat16 in every kernel whose ``tl.dot`` takes it, and in the kernels defined bit for
bit: :class:`~nsa_kernels.common.triton_inputs.InterpreterFault`).

:data:`PUBLIC_ENTRY_POINTS` lists them as ``"module:qualified name"``; the bad-input table of
the tests (packages/nsa-kernels/tests/test_bad_input_kernels.py) holds at least three refused
calls of each. By step, with what each checks beyond its op's rules:

- selected: ``nsa_kernels.selected_attention_triton``, ``selected_attention_fwd`` and
  ``_bwd``, ``selected_attention_gated_triton``: a SelConfig and Toggles, fp16/bf16/fp32, dk
  and dv <= 256; the backward's do and o [B, Tq, HQ, dv] and lse float32 [B, Tq, HQ]; the
  gated launch's o_cmp, o_win, gates and local.
- selected, quick: ``nsa_kernels.sel_attn_fwd_dense`` and ``sel_attn_fwd_varlen``: q [N, H, D],
  k and v per row or packed, cu_seqlens [N+1], block_l a power of two >= 16.
- selected, CUDA: ``selected_attention_cuda``: fp16/bf16 CUDA tensors, even head dims <= 256,
  no gradient.
- compressed: ``compressed_attention_triton`` (and ``_with_lse``), ``compressed_attention_fwd``
  and ``_bwd``: a CmpConfig, fp16/bf16/fp32, dk and dv <= 256, the backward's as selected.
- the adapters: ``compressed_attention_cudnn`` (and ``_with_lse``: dense inputs),
  ``compressed_attention_fa2``, ``sliding_attention_fa2``, ``*_attention_flex``,
  ``*_attention_sdpa``: the op's rules; the libraries check their own dtypes and devices.
- sliding: ``sliding_attention_triton`` (and ``_with_local``: sel_block, a window that holds
  the local blocks): a CmpConfig, fp16/bf16/fp32, dk and dv <= 256.
- scoring: ``select_blocks_triton`` (a ScoreConfig, dk <= 256) and ``check_index_contract``
  (its tensors, tolerances and exact_ties).
- combine: ``gated_combine_triton`` and ``sum3_triton`` (one shape, dtype and device):
  fp16/bf16/fp32.
- rotary embedding: ``apply_rope_triton``: fp16/bf16/fp32.
- decode: ``DecodeState.empty``, ``from_cache`` and ``from_prefixes``, ``block_phi``,
  ``DecodePlan``, ``decode_step``, ``DecodeGraph``, ``LayerDecoder`` (and its ``prefill`` and
  ``step``): the config, the branch K/V, lengths, capacity, phi, StepInputs, a
  DecodeKernelConfig, warmup, x.
- tiles: ``parse_config`` (``SelConfig.parse``) and every ``config=``: fields ints >= 0.
- install: ``pairing.pairing`` (version strings) and ``registration.register`` (a callable).

``pairing.installed_pairing()`` and ``registration.all_backends()`` take no arguments. The
registry's rows (``backends()``, ``*_supports``), the fused core (:mod:`nsa_kernels.core`) and
the kernels' halves inside a call (``attend_with_lse``, ``combine_fwd``, ...) are not entry
points: nsa-core validated what reaches them.
"""

from __future__ import annotations

PUBLIC_ENTRY_POINTS: tuple[str, ...] = (
    "nsa_kernels:sel_attn_fwd_dense",
    "nsa_kernels:sel_attn_fwd_varlen",
    "nsa_kernels:selected_attention_triton",
    "nsa_kernels.selected.function:selected_attention_fwd",
    "nsa_kernels.selected.function:selected_attention_bwd",
    "nsa_kernels.selected.function:selected_attention_gated_triton",
    "nsa_kernels.selected.cuda.selected:selected_attention_cuda",
    "nsa_kernels.compressed.function:compressed_attention_triton",
    "nsa_kernels.compressed.function:compressed_attention_triton_with_lse",
    "nsa_kernels.compressed.function:compressed_attention_fwd",
    "nsa_kernels.compressed.function:compressed_attention_bwd",
    "nsa_kernels.compressed.cudnn:compressed_attention_cudnn",
    "nsa_kernels.compressed.cudnn:compressed_attention_cudnn_with_lse",
    "nsa_kernels.compressed.fa2:compressed_attention_fa2",
    "nsa_kernels.sliding.fa2:sliding_attention_fa2",
    "nsa_kernels.common.flex:compressed_attention_flex",
    "nsa_kernels.common.flex:sliding_attention_flex",
    "nsa_kernels.common.sdpa:compressed_attention_sdpa",
    "nsa_kernels.common.sdpa:sliding_attention_sdpa",
    "nsa_kernels.sliding.triton_function:sliding_attention_triton",
    "nsa_kernels.sliding.triton_function:sliding_attention_triton_with_local",
    "nsa_kernels.scoring.function:select_blocks_triton",
    "nsa_kernels.scoring.contract:check_index_contract",
    "nsa_kernels.combine.function:gated_combine_triton",
    "nsa_kernels.combine.function:sum3_triton",
    "nsa_kernels.rope.function:apply_rope_triton",
    "nsa_kernels.decode:DecodeState.empty",
    "nsa_kernels.decode:DecodeState.from_cache",
    "nsa_kernels.decode:DecodeState.from_prefixes",
    "nsa_kernels.decode:block_phi",
    "nsa_kernels.decode:DecodePlan",
    "nsa_kernels.decode:decode_step",
    "nsa_kernels.decode:DecodeGraph",
    "nsa_kernels.decode:LayerDecoder",
    "nsa_kernels.decode:LayerDecoder.prefill",
    "nsa_kernels.decode:LayerDecoder.step",
    "nsa_kernels.selected.function:parse_config",
    "nsa_kernels.pairing:pairing",
    "nsa_kernels.registration:register",
)
