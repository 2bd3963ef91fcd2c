"""Chances and grants (seeds 002, 003): a drafter's chances price each stream's verify rows, and each grant sets how
deep the stream's next hold drafts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence


@dataclass(frozen=True)
class Held:
    """One stream's held drafts in a round, as the grant prices them."""

    drafts: int  # drafts the hold gave (after a grammar's cut)
    chances: Sequence[float] | None  # their running products; None while the hold has not settled


@dataclass
class GrantLane:
    """One stream's grants: what its last hold held, what the verify granted of it, its last settled confidences."""

    held: int = 0
    granted: int | None = None  # None: no grant yet in this drafted stretch, so its next round is the stretch's first
    confidences: list[float] = field(default_factory=list)  # the last settled hold's, draft by draft

    @property
    def short(self) -> bool:
        """grant_short: the last grant stopped short of the drafts held."""
        return self.granted is not None and self.granted < self.held

    def next_hold(self, slack: int) -> int:
        """The next hold's depth: the grant and its slack after a full grant, the grant alone after a short one, one
        draft and its slack at a drafted stretch's first round, none after a grant of none (a probe comes later)."""
        if self.granted is None:
            return 1 + slack
        if self.granted == 0:
            return 0
        return self.granted if self.short else self.granted + slack

    def end_stretch(self) -> None:
        """The stream ran a plain round: its next drafted round is a stretch's first."""
        self.granted, self.held = None, 0

    def settle(self, chances: Sequence[float]) -> None:
        """A hold settled: keep its confidences, each chance over the one before it."""
        out, before = [], 1.0
        for chance in chances:
            out.append(chance / before if before > 0.0 else 0.0)
            before = chance
        if out:
            self.confidences = out

    def last_settled(self, held: int) -> list[float] | None:
        """Chances of `held` drafts whose hold still runs: draft j by the last settled hold's draft j, the deepest one
        repeated past it (None: no hold settled yet)."""
        if not self.confidences:
            return None
        out, chance = [], 1.0
        for j in range(held):
            chance *= self.confidences[min(j, len(self.confidences) - 1)]
            out.append(chance)
        return out


def grants(chances: Sequence[Sequence[float]], first: Sequence[bool], round_ms: Callable[[int], float],
           rows: int, tokens: float) -> list[int]:
    """Each stream's verify rows of its held drafts, for the round's most expected tokens per ms: the likeliest drafts
    over all streams first, while the rate rises. `rows` and `tokens` are the round's without these drafts (every
    window's pending row, other drafts, prompt chunks); the hold already ran, so only rows cost. A stream at its
    drafted stretch's first round is granted one draft, unpriced."""
    granted = [0] * len(chances)
    offers = []
    for i, (held, opening) in enumerate(zip(chances, first)):
        if opening:
            if held:
                granted[i], rows, tokens = 1, rows + 1, tokens + held[0]
            continue
        reach = 1.0
        for k, chance in enumerate(held):
            reach = min(reach, max(chance, 0.0))  # a running product never rises: each stream's offers stay in order
            offers.append((-reach, i, k))
    offers.sort()
    best, best_rate, counts, last_rate = list(granted), tokens / round_ms(rows), list(granted), 0.0
    for neg_reach, i, _ in offers:
        tokens, rows = tokens - neg_reach, rows + 1
        counts[i] += 1
        rate = tokens / round_ms(rows)
        if rate < last_rate:  # falling gains over a line's rising cost: once the rate drops it keeps dropping
            break
        last_rate = rate
        if rate > best_rate:  # strict: a tie keeps the shorter window
            best, best_rate = list(counts), rate
    return best


def fit_one_pass(depths: Sequence[int], holding: Sequence[bool], rows: int) -> list[int]:
    """The holding streams' depths cut, deepest (then latest) first, until their blocks fit one hold pass of `rows`;
    past one draft each, the latest streams hold none."""
    out = list(depths)
    if rows <= 0:
        return out
    at = [i for i, h in enumerate(holding) if h and out[i] > 0]
    while sum(out[i] for i in at) > rows:
        deepest = max(out[i] for i in at)
        i = max(j for j in at if out[j] == deepest)
        out[i] -= 1
        if out[i] == 0:
            at.remove(i)
    return out
