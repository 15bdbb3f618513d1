"""What the Triton attention and scoring launches accept, and the launch facts they derive alike.

Their kernels take float16, bfloat16 or float32 and head dims up to 256 (tiles are padded to
powers of two and masked); float32 runs every ``tl.dot`` with ``input_precision="ieee"`` (no
TF32). Plain Python and torch: no triton import here.
"""

from __future__ import annotations

import functools

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def check_dtype(dtype: torch.dtype, what: str) -> None:
    """Raise TypeError unless the Triton ``what`` (e.g. "compressed attention") takes ``dtype``."""
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"Triton {what} supports {SUPPORTED_DTYPES}, got {dtype}")


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
