"""Markers that say what a test needs; a missing requirement skips with its reason."""

from __future__ import annotations

import pytest
import torch

# --record-triton-launches DIR: the interpreter tier writes its launches for ci/compile_triton.py.
pytest_plugins = ("ci.triton_launches",)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_cuda = torch.cuda.is_available()
    run_slow = config.getoption("--run-slow")
    for item in items:
        if not has_cuda and any(item.get_closest_marker(m) for m in ("gpu", "fa2", "cuda")):
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; none is visible to torch"))
        if item.get_closest_marker("slow") and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow test; opt in with --run-slow"))
