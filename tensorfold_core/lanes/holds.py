"""A hold as a pass of its own: which holds a round keeps for their pass (its price: `hold_costs.HoldCosts`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass(frozen=True)
class HoldOffer:
    """One stream's hold the round may keep: its drafts, the drafts it expects to land, whether it is kept anyway."""

    depth: int
    gain: float
    kept: bool = False  # a probe: it measures, so it is not priced


def keep_holds(offers: Sequence[HoldOffer | None], round_ms: Callable[[int], float], rows: int, tokens: float,
               hold_ms: Callable[[int, int], float]) -> list[bool]:
    """Which holds the round runs: those kept anyway, then the others, most expected drafts a row first, while
    they raise the round's expected tokens per ms over their verify rows and the hold pass (`rows`, `tokens`: the
    round's without holds)."""
    out = [o is not None and o.kept and o.depth > 0 for o in offers]
    blocks, depth = 0, 0
    for o, k in zip(offers, out):
        if k:
            rows, tokens, blocks, depth = rows + o.depth, tokens + o.gain, blocks + 1, max(depth, o.depth)
    best_rate = tokens / (round_ms(rows) + (hold_ms(blocks, depth) if blocks else 0.0))
    order = sorted((i for i, o in enumerate(offers) if o is not None and not out[i] and o.depth > 0),
                   key=lambda i: (-offers[i].gain / offers[i].depth, i))
    taken, best = [], []
    for i in order:
        o = offers[i]
        rows, tokens, blocks, depth = rows + o.depth, tokens + o.gain, blocks + 1, max(depth, o.depth)
        taken.append(i)
        rate = tokens / (round_ms(rows) + hold_ms(blocks, depth))
        # the pass is paid once: a hold that loses alone may pay beside others, so the best prefix wins
        if rate > best_rate:  # strict: a tie keeps the round without the hold
            best, best_rate = list(taken), rate
    for i in best:
        out[i] = True
    return out
