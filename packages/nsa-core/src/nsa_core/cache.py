"""The decode cache of one NSA layer (docs/spec.md, "Decode")."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nsa_core.config import NSAConfig


def _append(buf: torch.Tensor, length: int, new: torch.Tensor) -> torch.Tensor:
    """Write ``new`` [B, n, H, D] at ``buf[:, length:]``, doubling capacity when full."""
    need = length + new.shape[1]
    if need > buf.shape[1]:
        grown = buf.new_zeros(buf.shape[0], max(need, 2 * buf.shape[1]), *buf.shape[2:])
        grown[:, :length] = buf[:, :length]
        buf = grown
    buf[:, length:need] = new
    return buf


@dataclass
class NSACache:
    """What a decode step needs, for B sequences that all hold ``length`` tokens.

    - selected branch: K/V of every past token, ``k_slc [B, length, H, dk]``;
    - sliding branch: K/V of the last ``min(w, length)`` tokens;
    - compressed branch: the raw K/V of tokens not yet folded into a block
      (tokens ``[num_cmp * d, length)``) and the emitted blocks ``k_cmp [B, num_cmp, H, dk]``.

    Storage for the growing parts is over-allocated; the properties give the logical views.
    """

    config: NSAConfig
    length: int = 0
    num_cmp: int = 0
    _k_slc: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    _v_slc: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    _k_cmp: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    _v_cmp: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    k_win: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    v_win: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    k_raw: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    v_raw: torch.Tensor = field(default_factory=lambda: torch.empty(0))

    @classmethod
    def empty(
        cls,
        config: NSAConfig,
        batch: int,
        *,
        capacity: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> NSACache:
        """A cache with no tokens; ``capacity`` pre-allocates that many tokens."""
        h, dk, dv = config.num_kv_heads, config.head_dim_qk, config.head_dim_v
        cap_cmp = max(0, (capacity - config.cmp_block) // config.cmp_stride + 1)

        def z(n: int, d: int) -> torch.Tensor:
            return torch.zeros(batch, n, h, d, device=device, dtype=dtype)

        return cls(
            config=config,
            _k_slc=z(capacity, dk),
            _v_slc=z(capacity, dv),
            _k_cmp=z(cap_cmp, dk),
            _v_cmp=z(cap_cmp, dv),
            k_win=z(0, dk),
            v_win=z(0, dv),
            k_raw=z(0, dk),
            v_raw=z(0, dv),
        )

    @property
    def k_slc(self) -> torch.Tensor:
        """[B, length, H, dk]."""
        return self._k_slc[:, : self.length]

    @property
    def v_slc(self) -> torch.Tensor:
        """[B, length, H, dv]."""
        return self._v_slc[:, : self.length]

    @property
    def k_cmp(self) -> torch.Tensor:
        """[B, num_cmp, H, dk] emitted compressed keys."""
        return self._k_cmp[:, : self.num_cmp]

    @property
    def v_cmp(self) -> torch.Tensor:
        """[B, num_cmp, H, dv] emitted compressed values."""
        return self._v_cmp[:, : self.num_cmp]

    def append_tokens(
        self,
        k_slc: torch.Tensor,
        v_slc: torch.Tensor,
        k_win: torch.Tensor,
        v_win: torch.Tensor,
        k_raw: torch.Tensor,
        v_raw: torch.Tensor,
    ) -> None:
        """Add the K/V of new tokens [B, n, H, D] for each branch (compressed: raw, unfolded)."""
        w = self.config.window
        self._k_slc = _append(self._k_slc, self.length, k_slc)
        self._v_slc = _append(self._v_slc, self.length, v_slc)
        self.k_win = torch.cat([self.k_win, k_win], dim=1)[:, -w:]
        self.v_win = torch.cat([self.v_win, v_win], dim=1)[:, -w:]
        self.k_raw = torch.cat([self.k_raw, k_raw], dim=1)
        self.v_raw = torch.cat([self.v_raw, v_raw], dim=1)
        self.length += k_slc.shape[1]

    def append_blocks(self, k_cmp: torch.Tensor, v_cmp: torch.Tensor, consumed: int) -> None:
        """Add emitted blocks [B, n, H, D] and drop ``consumed`` raw tokens no later block needs."""
        self._k_cmp = _append(self._k_cmp, self.num_cmp, k_cmp)
        self._v_cmp = _append(self._v_cmp, self.num_cmp, v_cmp)
        self.num_cmp += k_cmp.shape[1]
        self.k_raw = self.k_raw[:, consumed:]
        self.v_raw = self.v_raw[:, consumed:]

    def state(self) -> dict[str, torch.Tensor]:
        """The logical content, for comparing two caches."""
        return {
            "k_slc": self.k_slc,
            "v_slc": self.v_slc,
            "k_win": self.k_win,
            "v_win": self.v_win,
            "k_raw": self.k_raw,
            "v_raw": self.v_raw,
            "k_cmp": self.k_cmp,
            "v_cmp": self.v_cmp,
        }
