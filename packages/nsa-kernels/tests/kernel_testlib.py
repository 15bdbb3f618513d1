"""Where the Triton kernel tests run, and how their outputs are compared with a reference.

Shared by the per-step testlibs and tests below this folder (``conftest.py`` here puts the folder
on ``sys.path``): the device a ``triton``-marked test uses, the docs/spec.md tolerances and the
relative error they bound, the fields every step's test Case shares, and the OpContext that the
routing tests hand a backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from nsa_core.registry import OpContext
from nsa_kernels.common.triton_inputs import interpreter_active

# The interpreter tier sets TRITON_INTERPRET=1 and runs the kernels on the CPU; elsewhere they need
# a CUDA GPU. Tests skip with SKIP_REASON where DEVICE is None.
INTERPRET = interpreter_active()
if INTERPRET:
    DEVICE: str | None = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    DEVICE = None
SKIP_REASON = "needs a CUDA GPU or the Triton interpreter (run with TRITON_INTERPRET=1)"

# What a kernel whose tl.dot takes bfloat16 raises under the interpreter, which multiplies such
# operands wrongly (nsa_kernels.common.triton_inputs.BF16_DOT): there a bfloat16 case of a test
# asserts this refusal instead of the kernel's result.
BF16_DOT_REFUSAL = r"bfloat16 \w+ under TRITON_INTERPRET=1: Triton's interpreter multiplies"
# The same for a kernel defined bit for bit, whose bfloat16 rounding the interpreter gets wrong
# (BF16_ROUNDING).
BF16_ROUNDING_REFUSAL = r"bfloat16 \w+ under TRITON_INTERPRET=1: Triton's interpreter rounds"


def refused_here(dtype: torch.dtype) -> bool:
    """Whether the kernels refuse ``dtype`` where these tests run (bfloat16 in the interpreter)."""
    return INTERPRET and dtype == torch.bfloat16


# docs/spec.md tolerances: relative error ||out - ref|| / ||ref||; gradients get twice these.
# float32 is held to the float64 bound; half precision to its bound against float32.
BOUND = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (1 as the denominator when ref is 0).

    out and ref of one shape, any dtype and device; a non-finite value in ``out`` fails the test.
    """
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    assert torch.isfinite(out64).all(), "non-finite values in the kernel output"
    denom = ref64.norm()
    return float((out64 - ref64).norm() / (denom if denom > 0 else 1.0))


@dataclass
class KernelCase:
    """One kernel call's batch and heads, the base of each step's test Case.

    B = ``batch`` rows of ``tq`` queries at positions ``q_start`` .. ``q_start + tq - 1``, or
    (``seqlens``, B == 1, q_start == 0) packed sequences, each from position 0; HQ = h * group
    query heads over h kv heads of head dim dk. ``config``: the step's kernel config fields.
    """

    name: str
    batch: int = 1
    tq: int = 32
    h: int = 1
    group: int = 1
    dk: int = 16
    q_start: int = 0
    seqlens: list[int] | None = None
    config: dict[str, int] = field(default_factory=dict)

    @property
    def hq(self) -> int:
        return self.h * self.group


@dataclass
class CompressedCase(KernelCase):
    """A call that reads compressed blocks: l = ``cmp_block`` tokens every d = ``cmp_stride``."""

    cmp_block: int = 8
    cmp_stride: int = 4


# The compressed kernels' tiles at 16 rows x 16 keys, so that short sequences run the masked and
# unmasked key walks and the head chunks; SPLIT adds dk/dv segments of 12 rows, so that most key
# tiles are split over several programs and reduced. The sliding branch runs the same kernels.
CMP_SMALL_TILES = {
    "block_m": 16,
    "block_n": 16,
    "dq_block_m": 16,
    "dq_block_n": 16,
    "dkv_block_m": 16,
    "dkv_block_n": 16,
}
CMP_SPLIT_TILES = {**CMP_SMALL_TILES, "dkv_segment": 12}


def assert_grads_close(
    got: Sequence[torch.Tensor], want: Sequence[torch.Tensor], bound: float
) -> None:
    """Each leaf of ``got`` (q, k, v, ...) has a .grad within ``bound`` (relative error) of the
    .grad of the matching leaf of ``want``."""
    for i, (leaf, ref) in enumerate(zip(got, want, strict=True)):
        assert leaf.grad is not None, f"leaf {i} has no gradient"
        assert ref.grad is not None, f"reference leaf {i} has no gradient"
        assert rel_err(leaf.grad, ref.grad) < bound, f"gradient of leaf {i}"


def positions(case: KernelCase) -> torch.Tensor:
    """int64 [Tq]: each query row's position (restarting at 0 in every packed sequence)."""
    if case.seqlens is None:
        return torch.arange(case.q_start, case.q_start + case.tq)
    return torch.cat([torch.arange(n) for n in case.seqlens])


def op_context(
    device: str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    *,
    seq_len: int = 4096,
    hq: int = 16,
    h: int = 4,
    dk: int = 128,
    dv: int = 128,
    grad: bool = False,
) -> OpContext:
    """What a backend's ``supports`` sees of one padded (not varlen) call: HQ=hq query heads over
    H=h kv heads, head dims dk/dv, ``seq_len`` keys; ``grad`` when the call needs a backward."""
    return OpContext(
        device=torch.device(device),
        dtype=dtype,
        seq_len=seq_len,
        num_q_heads=hq,
        num_kv_heads=h,
        head_dim_qk=dk,
        head_dim_v=dv,
        requires_grad=grad,
        varlen=False,
    )
