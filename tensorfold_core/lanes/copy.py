"""The copy proposer: continue the latest earlier occurrence of the context's suffix (prompt lookup)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from ..protocols import DraftAsk

NGRAMS = (4, 3, 2)  # longest first: a longer match predicts its continuation better
MAX_SILENCE = 32
MAX_RECALLED = 64  # kept states Recall searches, newest first: past them a match is more likely chance than kin
CONTEXT, RECALL = "context", "recall"  # where a copy comes from: the stream's own context, or a kept prompt state


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


class Recall:
    """Copies from kept prompt states: where the context's last 4, 3 or 2 tokens occur in a kept state's tokens
    (an earlier request's prompt and reply), their continuation there; longest match first, then the newest state."""

    def __init__(self, kept: Callable[[], Iterable[Sequence[int]]]):
        self.kept = kept  # the kept states' tokens, oldest first (read on the engine thread, which keeps them)
        self._indexes: dict[int, tuple[Sequence[int], CopyIndex]] = {}  # by id of a kept token sequence

    def refresh(self) -> list[tuple[Sequence[int], CopyIndex]]:
        """The kept states' indexes, newest first; a state new since the last refresh is indexed once."""
        states = list(self.kept())[-MAX_RECALLED:]
        live = {id(tokens): tokens for tokens in states}
        for key in [k for k in self._indexes if k not in live]:
            del self._indexes[key]
        for key, tokens in live.items():
            if key not in self._indexes:  # a kept state's tokens never change: each is indexed once
                index = CopyIndex()
                index.update(tokens)
                self._indexes[key] = (tokens, index)
        return [self._indexes[id(tokens)] for tokens in reversed(states)]

    def lookup(self, tokens: Sequence[int], depth: int,
               indexes: list[tuple[Sequence[int], CopyIndex]] | None = None) -> list[int]:
        """The continuation of the context's suffix in the newest kept state holding it (`indexes`: a refresh made
        for this round, shared by its streams)."""
        indexes = self.refresh() if indexes is None else indexes
        for n in NGRAMS:
            if len(tokens) < n:
                continue
            key = (n, tuple(tokens[-n:]))
            for kept, index in indexes:
                end = index.last_end.get(key)
                if end is not None:
                    return list(kept[end:end + depth])
        return []


class CopyProposer:
    """Prompt lookup over each stream's own context, then Recall over kept prompt states; silent for a while after
    rejected rounds."""

    name = "copy"

    def __init__(self, recall: Callable[[], Iterable[Sequence[int]]] | None = None):
        self.indexes: dict[int, CopyIndex] = {}
        self.recall = Recall(recall) if recall is not None else None
        self.sources: dict[int, str] = {}  # each stream's last copy's source

    def propose(self, asks: Sequence[DraftAsk]) -> list[list[int]]:
        out, recalled = [], None  # the kept states are listed once a call, not once a stream
        for ask in asks:
            index = self.indexes.setdefault(ask.stream_id, CopyIndex())
            index.update(ask.tokens)
            if index.silent_rounds > 0:
                index.silent_rounds -= 1
                out.append([])
                continue
            copy, self.sources[ask.stream_id] = (index.lookup(ask.tokens, ask.depth) if ask.depth > 0 else []), CONTEXT
            if not copy and ask.depth > 0 and self.recall is not None:
                recalled = self.recall.refresh() if recalled is None else recalled
                copy, self.sources[ask.stream_id] = self.recall.lookup(ask.tokens, ask.depth, recalled), RECALL
            out.append(copy)
        return out

    def source(self, stream_id: int) -> str:
        """Where the stream's last copy came from (CONTEXT or RECALL)."""
        return self.sources.get(stream_id, CONTEXT)

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
        self.sources.pop(stream_id, None)
