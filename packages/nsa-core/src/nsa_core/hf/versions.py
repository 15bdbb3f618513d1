"""The transformers releases nsa_core.hf is tested with, and the check that refuses the others.

This table is the one place the range lives: nsa-core's ``hf`` extra in pyproject.toml states
the same bounds, and a test holds the two together. The check reads the installed version from
the package metadata, before anything imports transformers (an unsupported release may fail
inside its own imports, far from the reason).
"""

from __future__ import annotations

import re
from importlib import metadata

# [lowest, first unsupported) as (major, minor) release numbers of transformers.
TRANSFORMERS_SUPPORTED = ((5, 24), (5, 25))


def supported_text() -> str:
    """The supported range as a pip specifier: ``>=5.24,<5.25``."""
    (lo_major, lo_minor), (hi_major, hi_minor) = TRANSFORMERS_SUPPORTED
    return f">={lo_major}.{lo_minor},<{hi_major}.{hi_minor}"


def installed_transformers() -> str | None:
    """The installed transformers version string, or None when it is not installed."""
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


def check_transformers() -> str:
    """The installed transformers version; ImportError unless it is in the supported range
    (ModuleNotFoundError, named ``transformers``, when it is not installed at all).

    A pre-release or local build is judged by its release numbers (``5.24.0rc1`` is 5.24).
    """
    wanted = f"transformers{supported_text()}"
    found = installed_transformers()
    if found is None:
        raise ModuleNotFoundError(
            f"nsa_core.hf needs {wanted}; transformers is not installed", name="transformers"
        )
    release = re.match(r"\d+(?:\.\d+)*", found)
    if release is None:
        raise ImportError(
            f"nsa_core.hf needs {wanted}; cannot read the installed version {found!r}"
        )
    numbers = tuple(int(p) for p in release[0].split("."))
    major_minor = (*numbers, 0)[:2]
    low, high = TRANSFORMERS_SUPPORTED
    if not low <= major_minor < high:
        raise ImportError(
            f"nsa_core.hf needs {wanted} (the tested range); transformers {found} is installed. "
            f'Install the extra: pip install "nsa-core[hf]"'
        )
    return found
