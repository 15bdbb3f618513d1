"""What every test of the repository shares.

- Markers say what a test needs; a missing requirement skips with its reason (no CUDA GPU for
  ``gpu``/``fa2``/``cuda``, no flash_attn for ``fa2``, no ``--run-slow`` for ``slow``).
- ``--worker-gpus 0,1``: each pytest-xdist worker sees one GPU of the list (worker k the
  (k mod len)-th), so the workers of a GPU tier spread over every GPU of the host
  (ci/gpu_workers.py sizes the workers and writes the list).
- The process state tests share (the backend registry, the toggles, the ``NSA_*`` environment,
  torch's global numerics flags) is checked around every test: a test that leaves it changed
  fails, and the state is put back, so no test depends on which tests ran before it in its
  process.
- A test that leaves more than ``ci.gpu_workers.RELEASE_GIB`` of CUDA memory reserved hands the
  cached blocks back to the card, so the workers sharing a GPU are not starved by blocks that
  one of them no longer uses.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from ci.gpu_workers import RELEASE_GIB

# --record-triton-launches DIR: the interpreter tier writes its launches for ci/compile_triton.py.
pytest_plugins = ("ci.triton_launches",)

FLASH_ATTN_MISSING = "flash_attn is not installed (build it: ci/build_flash_attn.sh)"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="run tests marked slow")
    parser.addoption(
        "--worker-gpus",
        default=None,
        help="comma-separated GPU indices; each pytest-xdist worker sees one of them",
    )


def pytest_configure(config: pytest.Config) -> None:
    # Runs in each worker before any test touches CUDA: CUDA_VISIBLE_DEVICES is only read when
    # the CUDA runtime starts.
    gpus = config.getoption("--worker-gpus")
    worker = getattr(config, "workerinput", {}).get("workerid")  # "gw3" under xdist
    if gpus and worker is not None:
        ids = [g.strip() for g in gpus.split(",") if g.strip()]
        os.environ["CUDA_VISIBLE_DEVICES"] = ids[int(worker.removeprefix("gw")) % len(ids)]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_cuda = torch.cuda.is_available()
    has_flash = importlib.util.find_spec("flash_attn") is not None
    run_slow = config.getoption("--run-slow")
    for item in items:
        if not has_cuda and any(item.get_closest_marker(m) for m in ("gpu", "fa2", "cuda")):
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; none is visible to torch"))
        elif not has_flash and item.get_closest_marker("fa2"):
            item.add_marker(pytest.mark.skip(reason=FLASH_ATTN_MISSING))
        slow = item.get_closest_marker("slow")
        if slow and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow test; opt in with --run-slow"))
        if slow and not slow.kwargs.get("reason"):
            raise pytest.UsageError(f"{item.nodeid}: pytest.mark.slow needs reason='why slow'")


def _shared_state() -> dict[str, Any]:
    """The process state that tests share, as comparable values."""
    from nsa_core import registry, toggles

    return {
        "registry": registry.state(),
        "toggles": toggles.get_toggles(),
        "NSA_* environment": {k: v for k, v in os.environ.items() if k.startswith("NSA_")},
        "torch default dtype": torch.get_default_dtype(),
        "torch grad mode": torch.is_grad_enabled(),
        "torch deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "torch float32 matmul precision": torch.get_float32_matmul_precision(),
        "cuDNN TF32": torch.backends.cudnn.allow_tf32,
    }


def _restore(saved: dict[str, Any]) -> None:
    from nsa_core import toggles

    for key in [k for k in os.environ if k.startswith("NSA_")]:
        del os.environ[key]
    os.environ.update(saved["NSA_* environment"])
    toggles.reload_toggles()
    torch.set_default_dtype(saved["torch default dtype"])
    torch.set_grad_enabled(saved["torch grad mode"])
    torch.use_deterministic_algorithms(saved["torch deterministic algorithms"])
    torch.set_float32_matmul_precision(saved["torch float32 matmul precision"])
    torch.backends.cudnn.allow_tf32 = saved["cuDNN TF32"]


@pytest.fixture(scope="session")
def installed_backends() -> None:
    """The registry an install has: entry points loaded and, where nsa_kernels imports (a
    checkout run from PYTHONPATH has no entry points), its backends registered.

    Done once before the first test, so that no test's outcome depends on whether an earlier
    test in its process happened to register the kernels.
    """
    from nsa_core import registry

    registry.load_entry_points()
    if importlib.util.find_spec("nsa_kernels") is not None:
        from nsa_kernels.registration import register

        register(registry.register_backend)


@pytest.fixture(autouse=True)
def shared_state_unchanged(installed_backends: None) -> Iterator[None]:
    """Fail the test that leaves the shared process state changed (and restore it)."""
    from nsa_core import registry

    before = _shared_state()
    with registry.restored_on_exit():
        yield
        after = _shared_state()
    changed = [key for key in before if before[key] != after[key]]
    if changed:
        _restore(before)
        details = "; ".join(f"{k}: {before[k]!r} -> {after[k]!r}" for k in changed)
        pytest.fail(f"the test left shared state changed ({details})", pytrace=False)


@pytest.fixture(autouse=True)
def cuda_cache_released() -> Iterator[None]:
    """Return a worker's cached CUDA blocks to the card after a test that left many reserved."""
    yield
    initialized: bool = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    if initialized and torch.cuda.memory_reserved() > RELEASE_GIB * 2**30:
        torch.cuda.empty_cache()
