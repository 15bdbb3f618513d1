# Triton kernels take untyped pointer/scalar parameters (types come from the launch), and
# triton.jit is untyped without triton installed: mypy checks only the plain Python here.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
"""Programmatic dependent launch (PDL) for chains of small launches that depend on each other.

A chain of latency-bound launches (the decode step: five launches of a few microseconds each)
pays, at every boundary, the time the next launch takes to start after the previous one ends.
With PDL (sm_90 and later) a launch made with ``launch_pdl=True`` may start while the launch
before it still runs: its programs wait on the device, in :func:`wait_for_prior_launch`, until
that launch has finished and its writes are visible. Each program of a PDL chain calls it
before touching global memory, so a launch's reads and writes happen after the launch before it
has ended, exactly as without PDL, and so, transitively, after every earlier one.

The kernel side is one constexpr, ``PDL``; the launch side is :func:`launch_options`. PDL needs
triton's grid-dependency control (``triton.language.extra.cuda``, triton >= 3.4) and a CUDA
device of compute capability 9.0 or more; the interpreter runs without it.
"""

# No `from __future__ import annotations`: the triton 3.0/3.1 interpreter reads a string
# annotation as a runtime argument, so `PDL: tl.constexpr` would stop being a constant.

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from nsa_kernels.common.triton_inputs import interpreter_active

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _HAS_GDC = True
except ImportError:  # triton < 3.4: no grid-dependency control; PDL is never asked for there
    _HAS_GDC = False

    @triton.jit
    def gdc_launch_dependents():
        pass

    @triton.jit
    def gdc_wait():
        pass


@triton.jit
def wait_for_prior_launch(PDL: tl.constexpr):
    """With PDL, let the next launch of the chain start its programs, then wait until the
    previous launch has ended and its writes are visible; without, nothing."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@functools.cache
def _launcher_takes_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return any(f.name == "launch_pdl" for f in dataclasses.fields(CUDAOptions))


def pdl_supported(device: torch.device) -> bool:
    """Whether launches on ``device`` can chain with PDL: CUDA sm_90+, compiled (not
    interpreted) kernels, a triton that has grid-dependency control."""
    if device.type != "cuda" or interpreter_active() or not _HAS_GDC:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9 and _launcher_takes_pdl()


def launch_options(pdl: bool) -> dict[str, bool]:
    """The launch keywords of one launch of a chain (none without PDL, so that a triton
    without the option never sees it)."""
    return {"launch_pdl": True} if pdl else {}
