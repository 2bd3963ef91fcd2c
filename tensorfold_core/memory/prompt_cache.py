"""Kept prompt states: finished streams' caches, keyed by their tokens, resumed by the longest prefix."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ..sequences import common_prefix
from .ledger import Ledger


@dataclass
class KeptState:
    """A model state after `tokens`, resumable at the counts its `state.resume_point` allows."""

    tokens: tuple[int, ...]
    state: object  # a family's kept state: has resume_point(limit) -> the most tokens it restores up to limit
    nbytes: int
    key: int
    last_used: int
    context: object = None  # the drafter's context for these tokens (a `KeptContext`; None: none was kept)


class PromptCache:
    """Kept states within a byte cap and the ledger, least recently used given up first."""

    def __init__(self, ledger: Ledger, cap_bytes: int):
        self.ledger = ledger
        self.cap_bytes = int(cap_bytes)
        self.entries: dict[int, KeptState] = {}
        self._keys = itertools.count(1)
        self._clock = itertools.count(1)
        self.hits = 0
        self.misses = 0

    def held(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def keep(self, tokens, state, nbytes: int, context: object = None) -> bool:
        """Keep a state (and the drafter's context for it, its bytes in `nbytes`) if it fits the cap and the ledger
        once older states give way; else drop it."""
        tokens = tuple(tokens)
        if not tokens or nbytes > self.cap_bytes:
            return False
        for entry in list(self.entries.values()):
            # a state the new one covers (same prefix, resumable there too) serves nothing the new one doesn't
            n = len(entry.tokens)
            if tokens[:n] == entry.tokens and state.resume_point(n) == n:
                self._drop(entry)
        while self.held() + nbytes > self.cap_bytes and self.entries:
            self._drop(self._oldest())
        key = next(self._keys)
        while not self.ledger.reserve(("kept", key), "kept_state", nbytes):
            if not self.entries:
                return False
            self._drop(self._oldest())
        self.entries[key] = KeptState(tokens, state, nbytes, key, next(self._clock), context)
        return True

    def lookup(self, prompt) -> tuple[KeptState | None, int]:
        """The kept state resuming most of `prompt` (leaving its last token to compute) and how many tokens."""
        best, best_n = None, 0
        for entry in self.entries.values():
            shared = min(common_prefix(entry.tokens, prompt), len(prompt) - 1)
            usable = entry.state.resume_point(shared)
            if usable > best_n:
                best, best_n = entry, usable
        if best is None:
            self.misses += 1
            return None, 0
        self.hits += 1
        best.last_used = next(self._clock)
        return best, best_n

    def shed(self, nbytes: int) -> int:
        """Give up states, oldest first, until the ledger has `nbytes` free; returns bytes given back."""
        freed = 0
        while self.ledger.free() < nbytes and self.entries:
            entry = self._oldest()
            freed += entry.nbytes
            self._drop(entry)
        return freed

    def clear(self) -> None:
        for entry in list(self.entries.values()):
            self._drop(entry)

    def _oldest(self) -> KeptState:
        return min(self.entries.values(), key=lambda e: e.last_used)

    def _drop(self, entry: KeptState) -> None:
        self.entries.pop(entry.key, None)
        self.ledger.release(("kept", entry.key))

    def snapshot(self) -> dict:
        return {"kept_states": len(self.entries), "kept_bytes": self.held(), "cap_bytes": self.cap_bytes,
                "hits": self.hits, "misses": self.misses}
