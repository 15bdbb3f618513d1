"""pytest plugin: record each distinct Triton launch the interpreter runs (ci/compile_triton.py).

Under ``TRITON_INTERPRET=1`` a kernel never meets Triton's compiler, so a kernel that runs
right in the interpreter can still fail to compile (an unsupported construct, a layout pass that
gives up, too much shared memory). With ``--record-triton-launches DIR`` every interpreted launch
is also written down as the compiler would see it (argument dtypes, integer classes, constexpr
values, launch options; no data), one JSON file per pytest process, and ci/compile_triton.py
then compiles each distinct launch for a real GPU target on a machine with no GPU.

Loaded from the root conftest.py; without the option it changes nothing.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import pytest

OPTION = "--record-triton-launches"

# One launch: (module, kernel name, encoded positional arguments, encoded keyword arguments).
Launch = tuple[str, str, tuple[Any, ...], tuple[tuple[str, Any], ...]]


def encode(value: Any, constexpr: bool) -> list[Any]:
    """The launch argument as the compiler keys it: a tensor by dtype, an int by the classes
    Triton specializes on (1, a multiple of 16, int32 or int64), a constexpr by its value."""
    import torch

    if isinstance(value, torch.Tensor):
        return ["tensor", str(value.dtype).removeprefix("torch.")]
    if isinstance(value, int) and not isinstance(value, bool) and not constexpr:
        if value == 1:
            return ["int", "one"]
        if not -(2**31) <= value < 2**31:
            return ["int", "i64"]
        return ["int", "i32_div16" if value % 16 == 0 else "i32"]
    if isinstance(value, float) and not constexpr:
        return ["float"]
    if value is None or isinstance(value, (bool, int, float, str)):
        return ["value", value]
    descriptor = _descriptor(value)
    if descriptor is not None:
        return descriptor
    import triton.language as tl

    if isinstance(value, tl.dtype):
        return ["tl_dtype", value.name]
    raise TypeError(f"cannot record a launch argument of type {type(value).__name__}")


def _descriptor(value: Any) -> list[Any] | None:
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # triton < 3.4 has no host-side tensor descriptors
        return None
    if not isinstance(value, TensorDescriptor):
        return None
    dtype = str(value.base.dtype).removeprefix("torch.")
    return ["tensor_descriptor", dtype, len(value.shape), [int(b) for b in value.block_shape]]


class LaunchRecorder:
    """Wraps the interpreter's launch so that each call is also recorded (once per signature)."""

    def __init__(self) -> None:
        self.launches: dict[Launch, None] = {}
        self._original: Any = None

    def install(self) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        original = InterpretedFunction.run
        recorder = self

        def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            recorder.record(self.fn, args, kwargs)
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)

        self._original = original
        InterpretedFunction.run = run

    def uninstall(self) -> None:
        if self._original is not None:
            from triton.runtime.interpreter import InterpretedFunction

            InterpretedFunction.run = self._original

    def record(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        params = inspect.signature(fn).parameters
        constexpr = {name for name, p in params.items() if "constexpr" in str(p.annotation)}
        # Arguments past the positional ones come as keywords (in ``kwargs``).
        pairs = zip(params, args, strict=False)
        encoded = tuple(_frozen(encode(value, name in constexpr)) for name, value in pairs)
        options = tuple(
            sorted((name, _frozen(encode(value, True))) for name, value in kwargs.items())
        )
        self.launches[(fn.__module__, fn.__qualname__, encoded, options)] = None

    def write(self, folder: Path, worker: str) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"launches-{worker}.json"
        rows = [
            {"module": m, "kernel": k, "args": list(a), "options": [list(o) for o in opts]}
            for m, k, a, opts in self.launches
        ]
        path.write_text(json.dumps(rows, indent=0))
        return path


def _frozen(value: Any) -> Any:
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        OPTION,
        metavar="DIR",
        default=None,
        help="write each distinct interpreted Triton launch to DIR (for ci/compile_triton.py)",
    )


_RECORDER_KEY = pytest.StashKey[LaunchRecorder]()


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption(OPTION) is None:
        return
    import triton

    def probe() -> None:
        pass

    # triton.jit gives an InterpretedFunction only when TRITON_INTERPRET=1 is in force.
    if type(triton.jit(probe)).__name__ != "InterpretedFunction":
        raise pytest.UsageError(f"{OPTION} records interpreted launches: set TRITON_INTERPRET=1")
    recorder = LaunchRecorder()
    recorder.install()
    config.stash[_RECORDER_KEY] = recorder


def pytest_unconfigure(config: pytest.Config) -> None:
    recorder = config.stash.get(_RECORDER_KEY, None)
    if recorder is None:
        return
    recorder.uninstall()
    # pytest-xdist gives each worker its id; the controller (or a plain run) is "main".
    worker = getattr(config, "workerinput", {}).get("workerid", "main")
    path = recorder.write(Path(config.getoption(OPTION)), worker)
    print(f"\n[triton launches] {len(recorder.launches)} distinct launches -> {path}")
