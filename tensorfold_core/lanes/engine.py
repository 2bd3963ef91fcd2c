"""The round loop: pick each stream's window, one forward for all, keyed draws, commit, keep, emit."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..protocols import Model
from ..sampling import draw_rows
from .stream import Stream
from .types import ErrorEvent


@dataclass
class Turn:
    """One stream's part in a round: the rows it feeds and whether its last row draws a token."""

    stream: Stream
    window: list[int]
    draws: bool


class Engine:
    """Runs rounds over admitted streams; single-threaded, so it can run in a thread or inline."""

    def __init__(self, model: Model, *, prefill_chunk: int = 256, shared_rounds: bool = True):
        self.model = model
        self.prefill_chunk = prefill_chunk
        # without row invariance a stream's rows would depend on its neighbours, so each runs alone
        self.shared_rounds = shared_rounds
        self.streams: dict[int, Stream] = {}
        self.rounds = 0

    def add(self, stream: Stream) -> None:
        self.streams[stream.id] = stream

    def cancel(self, stream_id: int) -> None:
        stream = self.streams.get(stream_id)
        if stream is not None:
            stream.cancelled = True

    def idle(self) -> bool:
        return not self.streams

    def plan(self) -> list[Turn]:
        """Every decoding stream's pending token, plus prompt chunks up to one chunk's rows."""
        turns, prefill_rows = [], 0
        for stream in self.streams.values():
            if stream.prefilling:
                if prefill_rows:  # one prompt chunk a round keeps decode rounds short
                    continue
                window = stream.window(self.prefill_chunk)
                prefill_rows += len(window)
            else:
                window = stream.window(self.prefill_chunk)
            draws = stream.cache.offset + len(window) == len(stream.tokens)
            turns.append(Turn(stream, window, draws))
        return turns

    def round(self) -> bool:
        """One round; returns False when there was nothing to do."""
        for stream in [s for s in self.streams.values() if s.cancelled]:
            self._leave(stream, "cancelled")
        turns = self.plan()
        if not turns:
            return False
        groups = [turns] if self.shared_rounds else [[turn] for turn in turns]
        for group in groups:
            self._run(group)
        self.rounds += 1
        return True

    def _run(self, group: list[Turn]) -> None:
        try:
            logits = self.model.forward([t.stream.cache for t in group], [t.window for t in group],
                                        [1 if t.draws else 0 for t in group])
            rows = np.array(logits, copy=False)
        except Exception as exc:  # a failed forward ends its own streams and no others
            for turn in group:
                turn.stream.emit(ErrorEvent(error=exc))
                self.streams.pop(turn.stream.id, None)
            return
        row = 0
        for turn in group:
            stream = turn.stream
            self.model.keep(stream.cache, len(turn.window))
            if not turn.draws:
                continue
            drawn = draw_rows(rows[row:row + 1], stream.request.sampling, stream.seed, len(stream.tokens))
            row += 1
            stream.stats.rounds += 1
            stream.emit_tokens(stream.commit(drawn))
            if stream.finish_reason:
                self._leave(stream)

    def _leave(self, stream: Stream, reason: str | None = None) -> None:
        self.streams.pop(stream.id, None)
        stream.finish(reason)

    def run_until_idle(self) -> None:
        while self.round():
            pass
