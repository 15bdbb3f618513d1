"""Is this triton the one this torch was built with? The answer from the version table.

A torch release's Linux wheel pins one triton (see :mod:`nsa_kernels.version_table`). Kernels
compiled by a different triton than the one torch expects fail in ways that look like kernel bugs,
so benches and the GPU runner record the verdict beside every result:

- ``paired``: triton's release matches the pin of torch's minor (``"3.6.0"`` exactly, ``"3.3.x"``
  any patch of 3.3);
- ``mismatched``: it does not, or triton is not importable;
- ``unknown``: torch's minor is not in the table, or a version string cannot be read.

Versions are compared by their release numbers (PEP 440): a local label (``2.11.0+cu130``,
``3.6.0+git9a1b2c3``), a pre-release (``2.11.0rc1``) or a dev build (``2.11.0.dev20251201``) is
judged by its release, and the reason says so. This module does not import torch or triton until
:func:`installed_pairing` is called.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Literal

from nsa_kernels.version_table import CELLS, Cell

Verdict = Literal["paired", "mismatched", "unknown"]

_VERSION = re.compile(
    r"""
    v?(?P<release>\d+(?:\.\d+)*)
    (?:[-_.]?(?P<pre_l>a|alpha|b|beta|c|rc|pre|preview)[-_.]?(?P<pre_n>\d*))?
    (?:-(?P<post_implicit>\d+)|[-_.]?(?:post|rev|r)[-_.]?(?P<post_n>\d*))?
    (?:[-_.]?(?P<dev>dev)[-_.]?(?P<dev_n>\d*))?
    (?:\+(?P<local>[a-z0-9]+(?:[-_.][a-z0-9]+)*))?
    """,
    re.VERBOSE | re.IGNORECASE,
)


@dataclass(frozen=True)
class Version:
    """A PEP 440 version, reduced to what pairing needs: ``release`` and what qualifies it."""

    text: str
    release: tuple[int, ...]
    pre: str | None
    dev: bool
    local: str | None

    @property
    def qualified(self) -> bool:
        """True for a pre-release, a dev build or a local build: judged by its release only."""
        return self.pre is not None or self.dev or self.local is not None

    @property
    def release_text(self) -> str:
        return ".".join(map(str, self.release))


def parse_version(text: str) -> Version:
    """Parse ``text`` (e.g. ``"2.11.0+cu130"``); raises ``ValueError`` if it is not PEP 440,
    ``TypeError`` if it is not a str."""
    if not isinstance(text, str):
        raise TypeError(f"a version must be a str, got {type(text).__name__} {text!r}")
    m = _VERSION.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"{text!r} is not a version")
    pre = f"{m['pre_l'].lower()}{m['pre_n'] or 0}" if m["pre_l"] else None
    return Version(
        text=text.strip(),
        release=tuple(int(p) for p in m["release"].split(".")),
        pre=pre,
        dev=m["dev"] is not None,
        local=m["local"],
    )


def _padded(release: tuple[int, ...], n: int) -> tuple[int, ...]:
    return release + (0,) * (n - len(release))


def matches(triton: Version, pin: str) -> bool:
    """Whether triton's release satisfies a pin: ``"3.6.0"`` exactly, ``"3.3.x"`` any patch."""
    if pin.endswith(".x"):
        prefix = tuple(int(p) for p in pin[:-2].split("."))
        return _padded(triton.release, len(prefix))[: len(prefix)] == prefix
    exact = tuple(int(p) for p in pin.split("."))
    n = max(len(exact), len(triton.release))
    return _padded(triton.release, n) == _padded(exact, n)


def find_cell(torch_version: Version) -> Cell | None:
    """The table row of torch's minor, or None when the table does not know it."""
    if len(torch_version.release) < 2:
        return None
    minor = f"{torch_version.release[0]}.{torch_version.release[1]}"
    for cell in CELLS:
        if cell["torch"] == minor:
            return cell
    return None


