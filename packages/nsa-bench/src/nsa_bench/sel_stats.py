"""Selection statistics: how many block indices neighbouring query rows share, and the indices file.

A selection forward that loads each block once per tile of R rows reads ``|union of the tile's
blocks|`` blocks instead of the tile's ``sum of counts``; how much that saves depends on how far
the rows of a tile agree. For block indices ``[B, T, H, n]`` (ascending, -1 padded, the
``select_blocks`` contract) this module measures, per (sequence, kv head):

- ``share_next``: the share of row t+1's blocks that row t also selected (summed over rows);
- ``saved_R``: ``1 - sum(|union of a tile|) / sum(counts)`` over aligned tiles of R rows, the
  share of block loads a tile-shared forward avoids;
- ``union_R``: the mean union size of a tile in blocks (n is the most one row holds).

The indices file (:func:`save_indices` / :func:`load_indices`) is a ``torch.save`` of a dict:
``indices`` int16 ``[B, T, H, n]`` (block indices fit int16 up to 2^15 blocks) and ``meta``
(sel_block, num_selected, layer, source). ``nsa-bench sel --indices FILE`` times the selection
kernels on these rows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

TILES = (16, 64)
INDEX_FILE_VERSION = 1


@dataclass
class SelStats:
    """The statistics of one index tensor (one layer, or a random baseline)."""

    source: str
    layer: int
    T: int
    H: int
    n: int
    mean_count: float
    share_next: float
    saved_16: float
    union_16: float
    saved_64: float
    union_64: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def membership(indices: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """indices [B, T, H, n] (-1 padded) -> bool [B, T, H, num_blocks]: block j is selected."""
    slots = torch.where(indices < 0, num_blocks, indices.long())  # -1 lands in a dropped column
    member = torch.zeros(
        *indices.shape[:3], num_blocks + 1, dtype=torch.bool, device=indices.device
    )
    member.scatter_(-1, slots, True)
    return member[..., :num_blocks]


def share_next(member: torch.Tensor) -> float:
    """member bool [B, T, H, NB] -> share of row t+1's blocks also selected by row t."""
    later = member[:, 1:]
    shared = (later & member[:, :-1]).sum()
    total = later.sum()
    return float(shared) / max(1, int(total))


def tile_reuse(member: torch.Tensor, rows: int) -> tuple[float, float]:
    """member bool [B, T, H, NB] -> (share of block loads saved, mean union size) per R-row tile.

    Tiles are aligned at row 0; trailing rows that fill no whole tile are left out.
    """
    batch, t, h, nb = member.shape
    tiles = t // rows
    if tiles == 0:
        return float("nan"), float("nan")
    tiled = member[:, : tiles * rows].reshape(batch, tiles, rows, h, nb)
    union = tiled.any(dim=2).sum(dim=-1)  # [B, tiles, H]
    loads = tiled.sum(dim=(2, 4))  # [B, tiles, H]: one load per (row, block) without sharing
    saved = 1.0 - float(union.sum()) / max(1, int(loads.sum()))
    return saved, float(union.float().mean())


def selection_stats(indices: torch.Tensor, sel_block: int, *, source: str, layer: int) -> SelStats:
    """The statistics of indices [B, T, H, n] of rows at positions 0..T-1."""
    batch, t, h, n = indices.shape
    num_blocks = -(-t // sel_block)
    member = membership(indices, num_blocks)
    saved_16, union_16 = tile_reuse(member, 16)
    saved_64, union_64 = tile_reuse(member, 64)
    return SelStats(
        source=source,
        layer=layer,
        T=t,
        H=h,
        n=n,
        mean_count=float((indices >= 0).sum()) / max(1, batch * t * h),
        share_next=share_next(member),
        saved_16=saved_16,
        union_16=union_16,
        saved_64=saved_64,
        union_64=union_64,
    )


def format_stats_table(stats: list[SelStats]) -> str:
    """A Markdown table of the statistics, one row per layer or baseline."""
    head = (
        "| source | layer | T | H | n | blocks/row | share t,t+1 | saved /16 rows | union /16 | "
        "saved /64 rows | union /64 |"
    )
    lines = [head, "|" + "---|" * 11]
    for s in stats:
        lines.append(
            f"| {s.source} | {s.layer} | {s.T} | {s.H} | {s.n} | {s.mean_count:.2f} | "
            f"{s.share_next:.3f} | {s.saved_16:.3f} | {s.union_16:.1f} | {s.saved_64:.3f} | "
            f"{s.union_64:.1f} |"
        )
    return "\n".join(lines)


def save_indices(path: Path, indices: torch.Tensor, meta: dict[str, Any]) -> None:
    """Write indices [B, T, H, n] as int16 with ``meta`` (sel_block and num_selected at least)."""
    if int(indices.max()) >= 2**15:
        raise ValueError("block indices beyond int16: more than 32767 blocks")
    for key in ("sel_block", "num_selected"):
        if key not in meta:
            raise ValueError(f"meta must hold {key!r}")
    payload = {
        "version": INDEX_FILE_VERSION,
        "indices": indices.detach().to("cpu", torch.int16).contiguous(),
        "meta": dict(meta),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(payload, path)


def load_indices(path: Path | str) -> tuple[torch.Tensor, dict[str, Any]]:
    """-> (indices int32 [B, T, H, n], meta) from a file written by :func:`save_indices`."""
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or payload.get("version") != INDEX_FILE_VERSION:
        raise ValueError(f"{path} is not a selection indices file (version {INDEX_FILE_VERSION})")
    indices = payload["indices"]
    if not isinstance(indices, torch.Tensor) or indices.dim() != 4:
        raise ValueError(f"{path}: indices must be a [B, T, H, n] tensor")
    return indices.to(torch.int32), dict(payload["meta"])


def fit_indices(indices: torch.Tensor, t: int, h: int) -> torch.Tensor:
    """indices [B, T0, H0, n] -> [1, t, h, n]: the first sequence's first t rows, kv heads cycled.

    Rows at positions 0..t-1 only name blocks at or before their own, so a prefix of the rows is
    itself a valid selection for a sequence of t tokens.
    """
    if t > indices.shape[1]:
        raise ValueError(f"the file holds {indices.shape[1]} rows, fewer than T={t}")
    heads = torch.arange(h) % indices.shape[2]
    return indices[:1, :t, heads].contiguous()


def indices_for_bench(
    path: Path | str, t: int, h: int, num_selected: int, sel_block: int
) -> torch.Tensor:
    """int32 [1, t, h, n] from an indices file, for a bench of that shape; checks n and l'."""
    indices, meta = load_indices(path)
    if (meta.get("num_selected"), meta.get("sel_block")) != (num_selected, sel_block):
        raise ValueError(
            f"{path} holds n={meta.get('num_selected')}, l'={meta.get('sel_block')}; "
            f"the bench runs n={num_selected}, l'={sel_block}"
        )
    return fit_indices(indices, t, h)
