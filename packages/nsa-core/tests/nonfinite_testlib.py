"""The containment rule of docs/spec.md, "Non-finite values", as checks the tests share.

A NaN or +Inf at one token of q, k or v may reach only the output rows whose softmax covers that
token; every other row must equal the clean run bit for bit. The reference's tests
(test_nonfinite.py) and the kernels' (nsa-kernels' test_nonfinite_kernels.py) inject the bad
value and compute the rows that see it with these helpers. Outputs may live on any device; the
row masks are built and compared on the host.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

NAN, INF = float("nan"), float("inf")
BAD_VALUES = [NAN, INF]


def pick(gen: torch.Generator, high: int) -> int:
    """A uniform draw from [0, high)."""
    return int(torch.randint(high, (1,), generator=gen))


def inject(
    gen: torch.Generator, x: torch.Tensor, token: int, value: float
) -> tuple[torch.Tensor, int, int]:
    """x [B, T, heads, D] with ``value`` at one random (b, head, channel) of ``token``."""
    b, head, channel = pick(gen, x.shape[0]), pick(gen, x.shape[2]), pick(gen, x.shape[3])
    y = x.clone()
    y[b, token, head, channel] = value
    return y, b, head


def row_nonfinite(o: torch.Tensor) -> torch.Tensor:
    """o [B, T, HQ, dv] -> [B, T, HQ] on the host: rows with any non-finite channel."""
    return ~torch.isfinite(o.cpu()).all(dim=-1)


def check_rows(
    bad: torch.Tensor, clean: torch.Tensor, expected: torch.Tensor, exact: bool, what: str
) -> None:
    """bad/clean outputs [B, T, HQ, dv]; expected [B, T, HQ] rows that see the bad token.

    Rows that cannot see the token stay finite and unchanged. With ``exact`` every row that sees
    it turns non-finite; without (an Inf in q or a key, where IEEE arithmetic may give a -Inf
    logit and weight 0) such a row may stay finite, and may change.
    """
    got = row_nonfinite(bad)
    assert not row_nonfinite(clean).any(), f"{what}: the clean run is not finite"
    assert not (got & ~expected).any(), (
        f"{what}: rows that cannot see the bad token turned non-finite: "
        f"{(got & ~expected).nonzero().tolist()}"
    )
    if exact:
        assert torch.equal(got, expected), (
            f"{what}: rows that see the bad token stayed finite: "
            f"{(expected & ~got).nonzero().tolist()}"
        )
    unseeing = ~expected
    assert torch.equal(bad.cpu()[unseeing], clean.cpu()[unseeing]), (
        f"{what}: a row that cannot see the bad token changed"
    )


def group_rows(
    b: int, head: int, rows: torch.Tensor, shape: tuple[int, int, int], kv_heads: int
) -> torch.Tensor:
    """[B, T, HQ] true at (b, t, hq) for rows[t] and the query heads of kv head ``head``."""
    out = torch.zeros(shape, dtype=torch.bool)
    g = shape[2] // kv_heads
    out[b, :, head * g : (head + 1) * g] = rows.cpu().unsqueeze(1)
    return out


def query_row(b: int, t: int, hq: int, sees_any: bool, shape: tuple[int, int, int]) -> torch.Tensor:
    """[B, T, HQ] true only at (b, t, hq), and there only if that query sees any token."""
    out = torch.zeros(shape, dtype=torch.bool)
    out[b, t, hq] = sees_any
    return out


def sliding_sees(t: torch.Tensor, s: int, window: int) -> torch.Tensor:
    """Positions t whose window [t - w + 1, t] holds token s."""
    return (s <= t) & (s > t - window)


def cmp_sees(t: torch.Tensor, i: int, cmp_block: int, cmp_stride: int) -> torch.Tensor:
    """Positions t that see compressed block i: ``i*d + l - 1 <= t``."""
    return i * cmp_stride + cmp_block - 1 <= t


def selected_sees(indices: torch.Tensor, b: int, head: int, s: int, sel_block: int) -> torch.Tensor:
    """[T]: rows t whose chosen blocks (indices [B, T, H, n]) for kv head ``head`` hold s <= t."""
    t = torch.arange(indices.shape[1])
    return (indices[b, :, head].cpu() == s // sel_block).any(dim=-1) & (s <= t)


def check_injections(
    gen: torch.Generator,
    inputs: dict[str, torch.Tensor],
    where: str,
    value: float,
    run: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    expected_rows: Callable[[int, int, int], torch.Tensor],
    what: str,
    times: int,
) -> None:
    """``times`` times: ``value`` at a random token s of ``inputs[where]`` ([B, T, heads, D]);
    the rows of ``run`` ([B, T, HQ, dv]) that turn non-finite must be ``expected_rows(b, s,
    head)`` ([B, T, HQ]): exactly for a NaN or a bad value in v, at most for an Inf in q or a
    key."""
    clean = run(inputs)
    for _ in range(times):
        bad_inputs = dict(inputs)
        s = pick(gen, inputs[where].shape[1])
        bad_inputs[where], b, head = inject(gen, inputs[where], s, value)
        exact = value != value or where.startswith("v")
        label = f"{what} {where}[{b}, {s}, {head}] = {value}"
        check_rows(run(bad_inputs), clean, expected_rows(b, s, head), exact, label)
