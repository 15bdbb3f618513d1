"""A device-side flag: is every element of a tensor finite? (no host sync)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def all_finite_flag(*xs: torch.Tensor) -> torch.Tensor:
    """int32 [1] on the tensors' device: 1 when every element of every ``xs`` is finite, else 0.

    One float32 sum per tensor, read by kernels that take a faster path for finite inputs: a sum
    that meets a NaN or an infinity is not finite. A sum of finite values that overflows float32
    also reads 0; that only sends the kernel down its slower path, which is correct for any input.
    """
    if not xs:
        raise ValueError("all_finite_flag needs at least one tensor")
    total = xs[0].sum(dtype=torch.float32)
    for x in xs[1:]:
        total = total + x.sum(dtype=torch.float32)
    return torch.isfinite(total).to(torch.int32).reshape(1)


def finite_path_launches(fast: bool, *xs: torch.Tensor) -> tuple[torch.Tensor, tuple[bool, ...]]:
    """(flag, paths) of a kernel with a faster path that holds only where every ``xs`` is finite.

    ``fast``: the call may take that path. Then the flag is :func:`all_finite_flag` of ``xs``
    and the kernel is launched once per path, (True, False): the launch of path ``p`` works
    where ``(flag != 0) == p`` and its programs return at once otherwise, so exactly one launch
    works, with no host sync. Else the flag is 0 and one launch takes the general path (False).
    """
    if fast:
        return all_finite_flag(*xs), (True, False)
    return torch.zeros(1, dtype=torch.int32, device=xs[0].device), (False,)


@dataclass(frozen=True)
class HostFlag:
    """A device flag on its way to the host: sent without a wait, read later.

    :meth:`send` queues the copy (pinned memory) and records an event after it; :meth:`read`
    waits for that event alone. Read well after the send (a backward reading its forward's
    flag), the wait returns at once and the device keeps the work queued since. Inside a CUDA
    graph capture, which cannot wait on the host, nothing is sent and the flag reads nonzero.
    """

    value: torch.Tensor
    ready: torch.cuda.Event | None

    @classmethod
    def send(cls, flag: torch.Tensor) -> HostFlag:
        """``flag`` (int32 [1], e.g. :func:`all_finite_flag`) copied to the host, asynchronously
        on CUDA."""
        if flag.device.type != "cuda":
            return cls(value=flag.clone(), ready=None)
        if torch.cuda.is_current_stream_capturing():
            return cls(value=torch.ones(1, dtype=flag.dtype), ready=None)
        host = torch.empty(1, dtype=flag.dtype, pin_memory=True)
        host.copy_(flag, non_blocking=True)
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record()
        return cls(value=host, ready=ready)

    def read(self) -> bool:
        """Whether the flag is nonzero (waits for its copy, and for nothing queued after it)."""
        if self.ready is not None:
            self.ready.synchronize()
        return bool(self.value[0] != 0)
