"""NSALlamaConfig: a Llama configuration whose attention layers are Native Sparse Attention."""

from __future__ import annotations

from typing import Any, cast

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig

from nsa_core.config import NSAConfig, PhiKind

# Each NSA field of the Hugging Face config and the NSAConfig field it sets.
NSA_FIELDS = {
    "nsa_cmp_block": "cmp_block",
    "nsa_cmp_stride": "cmp_stride",
    "nsa_sel_block": "sel_block",
    "nsa_num_selected": "num_selected",
    "nsa_window": "window",
    "nsa_phi": "phi",
}


@strict
class NSALlamaConfig(LlamaConfig):
    """A :class:`transformers.LlamaConfig` plus the NSA geometry of every attention layer.

    The heads come from Llama's fields (HQ = ``num_attention_heads``, H = ``num_key_value_heads``,
    dk = dv = ``head_dim``), the RoPE base from ``rope_parameters["rope_theta"]`` and the softmax
    scale is ``head_dim ** -0.5``, as in Llama. The NSA fields (docs/spec.md, "Symbols"):

    - ``nsa_cmp_block``: l, compression block length;
    - ``nsa_cmp_stride``: d, compression stride;
    - ``nsa_sel_block``: l', selection block length;
    - ``nsa_num_selected``: n, selected blocks per query (forced blocks included);
    - ``nsa_window``: w, sliding window length;
    - ``nsa_phi``: ``"avg"`` (mean) or ``"mlp"`` (learned compression).

    NSA has no attention dropout and rotates by plain RoPE: ``attention_dropout`` must be 0 and
    ``rope_parameters["rope_type"]`` must be ``"default"``. The defaults are the paper's.
    """

    model_type = "nsa_llama"

    nsa_cmp_block: int = 32
    nsa_cmp_stride: int = 16
    nsa_sel_block: int = 64
    nsa_num_selected: int = 16
    nsa_window: int = 512
    nsa_phi: str = "avg"

    def validate_architecture(self) -> None:
        """Llama's rules, then NSA's: every field must make a valid :class:`NSAConfig`."""
        super().validate_architecture()
        if self.attention_dropout:
            raise ValueError(
                f"NSALlamaConfig.attention_dropout must be 0 (NSA has no attention dropout), "
                f"got {self.attention_dropout}"
            )
        rope = self._rope()
        if rope.get("rope_type", "default") != "default":
            raise ValueError(
                f"NSALlamaConfig.rope_parameters['rope_type'] must be 'default' (NSA rotates by "
                f"plain RoPE), got {rope.get('rope_type')!r}"
            )
        self.nsa_config()

    def _rope(self) -> dict[str, Any]:
        rope = self.rope_parameters
        if not isinstance(rope, dict) or "rope_theta" not in rope:
            raise ValueError(
                f"NSALlamaConfig.rope_parameters must be a dict with 'rope_theta', got {rope!r}"
            )
        return cast(dict[str, Any], rope)

    def nsa_config(self) -> NSAConfig:
        """The NSAConfig of every attention layer of the model."""
        head_dim = self.head_dim
        kv_heads = self.num_key_value_heads
        if head_dim is None or kv_heads is None:
            raise ValueError("NSALlamaConfig.head_dim and num_key_value_heads must be set")
        if self.nsa_phi not in ("avg", "mlp"):
            raise ValueError(f"NSALlamaConfig.nsa_phi must be 'avg' or 'mlp', got {self.nsa_phi!r}")
        return NSAConfig(
            num_q_heads=self.num_attention_heads,
            num_kv_heads=kv_heads,
            head_dim_qk=head_dim,
            head_dim_v=head_dim,
            cmp_block=self.nsa_cmp_block,
            cmp_stride=self.nsa_cmp_stride,
            sel_block=self.nsa_sel_block,
            num_selected=self.nsa_num_selected,
            window=self.nsa_window,
            phi=cast(PhiKind, self.nsa_phi),
            rope_theta=float(self._rope()["rope_theta"]),
        )
