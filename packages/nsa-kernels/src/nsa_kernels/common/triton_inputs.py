"""What the Triton attention and scoring launches accept, and the launch facts they derive alike.

Their kernels take float16, bfloat16 or float32 and head dims up to 256 (tiles are padded to
powers of two and masked); float32 runs every ``tl.dot`` with ``input_precision="ieee"`` (no
TF32). They run on CUDA tensors, or on CPU tensors in Triton's interpreter
(``TRITON_INTERPRET=1``), which computes bfloat16 wrongly (:class:`InterpreterFault`): there a
kernel refuses bfloat16 and its registry row declines it. Plain Python and torch at import:
triton is imported only to ask whether its interpreter is on.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def check_dtype(dtype: torch.dtype, what: str, name: str = "q") -> None:
    """Raise TypeError unless the Triton ``what`` (e.g. "compressed attention") takes ``dtype``,
    the dtype of argument ``name``."""
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"Triton {what} supports float16, bfloat16 and float32, got {name} of dtype {dtype}"
        )


def interpreter_active() -> bool:
    """Whether Triton runs its kernels in its CPU interpreter (``TRITON_INTERPRET``).

    The one place nsa-kernels reads that setting. triton >= 3.4 parses it in
    ``triton.knobs.runtime.interpret`` (read at each call, so a test may set it); older ones
    read ``TRITON_INTERPRET == "1"`` themselves, which is repeated here. Kernels are interpreted
    when triton.jit wrapped them with it on (at import): set it before importing them.
    """
    try:
        import triton
    except ImportError:
        return False
    knobs = getattr(triton, "knobs", None)
    if knobs is None:
        return os.environ.get("TRITON_INTERPRET", "0") == "1"
    return bool(knobs.runtime.interpret)


@dataclass(frozen=True)
class InterpreterFault:
    """A dtype that Triton's interpreter computes wrongly in one kind of kernel, and why.

    Measured with triton 3.7.1 against the reference on CPU (and read in the interpreters of
    triton 3.4 and 3.9, which do the same): numpy has no bfloat16, so the interpreter keeps
    bfloat16 values as their 16-bit patterns. It converts them to and from float32 by hand, but
    hands them to ``np.matmul`` as integers, and its float32 to bfloat16 conversion truncates.
    float16 and float32 compute as on a GPU.
    """

    dtype: torch.dtype
    why: str


# Every kernel that multiplies bfloat16 operands in tl.dot: selected, compressed, sliding, block
# scoring, the decode step and the fused core (outputs and gradients off by about 1e9 relative).
BF16_DOT = InterpreterFault(
    torch.bfloat16,
    "Triton's interpreter multiplies bfloat16 tl.dot operands as their raw 16-bit integers "
    "(numpy has no bfloat16), so the results are garbage (relative errors near 1e9)",
)
# Kernels whose result is defined bit for bit (rotary embedding, the three-way sum): a third to
# a half of their bfloat16 outputs land one unit in the last place toward zero.
BF16_ROUNDING = InterpreterFault(
    torch.bfloat16,
    "Triton's interpreter rounds float32 to bfloat16 toward zero where torch and a GPU round to "
    "nearest even, so the result is not the reference's bit for bit",
)


def interpreter_reason(dtype: torch.dtype, fault: InterpreterFault | None) -> str | None:
    """Why the interpreter cannot run a kernel with ``fault`` on ``dtype``, or None (the
    interpreter is off, the kernel has no fault, or the fault is another dtype's)."""
    if fault is None or dtype != fault.dtype or not interpreter_active():
        return None
    return f"{dtype_name(dtype)} under TRITON_INTERPRET=1: {fault.why}"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``bfloat16``."""
    return str(dtype).removeprefix("torch.")


def check_interpreter_dtype(name: str, dtype: torch.dtype, fault: InterpreterFault | None) -> None:
    """Raise TypeError where the interpreter would compute argument ``name``'s ``dtype`` wrongly
    in a kernel with ``fault``."""
    if interpreter_reason(dtype, fault) is None:
        return
    assert fault is not None
    raise TypeError(
        f"{dtype_name(dtype)} {name} under TRITON_INTERPRET=1: {fault.why}; use float32 or "
        "float16, or run on a GPU"
    )


def check_triton_device(name: str, device: torch.device) -> None:
    """Raise ValueError unless Triton can run on ``device`` (argument ``name``'s): CUDA, or the
    CPU where the interpreter is on."""
    if device.type == "cuda" or (device.type == "cpu" and interpreter_active()):
        return
    raise ValueError(
        f"{name} is on {device}: the Triton kernels run on CUDA tensors (or on CPU tensors under "
        "TRITON_INTERPRET=1)"
    )


def check_triton_runs(
    name: str, x: torch.Tensor, fault: InterpreterFault | None = BF16_DOT
) -> None:
    """Triton can run on argument ``name`` (x) here: not a dtype the interpreter, where it runs,
    computes wrongly in a kernel with ``fault``, and a device Triton runs on. An entry point
    checks this last, after the call's own arguments, so that their mistakes show first on any
    machine."""
    check_interpreter_dtype(name, x.dtype, fault)
    check_triton_device(name, x.device)


def check_head_dims(dk: int, dv: int) -> None:
    """Raise ValueError when a head dim exceeds MAX_HEAD_DIM."""
    if max(dk, dv) > MAX_HEAD_DIM:
        raise ValueError(f"head dims dk={dk}, dv={dv} exceed {MAX_HEAD_DIM}")


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: exact float32 ("ieee") for float32 inputs, else "tf32"
    (ignored for 16-bit operands)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def num_sms(device: torch.device) -> int:
    """The device's SM count (4 on CPU, where the interpreter runs), for splitting work."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 4


@functools.cache
def _max_shared_bytes(index: int) -> int:
    from triton.runtime import driver

    return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])


def max_shared_bytes(device: torch.device) -> int | None:
    """Shared memory one thread block may use on ``device`` (bytes; Triton's own limit, the one
    its OutOfResources compares against), None off CUDA (the interpreter has no limit)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _max_shared_bytes(index)
