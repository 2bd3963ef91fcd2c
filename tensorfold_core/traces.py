"""How many mx.compile traces this process has run: a round during which one ran paid a one-off cost that its timing
must not teach the planner (a trace of a whole forward costs several plain rounds)."""

from __future__ import annotations

_count = 0


def note() -> None:
    """Count one trace (KeyCompiled calls it as it compiles a new key)."""
    global _count
    _count += 1


def count() -> int:
    """Traces run so far in this process."""
    return _count
