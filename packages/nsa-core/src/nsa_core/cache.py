"""The decode cache of one NSA layer (docs/spec.md, "Decode")."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from nsa_core.checks import (
    check_config,
    check_device,
    check_float_dtype,
    check_int,
    check_length,
    check_rank,
    check_same_place,
    shape,
)
from nsa_core.config import NSAConfig
from nsa_core.limits import MAX_TOKENS


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

    - selected branch: K/V of every past token, ``k_sel [B, length, H, dk]``;
    - sliding branch: K/V of the last ``min(w, length)`` tokens;
    - compressed branch: the raw K/V of tokens not yet folded into a block
      (tokens ``[num_cmp * d, length)``) and the emitted blocks ``k_cmp [B, num_cmp, H, dk]``.

    Storage for the growing parts is over-allocated; the properties give the logical views.
    :meth:`empty` makes one; the constructor checks that its fields fit together (every tensor
    [B, *, H, D] of the config's heads and head dims, one floating dtype and device, lengths
    within the storage), as ``dataclasses.replace`` does.
    """

    config: NSAConfig
    _k_sel: torch.Tensor
    _v_sel: torch.Tensor
    _k_cmp: torch.Tensor
    _v_cmp: torch.Tensor
    k_win: torch.Tensor
    v_win: torch.Tensor
    k_raw: torch.Tensor
    v_raw: torch.Tensor
    length: int = 0
    num_cmp: int = 0

    def __post_init__(self) -> None:
        config = check_config(self.config)
        h, dk, dv = config.num_kv_heads, config.head_dim_qk, config.head_dim_v
        first: torch.Tensor | None = None
        for name, dim in (
            ("_k_sel", dk), ("_v_sel", dv), ("_k_cmp", dk), ("_v_cmp", dv),
            ("k_win", dk), ("v_win", dv), ("k_raw", dk), ("v_raw", dv),
        ):  # fmt: skip
            t = getattr(self, name)
            check_rank(name, t, 4, "[B, n, H, D]")
            if first is None:
                first = t
                check_float_dtype(f"{name}.dtype", t.dtype)
            check_same_place(name, t, "_k_sel", first)
            if (t.shape[0], t.shape[2], t.shape[3]) != (first.shape[0], h, dim):
                raise ValueError(
                    f"{name} {shape(t)} must be [B={first.shape[0]}, n, H={h}, D={dim}] "
                    "(the config's heads and head dims)"
                )
        length = check_length("length", self.length)
        num_cmp = check_length("num_cmp", self.num_cmp)
        for name, rows, room in (
            ("length", length, min(self._k_sel.shape[1], self._v_sel.shape[1])),
            ("num_cmp", num_cmp, min(self._k_cmp.shape[1], self._v_cmp.shape[1])),
            ("k_win", self.k_win.shape[1], min(config.window, length)),
            ("v_win", self.v_win.shape[1], min(config.window, length)),
            ("k_raw", self.k_raw.shape[1], length),
            ("v_raw", self.v_raw.shape[1], length),
        ):
            if rows > room:
                raise ValueError(f"{name} ({rows} entries) must be <= {room}, what the cache holds")

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
        check_config(config)
        check_int("batch", batch, 0)
        check_int("capacity", capacity, 0, MAX_TOKENS)
        device = check_device("device", device)
        check_float_dtype("dtype", dtype)
        h, dk, dv = config.num_kv_heads, config.head_dim_qk, config.head_dim_v
        cap_cmp = max(0, (capacity - config.cmp_block) // config.cmp_stride + 1)

        def z(n: int, d: int) -> torch.Tensor:
            return torch.zeros(batch, n, h, d, device=device, dtype=dtype)

        return cls(
            config=config,
            _k_sel=z(capacity, dk),
            _v_sel=z(capacity, dv),
            _k_cmp=z(cap_cmp, dk),
            _v_cmp=z(cap_cmp, dv),
            k_win=z(0, dk),
            v_win=z(0, dv),
            k_raw=z(0, dk),
            v_raw=z(0, dv),
        )

    @property
    def k_sel(self) -> torch.Tensor:
        """[B, length, H, dk]."""
        return self._k_sel[:, : self.length]

    @property
    def v_sel(self) -> torch.Tensor:
        """[B, length, H, dv]."""
        return self._v_sel[:, : self.length]

    @property
    def k_cmp(self) -> torch.Tensor:
        """[B, num_cmp, H, dk] emitted compressed keys."""
        return self._k_cmp[:, : self.num_cmp]

    @property
    def v_cmp(self) -> torch.Tensor:
        """[B, num_cmp, H, dv] emitted compressed values."""
        return self._v_cmp[:, : self.num_cmp]

    @property
    def batch(self) -> int:
        """B, the sequences the cache holds."""
        return self._k_sel.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of every tensor of the cache."""
        return self._k_sel.dtype

    @property
    def device(self) -> torch.device:
        """The device of every tensor of the cache."""
        return self._k_sel.device

    def check_compatible(
        self, config: NSAConfig, batch: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        """Refuse a step whose layer config, batch, dtype or device is not this cache's.

        ``dtype`` is the one the step computes keys and values in (the layer's
        ``compute_dtype()``): the cache holds them in that dtype (docs/spec.md, "Decode").
        """
        built = "cache was built for another layer config or batch size"
        if self.config != config:
            raise ValueError(f"{built}: cache.config {self.config} differs from {config}")
        if self.batch != batch:
            raise ValueError(f"{built}: cache holds batch {self.batch} but x has batch {batch}")
        if self.dtype != dtype:
            raise TypeError(
                f"cache dtype {self.dtype} differs from {dtype}, the dtype this step computes "
                "keys and values in (the autocast dtype where autocast is on, the layer's dtype "
                "otherwise): decode under the autocast setting the cache was built with"
            )
        if self.device != device:
            raise ValueError(f"cache is on {self.device} but x is on {device}")

    def _check_new(self, name: str, t: torch.Tensor, dim: int) -> int:
        """t [B, n, H, dim] of the cache's dtype and device; -> n."""
        check_rank(name, t, 4, "[B, n, H, D]")
        batch, n, h, d = t.shape
        if (batch, h, d) != (self.batch, self.config.num_kv_heads, dim):
            raise ValueError(
                f"{name} {shape(t)} must be [B={self.batch}, n, H={self.config.num_kv_heads}, "
                f"D={dim}]"
            )
        if t.dtype != self.dtype:
            raise TypeError(f"{name} dtype {t.dtype} differs from the cache dtype {self.dtype}")
        if t.device != self.device:
            raise ValueError(f"{name} is on {t.device} but the cache is on {self.device}")
        return n

    def _check_pair(self, names: tuple[str, str], k: torch.Tensor, v: torch.Tensor) -> int:
        """Keys and values of one branch, the same number of them; -> that number."""
        nk = self._check_new(names[0], k, self.config.head_dim_qk)
        nv = self._check_new(names[1], v, self.config.head_dim_v)
        if nv != nk:
            raise ValueError(f"{names[1]} {shape(v)} holds {nv} entries but {names[0]} holds {nk}")
        return nk

    def check_tokens(
        self,
        k_sel: torch.Tensor,
        v_sel: torch.Tensor,
        k_win: torch.Tensor,
        v_win: torch.Tensor,
        k_raw: torch.Tensor,
        v_raw: torch.Tensor,
    ) -> None:
        """Every rule of :meth:`append_tokens`; raises before anything changes.

        The selected branch gets every new token; the window and raw parts may come already
        trimmed to their tails, so they hold at most as many.
        """
        n = self._check_pair(("k_sel", "v_sel"), k_sel, v_sel)
        for names, k, v in ((("k_win", "v_win"), k_win, v_win), (("k_raw", "v_raw"), k_raw, v_raw)):
            if self._check_pair(names, k, v) > n:
                raise ValueError(
                    f"{names[0]} {shape(k)} holds more tokens than the {n} new ones of k_sel"
                )
        if self.length + n > MAX_TOKENS:
            raise ValueError(
                f"the cache holds {self.length} tokens; {n} more pass the {MAX_TOKENS} that "
                "int32 positions address"
            )

    def check_blocks(self, k_cmp: torch.Tensor, v_cmp: torch.Tensor, consumed: object) -> None:
        """Every rule of :meth:`append_blocks`; raises before anything changes."""
        self._check_pair(("k_cmp", "v_cmp"), k_cmp, v_cmp)
        check_int("consumed", consumed, 0, self.k_raw.shape[1])

    def snapshot(self) -> dict[str, Any]:
        """Every field as it is now (tensors by reference), for :meth:`restore`.

        Appends replace the logical views or write past ``length``/``num_cmp`` only, so the
        references taken here keep the state they had.
        """
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def restore(self, snapshot: dict[str, Any]) -> None:
        """Put back the fields of :meth:`snapshot`."""
        for name, value in snapshot.items():
            setattr(self, name, value)

    def append_tokens(
        self,
        k_sel: torch.Tensor,
        v_sel: torch.Tensor,
        k_win: torch.Tensor,
        v_win: torch.Tensor,
        k_raw: torch.Tensor,
        v_raw: torch.Tensor,
    ) -> None:
        """Add the K/V of new tokens [B, n, H, D] for each branch (compressed: raw, unfolded)."""
        self.check_tokens(k_sel, v_sel, k_win, v_win, k_raw, v_raw)
        w = self.config.window
        self._k_sel = _append(self._k_sel, self.length, k_sel)
        self._v_sel = _append(self._v_sel, self.length, v_sel)
        self.k_win = torch.cat([self.k_win, k_win], dim=1)[:, -w:]
        self.v_win = torch.cat([self.v_win, v_win], dim=1)[:, -w:]
        self.k_raw = torch.cat([self.k_raw, k_raw], dim=1)
        self.v_raw = torch.cat([self.v_raw, v_raw], dim=1)
        self.length += k_sel.shape[1]

    def append_blocks(self, k_cmp: torch.Tensor, v_cmp: torch.Tensor, consumed: int) -> None:
        """Add emitted blocks [B, n, H, D] and drop ``consumed`` raw tokens no later block needs."""
        self.check_blocks(k_cmp, v_cmp, consumed)
        self._k_cmp = _append(self._k_cmp, self.num_cmp, k_cmp)
        self._v_cmp = _append(self._v_cmp, self.num_cmp, v_cmp)
        self.num_cmp += k_cmp.shape[1]
        self.k_raw = self.k_raw[:, consumed:]
        self.v_raw = self.v_raw[:, consumed:]

    def state(self) -> dict[str, torch.Tensor]:
        """The logical content, for comparing two caches."""
        return {
            "k_sel": self.k_sel,
            "v_sel": self.v_sel,
            "k_win": self.k_win,
            "v_win": self.v_win,
            "k_raw": self.k_raw,
            "v_raw": self.v_raw,
            "k_cmp": self.k_cmp,
            "v_cmp": self.v_cmp,
        }
