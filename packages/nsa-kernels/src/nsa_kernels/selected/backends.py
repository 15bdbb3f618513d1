"""The backends of the selected branch (``selected_attention``) and their priorities.

The registry asks them from the highest priority down; the first whose ``supports`` returns
``None`` serves, and nsa-core's reference (priority 0) serves whatever they all decline.

| priority | backend | serves when |
|---|---|---|
| 40 | ``cuda_sel`` | NSA_SEL_CUDA=1 (experimental), forward only, |
| | | fp16/bf16, even head dims, the extension builds |
| 20 | ``triton_sel`` | CUDA and triton, NSA_SEL_TRITON, the device |
| | | policy table there, fp16/bf16/fp32, head dims multiples of 16 up to 256 |
"""

from __future__ import annotations

from nsa_core.registry import Backend
from nsa_kernels.selected import backend as triton_sel
from nsa_kernels.selected import cuda


def backends() -> list[Backend]:
    """The selected branch's backends, highest priority first."""
    return sorted([*cuda.backends(), *triton_sel.backends()], key=lambda b: -b.priority)
