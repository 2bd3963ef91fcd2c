"""A drafter's hold pass timed by blocks and depth, moved toward each hold that settles (a leaf drafters import)."""

from __future__ import annotations

HOLD_BLOCKS = (1, 2, 4, 8, 16)  # block counts a drafter times its hold pass at, after its warm-up
HOLD_DEPTHS = (1, 4)  # drafts a block at each timed count (fewer where the blocks would pass one hold pass)
SETTLE_SHARE = 0.1  # how far a settled hold moves the timed passes at its block counts toward its own time


class HoldCosts:
    """A drafter's hold pass in ms by (blocks, depth): timed points, read between and past them along straight
    lines, each moved toward the holds that settle near it."""

    def __init__(self, timed: dict[tuple[int, int], float] | None = None):
        self._ms: dict[int, dict[int, float]] = {}  # blocks -> depth -> ms
        for (blocks, depth), ms in (timed or {}).items():
            self.time(blocks, depth, ms)

    def time(self, blocks: int, depth: int, ms: float) -> None:
        """A timed pass of `blocks` blocks of `depth` drafts each."""
        self._ms.setdefault(blocks, {})[depth] = max(float(ms), 0.0)

    @property
    def timed(self) -> bool:
        return bool(self._ms)

    def points(self) -> dict[tuple[int, int], float]:
        return {(b, d): ms for b, row in self._ms.items() for d, ms in row.items()}

    def _bracket(self, blocks: int) -> list[tuple[int, float]]:
        """The timed block counts a pass of `blocks` is read from and their weights (past the last two: a line's)."""
        counts = sorted(self._ms)
        if blocks in self._ms or len(counts) == 1:
            return [(blocks if blocks in self._ms else counts[0], 1.0)]
        if blocks < counts[0]:
            lo, hi = counts[0], counts[1]
        elif blocks > counts[-1]:
            lo, hi = counts[-2], counts[-1]
        else:
            hi = next(c for c in counts if c > blocks)
            lo = max(c for c in counts if c < blocks)
        w = (blocks - lo) / (hi - lo)
        return [(lo, 1.0 - w), (hi, w)]

    def _at(self, blocks: int, depth: int) -> float:
        """The pass at a timed block count, read along its depths (one depth timed: the same for any)."""
        row = self._ms[blocks]
        depths = sorted(row)
        if len(depths) == 1:
            return row[depths[0]]
        lo, hi = (depths[0], depths[1]) if depth <= depths[1] else (depths[-2], depths[-1])
        return row[lo] + (row[hi] - row[lo]) * (depth - lo) / (hi - lo)

    def ms(self, blocks: int, depth: int) -> float:
        """The pass's price; 0 for no blocks, or while nothing was timed."""
        if blocks <= 0 or depth <= 0 or not self._ms:
            return 0.0
        return max(sum(w * self._at(b, depth) for b, w in self._bracket(blocks)), 0.0)

    def settle(self, blocks: int, depth: int, ms: float) -> None:
        """A hold of `blocks` blocks, the deepest `depth` drafts, took `ms`: the timed passes at its block counts
        (both depths) move toward it, a tenth of the way at a timed count, by their weight between two."""
        price = self.ms(blocks, depth)
        if price <= 0.0 or ms <= 0.0:  # nothing timed, or a hold that took no time: nothing to learn
            return
        for b, w in self._bracket(blocks):
            # past the timed counts a line's weights leave [0, 1]: the nearer count learns it all
            factor = 1.0 + SETTLE_SHARE * min(max(w, 0.0), 1.0) * (ms / price - 1.0)
            row = self._ms[b]
            for d in row:
                row[d] *= factor
