"""The device-resident decode state of one NSA layer for B sequences of different lengths.

docs/spec.md, "Decode": a step needs the selected-branch K/V of every past token, the last w
sliding-branch K/V, the raw compressed-branch K/V not yet folded into a block and the emitted
compressed K~/V~. Here every part lives in a buffer of fixed size allocated once, and the
lengths live on the device, so a step launches the same kernels with the same arguments at every
position (what a CUDA graph needs).

Layout, for sequence b holding ``L_b = cache_seqlens[b]`` tokens:

- ``k_sel [B, capacity, H, dk]``, ``v_sel [B, capacity, H, dv]``: token p at row p.
- ``k_win [B, w, H, dk]``, ``v_win``: a ring, token p at row ``p % w`` (the last ``min(w, L_b)``).
- ``k_raw [B, l, H, dk]``, ``v_raw``: a ring, token p at row ``p % l``. The tokens not yet folded
  into a block, ``[num_cmp[b] * d, L_b)``, are at most l - 1, and the l tokens of a block that
  completes are all in the ring when its last token arrives.
- ``k_cmp [B, max(1, N_cmp(capacity)), H, dk]``, ``v_cmp``: compressed block i at row i.
- paged (``block_table`` set): ``k_sel [num_pages, page_size, H, dk]``, ``v_sel``: a pool of
  pages, token p of sequence b at row ``p % page_size`` of page ``block_table[b, p // page_size]``
  (``block_table`` int32 [B, pages per sequence], -1 where b has no page: a step at such a
  position finds the sequence full). The other buffers stay per sequence: their rows are
  bounded by w, l and N_cmp(capacity).
- ``cache_seqlens [B]`` int32: L_b, the position of the next token.
- ``num_cmp [B]`` int32: emitted compressed blocks, ``N_cmp(L_b)``.
- ``overflow [B]`` int32: 1 once a step found its sequence at capacity; that step left the
  sequence as it was (see :meth:`DecodeState.check_capacity`).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields

import torch

from nsa_core import NSACache, NSAConfig, num_cmp_blocks, split_blocks
from nsa_core.checks import check_int, check_rank, check_same_place, shape
from nsa_core.limits import MAX_TOKENS
from nsa_kernels.common.entry_checks import check_callable, check_device, check_float_dtype

# phi of one block per (sequence, kv head): blocks [B, H, l, D] -> [B, H, D].
BlockPhi = Callable[[torch.Tensor], torch.Tensor]

BRANCHES = ("cmp", "sel", "win")


def block_phi(module: Callable[[torch.Tensor], torch.Tensor]) -> BlockPhi:
    """Adapt an nsa_core phi (blocks [B, N, l, H, D] -> [B, N, H, D], e.g. ``CompressMLP``).

    The result maps blocks [B, H, l, D] -> [B, H, D], the form :func:`decode_step` calls.
    """

    if not callable(module):
        kind = type(module).__name__
        raise TypeError(f"module must be callable (e.g. a CompressMLP), got {kind}")

    def phi(blocks: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = module(blocks.permute(0, 2, 1, 3).unsqueeze(1))  # [B, 1, l, H, D]
        return out.squeeze(1)

    return phi


def compress_prefix(x: torch.Tensor, config: NSAConfig, phi: BlockPhi | None) -> torch.Tensor:
    """Compressed keys or values of one prefix: x [T, H, D] -> [N_cmp(T), H, D].

    phi None is the mean over the block; otherwise every block goes through ``phi`` as one
    batch entry.
    """
    blocks = split_blocks(x.unsqueeze(0), config.cmp_block, config.cmp_stride)[0]  # [N, l, H, D]
    if phi is None:
        return blocks.mean(dim=1)
    if blocks.shape[0] == 0:
        return x.new_zeros(0, x.shape[1], x.shape[2])
    return phi(blocks.permute(0, 2, 1, 3)).to(x.dtype)


@dataclass(frozen=True)
class PageTable:
    """Where a paged state's selected-branch K/V live (module docstring): ``block_table`` int32
    [B, pages per sequence] over a pool of ``num_pages`` pages of ``page_size`` tokens."""

    block_table: torch.Tensor
    page_size: int
    num_pages: int

    def __post_init__(self) -> None:
        check_rank("block_table", self.block_table, 2, "[B, pages per sequence]")
        if self.block_table.dtype != torch.int32:
            raise TypeError(f"block_table must be int32, got {self.block_table.dtype}")
        check_int("page_size", self.page_size, 1, MAX_TOKENS)
        check_int("num_pages", self.num_pages, 1, MAX_TOKENS)
        pages = self.block_table[self.block_table >= 0]
        if bool((self.block_table < -1).any()) or bool((pages >= self.num_pages).any()):
            raise ValueError(f"block_table entries must be -1 or page ids in [0, {self.num_pages})")
        if torch.unique(pages).numel() != pages.numel():
            raise ValueError("block_table lists a page twice: each page belongs to one sequence")

    @classmethod
    def for_capacities(
        cls,
        capacities: Sequence[int],
        page_size: int,
        *,
        device: torch.device | str,
        generator: torch.Generator | None = None,
    ) -> PageTable:
        """Pages for each sequence's ``capacities[b]`` tokens out of one pool (the sum of their
        pages), in pool order, or in a random order drawn from ``generator``."""
        page_size = check_int("page_size", page_size, 1, MAX_TOKENS)
        counts = [-(-check_int(f"capacities[{b}]", c, 0, MAX_TOKENS) // page_size)
                  for b, c in enumerate(capacities)]  # fmt: skip
        total = max(1, sum(counts))
        order = (
            torch.randperm(total, generator=generator).tolist()
            if generator is not None
            else list(range(total))
        )
        table = torch.full((len(counts), max(1, *counts)), -1, dtype=torch.int32)
        first = 0
        for b, count in enumerate(counts):
            table[b, :count] = torch.tensor(order[first : first + count], dtype=torch.int32)
            first += count
        return cls(block_table=table.to(device), page_size=page_size, num_pages=total)

    def rows(self, b: int, start: int, end: int) -> torch.Tensor:
        """The pool rows (page * page_size + offset) of sequence b's tokens [start, end)."""
        pos = torch.arange(start, end, device=self.block_table.device)
        pages = self.block_table[b, pos // self.page_size].to(torch.int64)
        if bool((pages < 0).any()):
            raise ValueError(f"sequence {b} has no page for some of its tokens [{start}, {end})")
        return pages * self.page_size + pos % self.page_size


@dataclass
class DecodeState:
    """Preallocated decode buffers and device-side lengths of B sequences (module docstring)."""

    config: NSAConfig
    capacity: int
    k_sel: torch.Tensor
    v_sel: torch.Tensor
    k_win: torch.Tensor
    v_win: torch.Tensor
    k_raw: torch.Tensor
    v_raw: torch.Tensor
    k_cmp: torch.Tensor
    v_cmp: torch.Tensor
    cache_seqlens: torch.Tensor
    num_cmp: torch.Tensor
    overflow: torch.Tensor
    pages: PageTable | None = None

    # ----------------------------------------------------------------------------- construction

    @classmethod
    def empty(
        cls,
        config: NSAConfig,
        batch: int,
        capacity: int,
        *,
        device: torch.device | str,
        dtype: torch.dtype,
        pages: PageTable | None = None,
    ) -> DecodeState:
        """B sequences of length 0, room for ``capacity`` tokens each (1 <= capacity <= 2^31 - 1:
        token positions are int32); ``pages``: the selected-branch K/V in a pool of pages
        (sequence b then holds as many tokens as its pages do, at most ``capacity``)."""
        check_config(config)
        batch = check_int("batch", batch, 1)
        capacity = check_int("capacity", capacity, 1, MAX_TOKENS)
        device = check_device("device", device)
        dtype = check_float_dtype("dtype", dtype)
        if pages is not None:
            if not isinstance(pages, PageTable):
                raise TypeError(f"pages must be a PageTable or None, got {type(pages).__name__}")
            if pages.block_table.shape[0] != batch:
                raise ValueError(
                    f"pages.block_table has {pages.block_table.shape[0]} rows for batch {batch}"
                )
            if pages.block_table.device.type != device.type:
                raise ValueError(
                    f"pages.block_table is on {pages.block_table.device}, the state on {device}"
                )
        h, dk, dv = config.num_kv_heads, config.head_dim_qk, config.head_dim_v
        # At least one row, so that kernels always get a real pointer.
        cmp_rows = max(1, num_cmp_blocks(capacity, config.cmp_block, config.cmp_stride))

        def z(n: int, d: int) -> torch.Tensor:
            return torch.zeros(batch, n, h, d, device=device, dtype=dtype)

        def counter() -> torch.Tensor:
            return torch.zeros(batch, device=device, dtype=torch.int32)

        def sel(d: int) -> torch.Tensor:
            if pages is None:
                return z(capacity, d)
            shape = (pages.num_pages, pages.page_size, h, d)
            return torch.zeros(shape, device=device, dtype=dtype)

        return cls(
            config=config,
            capacity=capacity,
            k_sel=sel(dk),
            v_sel=sel(dv),
            k_win=z(config.window, dk),
            v_win=z(config.window, dv),
            k_raw=z(config.cmp_block, dk),
            v_raw=z(config.cmp_block, dv),
            k_cmp=z(cmp_rows, dk),
            v_cmp=z(cmp_rows, dv),
            cache_seqlens=counter(),
            num_cmp=counter(),
            overflow=counter(),
            pages=pages,
        )

    @classmethod
    def from_cache(cls, cache: NSACache, capacity: int) -> DecodeState:
        """The state of an nsa_core cache (e.g. a prefill's); every sequence has its length."""
        if not isinstance(cache, NSACache):
            raise TypeError(f"cache must be an NSACache, got {type(cache).__name__}")
        capacity = check_int("capacity", capacity, 1, MAX_TOKENS)
        cfg = cache.config
        if capacity < cache.length:
            raise ValueError(f"capacity {capacity} is below the cache length {cache.length}")
        batch = cache.k_sel.shape[0]
        state = cls.empty(cfg, batch, capacity, device=cache.k_sel.device, dtype=cache.k_sel.dtype)
        length = cache.length
        state.k_sel[:, :length] = cache.k_sel
        state.v_sel[:, :length] = cache.v_sel
        state._fill_ring(state.k_win, cache.k_win, length)
        state._fill_ring(state.v_win, cache.v_win, length)
        state._fill_ring(state.k_raw, cache.k_raw, length)
        state._fill_ring(state.v_raw, cache.v_raw, length)
        state.k_cmp[:, : cache.num_cmp] = cache.k_cmp
        state.v_cmp[:, : cache.num_cmp] = cache.v_cmp
        state.cache_seqlens.fill_(length)
        state.num_cmp.fill_(cache.num_cmp)
        return state

    @classmethod
    def from_prefixes(
        cls,
        config: NSAConfig,
        k: Mapping[str, torch.Tensor],
        v: Mapping[str, torch.Tensor],
        lengths: Sequence[int],
        capacity: int,
        *,
        phi_k: BlockPhi | None = None,
        phi_v: BlockPhi | None = None,
        pages: PageTable | None = None,
    ) -> DecodeState:
        """Sequences of different lengths from their per-branch K/V (``pages``: as
        :meth:`empty`).

        Args:
            k, v: per branch ("cmp", "sel", "win") keys [B, T, H, dk] and values [B, T, H, dv];
                sequence b uses its first ``lengths[b]`` tokens (rotated keys; the compressed
                branch's raw, unfolded K/V).
            lengths: B prefix lengths, each <= T and <= capacity.
            phi_k, phi_v: compression of a block for ``config.phi == "mlp"`` (see
                :func:`block_phi`); None means the mean (``phi == "avg"``).
        """
        check_config(config)
        check_phi(config, phi_k, phi_v)
        ref = check_branch_tensors(config, k, v)
        batch = ref.shape[0]
        capacity = check_int("capacity", capacity, 1, MAX_TOKENS)
        lengths = check_lengths(lengths, batch, min(ref.shape[1], capacity))
        state = cls.empty(config, batch, capacity, device=ref.device, dtype=ref.dtype, pages=pages)
        cfg = config
        for b, n in enumerate(lengths):
            state.write_sel(b, k["sel"][b, :n], v["sel"][b, :n])
            win0 = max(0, n - cfg.window)
            state._fill_ring(state.k_win[b : b + 1], k["win"][b : b + 1, win0:n], n)
            state._fill_ring(state.v_win[b : b + 1], v["win"][b : b + 1, win0:n], n)
            blocks = num_cmp_blocks(n, cfg.cmp_block, cfg.cmp_stride)
            raw0 = blocks * cfg.cmp_stride
            state._fill_ring(state.k_raw[b : b + 1], k["cmp"][b : b + 1, raw0:n], n)
            state._fill_ring(state.v_raw[b : b + 1], v["cmp"][b : b + 1, raw0:n], n)
            with torch.no_grad():
                state.k_cmp[b, :blocks] = compress_prefix(k["cmp"][b, :n], cfg, phi_k)
                state.v_cmp[b, :blocks] = compress_prefix(v["cmp"][b, :n], cfg, phi_v)
        state.cache_seqlens.copy_(torch.tensor(list(lengths), dtype=torch.int32))
        state.num_cmp.copy_(
            torch.tensor(
                [num_cmp_blocks(n, cfg.cmp_block, cfg.cmp_stride) for n in lengths],
                dtype=torch.int32,
            )
        )
        return state

    def write_sel(self, b: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Sequence b's first n selected-branch tokens: k [n, H, dk], v [n, H, dv]."""
        n = k.shape[0]
        if self.pages is None:
            self.k_sel[b, :n] = k
            self.v_sel[b, :n] = v
            return
        rows = self.pages.rows(b, 0, n)
        self.k_sel.flatten(0, 1)[rows] = k
        self.v_sel.flatten(0, 1)[rows] = v

    def sel_tokens(self, b: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence b's first n selected-branch tokens: (k [n, H, dk], v [n, H, dv])."""
        if self.pages is None:
            return self.k_sel[b, :n], self.v_sel[b, :n]
        rows = self.pages.rows(b, 0, n)
        return self.k_sel.flatten(0, 1)[rows], self.v_sel.flatten(0, 1)[rows]

    @staticmethod
    def _fill_ring(ring: torch.Tensor, tokens: torch.Tensor, length: int) -> None:
        """Write the last ``tokens.shape[1]`` tokens of a prefix of ``length`` into ``ring``."""
        count = tokens.shape[1]
        if count > ring.shape[1]:
            raise ValueError(f"{count} tokens do not fit a ring of {ring.shape[1]}")
        rows = torch.arange(length - count, length, device=ring.device) % ring.shape[1]
        ring[:, rows] = tokens

    # ----------------------------------------------------------------------------- facts

    @property
    def batch(self) -> int:
        return int(self.k_win.shape[0])

    @property
    def device(self) -> torch.device:
        return self.k_sel.device

    @property
    def dtype(self) -> torch.dtype:
        return self.k_sel.dtype

    @property
    def cmp_capacity(self) -> int:
        """N_cmp(capacity): the compressed blocks a full sequence holds."""
        cfg = self.config
        return num_cmp_blocks(self.capacity, cfg.cmp_block, cfg.cmp_stride)

    def lengths(self) -> list[int]:
        """The B lengths on the host (a device sync)."""
        return [int(n) for n in self.cache_seqlens.tolist()]

    def check_capacity(self) -> None:
        """Raise if a step found a sequence at capacity (a device sync; call it between steps)."""
        full = [b for b, flag in enumerate(self.overflow.tolist()) if flag]
        if full:
            raise RuntimeError(
                f"sequences {full} reached the capacity of {self.capacity} tokens; the steps "
                "after that left them unchanged"
            )

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Beam search: sequence r takes the tokens and counters sequence ``beam_idx[r]`` held
        (int64 [B], values in [0, B); a sequence may be taken by several rows or by none).

        Dense buffers are gathered along the batch. A paged state keeps every row's own pages
        and copies the source's tokens into them (a page belongs to one sequence: sharing a
        prefix's pages would need copy-on-write), so row r needs pages for every token
        ``beam_idx[r]`` holds; that is checked first, and a refusal leaves the state as it was.
        Reads the lengths on the host (a device sync) when paged.
        """
        if not isinstance(beam_idx, torch.Tensor) or beam_idx.dtype != torch.int64:
            got = beam_idx.dtype if isinstance(beam_idx, torch.Tensor) else type(beam_idx).__name__
            raise TypeError(f"beam_idx must be an int64 tensor, got {got}")
        if beam_idx.shape != (self.batch,):
            raise ValueError(f"beam_idx must be [B={self.batch}], got {shape(beam_idx)}")
        if beam_idx.device != self.cache_seqlens.device:
            raise ValueError(f"beam_idx is on {beam_idx.device}, the state on {self.device}")
        if bool(((beam_idx < 0) | (beam_idx >= self.batch)).any()):
            raise ValueError(f"beam_idx values must be in [0, {self.batch})")
        moves: list[tuple[torch.Tensor, torch.Tensor]] = []
        if self.pages is not None:
            lengths = self.lengths()
            for r, src in enumerate(beam_idx.tolist()):
                n = lengths[src]
                held = int((self.pages.block_table[r] >= 0).sum()) * self.pages.page_size
                if held < n:
                    raise ValueError(
                        f"row {r} has pages for {held} tokens, too few for the {n} of "
                        f"sequence {src}"
                    )
                moves.append((self.pages.rows(r, 0, n), self.pages.rows(src, 0, n)))
        per_sequence = [
            f.name for f in fields(self) if f.name not in ("config", "capacity", "pages")
        ]
        if self.pages is not None:
            per_sequence = [name for name in per_sequence if name not in ("k_sel", "v_sel")]
            for pool in (self.k_sel, self.v_sel):
                flat = pool.flatten(0, 1)
                # Every source read before any row is written: rows may take each other's tokens.
                taken = [flat[src_rows] for _, src_rows in moves]
                for (dst_rows, _), tokens in zip(moves, taken, strict=True):
                    flat[dst_rows] = tokens
        for name in per_sequence:
            buf = getattr(self, name)
            buf.copy_(buf.index_select(0, beam_idx))

    def snapshot_counters(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copies of (cache_seqlens, num_cmp, overflow).

        Restoring them undoes a step: everything else a step writes lies past the logical
        content (row L of k_sel, row num_cmp of k_cmp) or in ring rows the next step at the
        same position overwrites with the same token before any read.
        """
        return self.cache_seqlens.clone(), self.num_cmp.clone(), self.overflow.clone()

    def restore_counters(self, saved: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        self.cache_seqlens.copy_(saved[0])
        self.num_cmp.copy_(saved[1])
        self.overflow.copy_(saved[2])

    def clone(self) -> DecodeState:
        """An independent copy of every buffer and counter."""
        return DecodeState(
            config=self.config,
            capacity=self.capacity,
            pages=self.pages,
            **{
                f.name: getattr(self, f.name).clone()
                for f in fields(self)
                if f.name not in ("config", "capacity", "pages")
            },
        )

    def to_cache(self, b: int) -> NSACache:
        """Sequence b as an nsa_core cache of batch 1 (host-side lengths; for comparisons)."""
        cfg = self.config
        length = self.lengths()[b]
        blocks = int(self.num_cmp[b])
        cache = NSACache.empty(cfg, 1, capacity=length, device=self.device, dtype=self.dtype)

        def ring(buf: torch.Tensor, first: int) -> torch.Tensor:
            rows = torch.arange(first, length, device=self.device) % buf.shape[1]
            return buf[b : b + 1, rows]

        win0 = max(0, length - cfg.window)
        k_sel, v_sel = self.sel_tokens(b, length)
        cache.append_tokens(
            k_sel[None],
            v_sel[None],
            ring(self.k_win, win0),
            ring(self.v_win, win0),
            ring(self.k_raw, blocks * cfg.cmp_stride),
            ring(self.v_raw, blocks * cfg.cmp_stride),
        )
        # append_tokens keeps every raw token it is given: these are exactly the unfolded ones.
        cache.append_blocks(self.k_cmp[b : b + 1, :blocks], self.v_cmp[b : b + 1, :blocks], 0)
        return cache


def check_config(config: object) -> None:
    if not isinstance(config, NSAConfig):
        raise TypeError(f"config must be an NSAConfig, got {type(config).__name__}")


def check_branch_tensors(
    config: NSAConfig, k: Mapping[str, torch.Tensor], v: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """k and v map each branch ("cmp", "sel", "win") to keys [B, T, H, dk] and values
    [B, T, H, dv] of the config's heads and head dims, one floating dtype and device; returns
    k["sel"]."""
    for name, kv in (("k", k), ("v", v)):
        if not isinstance(kv, Mapping) or set(kv) != set(BRANCHES):
            kind = sorted(kv) if isinstance(kv, Mapping) else type(kv).__name__
            raise TypeError(f"{name} must be a mapping with keys {list(BRANCHES)}, got {kind}")
    ref = k["sel"]
    check_rank("k['sel']", ref, 4, "[B, T, H, dk]")
    if not ref.is_floating_point():
        raise TypeError(f"k['sel'] must be a floating-point tensor, got {ref.dtype}")
    batch, tokens = ref.shape[:2]
    h, dk, dv = config.num_kv_heads, config.head_dim_qk, config.head_dim_v
    for name, kv, dim, layout in (("k", k, dk, "[B, T, H, dk]"), ("v", v, dv, "[B, T, H, dv]")):
        for branch in BRANCHES:
            where = f"{name}[{branch!r}]"
            x = kv[branch]
            check_rank(where, x, 4, layout)
            if tuple(x.shape) != (batch, tokens, h, dim):
                raise ValueError(
                    f"{where} {shape(x)} must be {layout} = [{batch}, {tokens}, {h}, {dim}] (B and "
                    "T of k['sel'], H and the head dim of the config)"
                )
            check_same_place(where, x, "k['sel']", ref)
    return ref


def check_lengths(lengths: object, batch: int, most: int) -> list[int]:
    """B prefix lengths, ints in [0, most]."""
    if not isinstance(lengths, Sequence) or isinstance(lengths, str):
        raise TypeError(f"lengths must be a sequence of ints, got {type(lengths).__name__}")
    if len(lengths) != batch:
        raise ValueError(f"{len(lengths)} lengths for a batch of {batch}")
    for n in lengths:
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise TypeError(f"lengths must hold ints, got {type(n).__name__} {n!r}")
    if any(n < 0 or n > most for n in lengths):
        raise ValueError(
            f"lengths {list(lengths)} must lie in [0, {most}] (the tokens given and the capacity)"
        )
    return [int(n) for n in lengths]


def check_phi(config: NSAConfig, phi_k: BlockPhi | None, phi_v: BlockPhi | None) -> None:
    """A learned phi exactly when the config asks for one (``phi == "mlp"``), each callable."""
    check_callable("phi_k", phi_k, "blocks [B, H, l, dk] -> [B, H, dk]")
    check_callable("phi_v", phi_v, "blocks [B, H, l, dv] -> [B, H, dv]")
    if config.phi == "mlp" and (phi_k is None or phi_v is None):
        raise ValueError("config.phi == 'mlp' needs phi_k and phi_v (see block_phi)")
    if config.phi == "avg" and (phi_k is not None or phi_v is not None):
        raise ValueError("config.phi == 'avg' compresses by the mean; pass no phi_k / phi_v")
