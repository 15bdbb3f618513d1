"""Fixtures shared by the nsa-core tests: fresh, reproducible random inputs for every test id."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterator

import pytest
import torch

from nsa_core import NSAAttention, NSAConfig, registry


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A generator seeded from the test id: each parametrized case draws its own inputs."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


LayerFactory = Callable[..., NSAAttention]


@pytest.fixture
def make_layer(gen: torch.Generator) -> LayerFactory:
    """Build an NSAAttention whose parameters are drawn from ``gen`` (scaled by 1/sqrt(fan_in))."""

    def build(
        config: NSAConfig, hidden_size: int, dtype: torch.dtype = torch.float64
    ) -> NSAAttention:
        layer = NSAAttention(config, hidden_size).to(dtype)
        with torch.no_grad():
            for p in layer.parameters():
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                p.copy_(
                    torch.randn(p.shape, generator=gen, dtype=torch.float64) / math.sqrt(fan_in)
                )
        return layer

    return build


@pytest.fixture
def isolated_registry() -> Iterator[None]:
    """Only nsa-core's reference backends, no entry points; the previous state is restored."""
    with registry.isolated_registry():
        yield


def pytest_configure(config: pytest.Config) -> None:
    # xdist runs one worker per core; intra-op threads on top of that only contend.
    if hasattr(config, "workerinput"):
        torch.set_num_threads(1)
