"""nsa-kernels tests: this folder holds ``kernel_testlib``, which the tests of every step import.

pytest (import mode ``prepend``, the default) puts the folder of each conftest.py on ``sys.path``
before it collects below it, so ``import kernel_testlib`` works from every subfolder whichever
paths a tier names (ci/tiers.py). Its fixtures serve every step's tests as well.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def kernels_registered() -> None:
    """The kernels' backends in nsa_core's registry, as an install's entry point puts them there.

    A GPU host may run the checkout from PYTHONPATH, with no installed metadata to load.
    """
    from nsa_core import registry
    from nsa_kernels.registration import register

    register(registry.register_backend)


@pytest.fixture
def isolated_registry() -> Iterator[None]:
    """nsa_core's registry with its reference backends alone for the test, restored after it."""
    from nsa_core import registry

    with registry.isolated_registry():
        yield