@dataclass(frozen=True)
class Pairing:
    """The verdict on one (torch, triton) pair, with what the table expected and why.

    ``expected`` is the pin of torch's minor (``"3.3.x"``); ``release_pin`` the exact specifier of
    torch's own release when the table lists it (``"==3.3.1"``); ``supported`` whether the project
    supports that cell of the table.
    """

    verdict: Verdict
    torch: str | None
    triton: str | None
    cell: str | None
    expected: str | None
    release_pin: str | None
    supported: bool
    reason: str

    def __str__(self) -> str:
        return f"{self.verdict}: {self.reason}"


def _qualifier_note(name: str, version: Version) -> str:
    if not version.qualified:
        return ""
    return f"; {name} {version.text} is judged by its release {version.release_text}"


def _result(
    kind: Verdict,
    reason: str,
    torch_version: str | None,
    triton_version: str | None,
    cell: Cell | None = None,
    release_pin: str | None = None,
) -> Pairing:
    return Pairing(
        verdict=kind,
        torch=torch_version,
        triton=triton_version,
        cell=cell["torch"] if cell else None,
        expected=cell["triton"] if cell else None,
        release_pin=release_pin,
        supported=bool(cell and cell["supported"]),
        reason=reason,
    )


def pairing(torch_version: str | None, triton_version: str | None) -> Pairing:
    """Judge a torch/triton pair given their version strings (None: not installed).

    >>> pairing("2.3.1", "3.0.0").verdict
    'mismatched'
    >>> pairing("2.11.0+cu130", "3.6.0").verdict
    'paired'

    A version string that is not PEP 440 gives the verdict ``unknown``; a version that is not a
    str (a float such as 2.11 loses its digits) raises TypeError.
    """
    for name, value in (("torch_version", torch_version), ("triton_version", triton_version)):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{name} must be a str or None, got {type(value).__name__} {value!r}")
    versions = (torch_version, triton_version)
    if torch_version is None:
        return _result("unknown", "torch is missing (not installed or not importable)", *versions)
    try:
        torch_v = parse_version(torch_version)
    except ValueError:
        return _result("unknown", f"cannot read torch version {torch_version!r}", *versions)
    cell = find_cell(torch_v)
    if cell is None:
        known = f"{CELLS[0]['torch']} .. {CELLS[-1]['torch']}"
        minor = ".".join(map(str, torch_v.release[:2]))
        reason = f"torch {minor} is not in the version table ({known})"
        return _result("unknown", reason, *versions)

    pin = cell["releases"].get(torch_v.release_text)
    expected = f"torch {cell['torch']} pins triton {cell['triton']}"
    if triton_version is None:
        return _result("mismatched", f"triton is missing; {expected}", *versions, cell, pin)
    try:
        triton_v = parse_version(triton_version)
    except ValueError:
        reason = f"cannot read triton version {triton_version!r}"
        return _result("unknown", reason, *versions, cell, pin)

    notes = _qualifier_note("torch", torch_v) + _qualifier_note("triton", triton_v)
    if not matches(triton_v, cell["triton"]):
        reason = f"triton {triton_v.release_text}, but {expected}{notes}"
        return _result("mismatched", reason, *versions, cell, pin)
    if pin is not None and pin.startswith("==") and not matches(triton_v, pin[2:]):
        notes += f"; torch {torch_v.release_text}'s own wheel asks for triton{pin}"
    reason = f"triton {triton_v.release_text} and {expected}{notes}"
    return _result("paired", reason, *versions, cell, pin)


def _imported_version(module_name: str) -> tuple[str | None, str | None]:
    """(version, None) of an importable module, or (None, why it is not importable)."""
    try:
        module = __import__(module_name)
    except Exception as err:  # a broken install raises more than ImportError
        return None, f"import {module_name} failed: {type(err).__name__}: {err}"
    return str(module.__version__), None


def installed_pairing() -> Pairing:
    """The verdict on the torch and triton this interpreter imports."""
    torch_version, torch_error = _imported_version("torch")
    triton_version, triton_error = _imported_version("triton")
    result = pairing(torch_version, triton_version)
    errors = "; ".join(e for e in (torch_error, triton_error) if e)
    if errors:
        result = replace(result, reason=f"{result.reason} ({errors})")
    return result
