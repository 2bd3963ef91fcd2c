"""The copy proposer: continue the latest earlier occurrence of the context's suffix (prompt lookup)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ..protocols import DraftAsk

NGRAMS = (4, 3, 2)  # longest first: a longer match predicts its continuation better
MAX_SILENCE = 32


@dataclass
class CopyIndex:
    """Per stream: where each n-gram last ended, updated as the context grows."""

    seen: int = 0
    last_end: dict = field(default_factory=dict)
    silent_rounds: int = 0  # rounds left before the proposer speaks again
    misses: int = 0  # rejected copy rounds in a row

    def update(self, tokens: Sequence[int]) -> None:
        # index every n-gram that ends before the newest token, so the suffix never matches itself
        for end in range(max(self.seen, 1), len(tokens)):
            for n in NGRAMS:
                if end >= n:
                    self.last_end[(n, tuple(tokens[end - n:end]))] = end
        self.seen = max(self.seen, len(tokens) - 1) if tokens else 0

    def lookup(self, tokens: Sequence[int], depth: int) -> list[int]:
        for n in NGRAMS:
            if len(tokens) <= n:
                continue
            end = self.last_end.get((n, tuple(tokens[-n:])))
            if end is not None:
                return list(tokens[end:end + depth])
        return []


class CopyProposer:
    """Prompt lookup over each stream's own context; silent for a while after rejected rounds."""

    name = "copy"

    def __init__(self):
        self.indexes: dict[int, CopyIndex] = {}

    def propose(self, asks: Sequence[DraftAsk]) -> list[list[int]]:
        out = []
        for ask in asks:
            index = self.indexes.setdefault(ask.stream_id, CopyIndex())
            index.update(ask.tokens)
            if index.silent_rounds > 0:
                index.silent_rounds -= 1
                out.append([])
                continue
            out.append(index.lookup(ask.tokens, ask.depth) if ask.depth > 0 else [])
        return out

    def observe(self, stream_id: int, offered: int, accepted: int) -> None:
        """After a verified round: a rejected copy silences the proposer, longer after each miss."""
        index = self.indexes.get(stream_id)
        if index is None or offered == 0:
            return
        if accepted == 0:
            index.misses += 1
            index.silent_rounds = min(2 ** index.misses, MAX_SILENCE)
        else:
            index.misses = 0

    def release(self, stream_id: int) -> None:
        self.indexes.pop(stream_id, None)
