"""One byte budget for everything that grows: stream caches, drafter slots, growth copies, kept states."""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from typing import Hashable

GIB = 1 << 30
SAFE_FRACTION = 0.5  # of the machine's memory, when --memory-gib is not given


def machine_bytes() -> int:
    """Physical memory of this machine (Linux and macOS)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GIB


def default_budget() -> int:
    return int(machine_bytes() * SAFE_FRACTION)


class Ledger:
    """Reservations by key and kind against one budget; a reservation that does not fit is not made."""

    def __init__(self, budget: int):
        self.budget = int(budget)
        self._held: dict[Hashable, tuple[str, int]] = {}
        self._lock = threading.Lock()  # the engine thread writes; /health reads

    def free(self) -> int:
        return self.budget - self.held()

    def held(self, kind: str | None = None) -> int:
        with self._lock:
            return sum(n for k, n in self._held.values() if kind is None or k == kind)

    def by_kind(self) -> dict[str, int]:
        with self._lock:
            out: dict[str, int] = defaultdict(int)
            for kind, n in self._held.values():
                out[kind] += n
            return dict(out)

    def reserve(self, key: Hashable, kind: str, nbytes: int) -> bool:
        """Hold `nbytes` under `key` (replacing what it held) if the budget allows; else change nothing."""
        with self._lock:
            current = self._held.get(key, (kind, 0))[1]
            total = sum(n for _, n in self._held.values())
            if total - current + nbytes > self.budget:
                return False
            self._held[key] = (kind, int(nbytes))
            return True

    def release(self, key: Hashable) -> int:
        with self._lock:
            return self._held.pop(key, (None, 0))[1]

    def reserved(self, key: Hashable) -> int:
        """Bytes held under `key` (0 when nothing is)."""
        with self._lock:
            return self._held.get(key, (None, 0))[1]

    def holds(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._held

    def snapshot(self) -> dict:
        """What /health and capabilities show."""
        return {"budget_bytes": self.budget, "held_bytes": self.held(), "held_by_kind": self.by_kind()}
