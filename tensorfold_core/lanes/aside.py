"""How a stream whose drafts do not pay stands aside from drafting, and probes whether they pay again."""

from __future__ import annotations

FIRST_GAP = 64  # plain rounds a stream stands aside before its first probe
MAX_GAP = 1024  # the most plain rounds between two probes of a stream standing aside
LOOK_AHEAD_ROUNDS = 1  # plain rounds an armed probe may see before its drafts reach a window


class StandAside:
    """One stream's stand-aside: plain rounds while its drafts cost more than they land, then ever rarer probes."""

    def __init__(self, first_gap: int = FIRST_GAP, max_gap: int = MAX_GAP):
        self.first_gap, self.max_gap = first_gap, max_gap
        self.gap = first_gap  # plain rounds to stand aside before the next probe
        self.count = 0  # plain rounds stood aside since the last probe
        self.probing = False  # a probe is armed: the stream drafts until a round verifies its drafts
        self._armed_plain = 0  # plain rounds since the probe armed
        self._aside = False  # the last depth asked stood the stream aside

    def probes(self, priced: int) -> bool:
        """Whether `depth(priced, probe)` gives the probe's depth: a probe is armed, or arms now."""
        return priced <= 0 and (self.probing or self.count >= self.gap)

    def depth(self, priced: int, probe: int) -> int:
        """This round's depth: `priced` when drafting pays, `probe` while a probe is armed, else 0 (aside)."""
        self._aside = False
        if priced > 0:
            if not self.probing:  # its drafts pay again: a later stand-aside starts from the first gap
                self.count, self.gap = 0, self.first_gap
            return priced
        if not self.probing and self.count >= self.gap:
            self.probing, self._armed_plain = True, 0
        if self.probing:
            return probe
        self._aside = True
        return 0

    def round(self, verified: int) -> None:
        """After the round: `verified` drafts of this stream's window met the target's draws."""
        if self.probing:
            # the look-ahead's plain round is allowed; a second one means the drafts were cut: stop paying for them
            if verified > 0 or self._armed_plain >= LOOK_AHEAD_ROUNDS:
                self.probing, self.count, self.gap = False, 0, min(self.gap * 2, self.max_gap)
            else:
                self._armed_plain += 1
        elif self._aside:
            self.count += 1
