"""Typed tile configs of the Triton kernels: the parsing, printing and checks they share.

A kernel's tiles and launch parameters are a frozen dataclass of int fields deriving from
:class:`TileConfig`, where 0 means "choose" (each kernel's ``resolve_config`` fills it in). They
reach the kernels only as ``config=`` arguments; benches and tests write them as text,
``"block_l=64,fwd_warps=4"``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import TypeVar

ConfigT = TypeVar("ConfigT", bound="TileConfig")


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Base of the kernels' tile configs (subclasses add int fields, 0 = choose).

    A config a user hands to a kernel entry is checked there (:func:`check_config`: every field
    an int >= 0), not at construction, which the kernels' own ``resolve_config`` repeats on
    every call; ``resolve_config`` checks the rest (powers of two, ranges).
    """

    @classmethod
    def parse(cls: type[ConfigT], text: str) -> ConfigT:
        """``"name=value,..."`` -> the config; unnamed fields keep 0 (choose).

        Raises ValueError naming the field for an unknown name or a value that is not an int
        (or below 0), TypeError when ``text`` is not a str.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str such as 'block_l=64', got {type(text).__name__}")
        values: dict[str, int] = {}
        names = {f.name for f in dataclasses.fields(cls)}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, _, raw = item.partition("=")
            name = name.strip()
            if name not in names:
                raise ValueError(
                    f"unknown {cls.__name__} field {name!r} in {text!r}; known: {sorted(names)}"
                )
            try:
                values[name] = int(raw)
            except ValueError:
                raise ValueError(
                    f"{cls.__name__} field {name!r} needs an int, got {raw!r} in {text!r}"
                ) from None
        config = cls(**values)
        check_config(config, cls)
        return config

    def describe(self) -> str:
        """``"name=value,..."`` over every field, the text :meth:`parse` reads back."""
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))


def check_config(config: object, kind: type) -> None:
    """``config`` is None (every field chosen) or a ``kind`` (a dataclass) whose every field is
    an int >= 0: TypeError for another kind of config or a field that is not an int (a float,
    even 64.0, or a bool), ValueError for a field below 0, each naming ``Kind.field``."""
    if config is None:
        return
    if not isinstance(config, kind):
        raise TypeError(f"config must be a {kind.__name__} or None, got {type(config).__name__}")
    for name, value in vars(config).items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(
                f"{kind.__name__}.{name} must be an int, got {type(value).__name__} {value!r}"
            )
        if value < 0:
            raise ValueError(f"{kind.__name__}.{name} must be >= 0 (0 = choose), got {value}")


def pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1)."""
    return 1 << max(0, (x - 1).bit_length())


def check_pow2_tiles(config: TileConfig, names: Iterable[str]) -> None:
    """Raise ValueError unless each named field of ``config`` is 0 or a power of two >= 16."""
    for name in names:
        value = getattr(config, name)
        if value and (value < 16 or value & (value - 1)):
            raise ValueError(f"{name}={value} must be 0 or a power of two >= 16")


def stages_within(wanted: int, needs: Mapping[int, int], shared_bytes: int | None) -> int:
    """The most pipeline stages <= ``wanted`` whose shared memory fits ``shared_bytes``.

    ``needs`` maps a stage count to the bytes a launch asks at it (measured by compiling it,
    ci/compile_triton.py); counts it does not list fit. ``shared_bytes`` None (the interpreter,
    or no limit known): ``wanted``. Never below 1.
    """
    if shared_bytes is None:
        return wanted
    for stages in range(wanted, 1, -1):
        if needs.get(stages, 0) <= shared_bytes:
            return stages
    return 1
