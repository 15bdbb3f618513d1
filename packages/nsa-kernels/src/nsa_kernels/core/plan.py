"""Which kernel runs each step of one fused-core call, and which hand-offs between steps apply.

Each step is resolved once per call through nsa-core's registry, so every step toggle
(``NSA_<STEP>_BACKEND``, NSA_CMP_CUDNN, NSA_SEL_TRITON, ...) keeps its meaning inside the fused
core. A hand-off applies only between the kernels that share it:

| hand-off | applies when |
|---|---|
| compressed lse -> block scoring | the compressed backend has ``fn_with_lse`` |
| gated combine inside the selected launch | selected ``triton_sel``, combine ``triton_combine`` |
| compressed output as runs of rows | that gated launch, and compressed ``cudnn`` |
| forced-block softmax from the sliding kernel | that gated launch, sliding ``triton_win``; and |
| | per call: the branches share k, v and positions, w >= 2 l' |
| q's three gradients summed in one pass | a gradient, combine ``triton_combine``, and |
| | NSA_COMBINE_GRAD_SUM on |
"""

from __future__ import annotations

from dataclasses import dataclass

from nsa_core.core import StepContexts
from nsa_core.registry import Backend, resolve
from nsa_core.toggles import Toggles
from nsa_kernels.combine.backends import TRITON_NAME as TRITON_COMBINE
from nsa_kernels.compressed.backends import CUDNN_NAME as CUDNN
from nsa_kernels.selected.backend import NAME as TRITON_SEL
from nsa_kernels.sliding.backends import TRITON_NAME as TRITON_WIN


@dataclass(frozen=True)
class CorePlan:
    """The backend of each step of one call and the hand-offs between them."""

    compressed: Backend
    scoring: Backend
    selected: Backend
    sliding: Backend
    combine: Backend
    gated: bool
    runs: bool
    local: bool
    grad_sum: bool

    @classmethod
    def make(cls, steps: StepContexts, toggles: Toggles) -> CorePlan:
        """Resolve each step once for ``steps`` and decide the hand-offs (module table)."""
        compressed = resolve("compressed_attention", steps.compressed, toggles).backend
        scoring = resolve("select_blocks", steps.scoring, toggles).backend
        selected = resolve("selected_attention", steps.selected, toggles).backend
        sliding = resolve("sliding_attention", steps.sliding, toggles).backend
        combine = resolve("gated_combine", steps.combine, toggles).backend
        gated = selected.name == TRITON_SEL and combine.name == TRITON_COMBINE
        return cls(
            compressed=compressed,
            scoring=scoring,
            selected=selected,
            sliding=sliding,
            combine=combine,
            gated=gated,
            runs=gated and compressed.name == CUDNN,
            local=gated and sliding.name == TRITON_WIN,
            grad_sum=steps.combine.requires_grad
            and toggles.combine_grad_sum
            and combine.name == TRITON_COMBINE,
        )

    def describe(self) -> list[str]:
        """One line per step: its backend and the hand-offs it takes part in."""
        lse = self.compressed.fn_with_lse is not None
        cmp_notes = [
            note
            for note, applies in (
                ("its lse reaches block scoring", lse),
                ("its output reaches the selected launch as runs of rows", self.runs),
            )
            if applies
        ]
        win_note = (
            "hands the selected launch each row's softmax over its forced blocks where the "
            "branches share k and v and w >= 2 l'"
        )
        combine_note = "summed inside the selected launch" if self.gated else ""
        grad_note = "q's three gradients summed in one pass" if self.grad_sum else ""
        rows = (
            ("compressed_attention", self.compressed, "; ".join(cmp_notes)),
            ("select_blocks", self.scoring, "reuses the compressed lse" if lse else ""),
            (
                "selected_attention",
                self.selected,
                "one launch with the combine" if self.gated else "",
            ),
            ("sliding_attention", self.sliding, win_note if self.local else ""),
            ("gated_combine", self.combine, "; ".join(n for n in (combine_note, grad_note) if n)),
        )
        return [f"{op:22s} -> {b.name}" + (f"   ({note})" if note else "") for op, b, note in rows]
