"""The decode cache of a padded batch whose rows hold different numbers of tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nsa_core.cache import NSACache
from nsa_core.checks import check_int
from nsa_core.config import NSAConfig


@dataclass
class RaggedNSACache:
    """Decode state of B sequences of different lengths: one batch-1 :class:`NSACache` per row.

    ``rows[b]`` holds sequence b's tokens (its length is ``rows[b].length``, perhaps 0);
    ``starts[b]`` is the column of its first token in the padded input of the prefill that built
    the cache (0 for a row without tokens). Each decode step gives every row one more token,
    which follows the input's last column.

    This is the reference semantics of ragged decode: a step runs the rows one after another
    through the batch-1 path. A ragged cache that steps every row in one call will replace this
    loop; it must give the same outputs and leave the same per-row states.
    """

    rows: list[NSACache]
    starts: list[int]

    def __post_init__(self) -> None:
        if not isinstance(self.rows, list) or not all(isinstance(r, NSACache) for r in self.rows):
            raise TypeError("rows must be a list of NSACache")
        if not isinstance(self.starts, list):
            raise TypeError(f"starts must be a list of int, got {type(self.starts).__name__}")
        if len(self.starts) != len(self.rows):
            raise ValueError(f"starts must be a list with one column per row ({len(self.rows)})")
        for b, start in enumerate(self.starts):
            check_int(f"starts[{b}]", start, 0)
        for b, row in enumerate(self.rows):
            if row.batch != 1:
                raise ValueError(f"rows[{b}] must hold one sequence, got batch {row.batch}")

    @property
    def batch(self) -> int:
        """B, the sequences the cache holds."""
        return len(self.rows)

    @property
    def lengths(self) -> list[int]:
        """Each row's token count: the position its next decode step takes."""
        return [row.length for row in self.rows]

    def check_compatible(
        self, config: NSAConfig, batch: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        """Refuse a step whose layer config, batch, dtype or device is not every row's."""
        if self.batch != batch:
            raise ValueError(
                f"cache was built for another batch size: cache holds {self.batch} rows but x "
                f"has batch {batch}"
            )
        for row in self.rows:
            row.check_compatible(config, 1, dtype, device)
