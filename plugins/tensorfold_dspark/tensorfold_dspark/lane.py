"""One stream's DSpark context (a lane): each drafter layer's keys and values of the target rows it absorbed."""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx

from tensorfold_core.families import grown
from tensorfold_core.protocols import TappedRows


class Lane:
    """A stream's context keys and values, rows in absorb order; a cut (rows skipped) leaves the rest valid, since
    each key was rotated at its own absolute position."""

    __slots__ = ("keys", "values", "n", "end", "whole", "spans", "tokens", "pending", "stream")

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype: mx.Dtype):
        shape = (1, kv_heads, capacity, head_dim)
        self.keys = [mx.zeros(shape, dtype) for _ in range(layers)]
        self.values = [mx.zeros(shape, dtype) for _ in range(layers)]
        self.n = 0  # rows held
        self.end = 0  # the absolute position after the last row held
        self.whole = 0  # leading rows that are positions 0.. with no cut: what a later stream may share
        self.spans: list[tuple[int, int]] = []  # (first position, rows) of each run of positions, in row order
        self.tokens: Sequence[int] = ()  # the context the rows came from: its first `whole` tokens stand for them
        self.pending: list[TappedRows] = []  # taken from the target's cache, not absorbed yet
        self.stream: int | None = None  # the stream the lane was made for (None: a kept prompt state's copy)

    @staticmethod
    def bytes_for(layers: int, kv_heads: int, head_dim: int, capacity: int, dtype: mx.Dtype) -> int:
        return 2 * layers * kv_heads * capacity * head_dim * dtype.size

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys + self.values)

    def pending_rows(self) -> int:
        return sum(piece.rows.shape[0] for piece in self.pending)

    def trim(self, rows: int) -> None:
        """Keep the first `rows` rows of the uncut prefix (rows <= whole)."""
        self.n = self.end = self.whole = min(rows, self.whole)
        self.spans = [(0, self.n)] if self.n else []
        self.pending = []

    def fresh(self, bound: int | None) -> list[TappedRows]:
        """The pending rows past the lane's end (at most the last `bound` of them: a cut), handed over."""
        out = []
        end = self.end
        for piece in self.pending:
            skip = max(0, end - piece.start)  # rows the lane holds already (a shared prefix)
            if skip < piece.rows.shape[0]:
                out.append(TappedRows(piece.start + skip, piece.rows[skip:] if skip else piece.rows))
                end = piece.start + piece.rows.shape[0]
        self.pending = []
        if bound is not None:
            out = _last_rows(out, bound)
        return out

    def write(self, layer: int, keys: mx.array, values: mx.array) -> None:
        """Store one layer's keys and values of the next rows at row n (call `advance` after the last layer)."""
        end = self.n + keys.shape[2]
        if end > self.capacity:  # priced at admission, so only a stream past its limit gets here
            self.keys, self.values = grown(self.keys, end), grown(self.values, end)
        self.keys[layer][..., self.n:end, :] = keys
        self.values[layer][..., self.n:end, :] = values

    def advance(self, start: int, rows: int) -> None:
        """The rows written are absolute positions start..start+rows."""
        if start == self.end == self.whole == self.n:
            self.whole += rows
        if self.spans and sum(self.spans[-1]) == start:
            self.spans[-1] = (self.spans[-1][0], self.spans[-1][1] + rows)
        else:
            self.spans.append((start, rows))
        self.n += rows
        self.end = start + rows

    def copy(self, until: int, capacity: int, dtype: mx.Dtype) -> "Lane":
        """A new lane of `capacity` holding this lane's rows of positions before `until`, cuts and all (positions
        rise row after row, so they are its first rows)."""
        spans, rows = [], 0
        for start, count in self.spans:
            take = min(count, until - start)
            if take <= 0:
                break
            spans.append((start, take))
            rows += take
        lane = Lane(len(self.keys), self.keys[0].shape[1], self.keys[0].shape[3], max(capacity, rows), dtype)
        for layer in range(len(self.keys)):
            lane.keys[layer][..., :rows, :] = self.keys[layer][..., :rows, :]
            lane.values[layer][..., :rows, :] = self.values[layer][..., :rows, :]
        lane.n, lane.spans = rows, spans
        lane.end = sum(spans[-1]) if spans else 0
        lane.whole = spans[0][1] if spans and spans[0][0] == 0 else 0
        lane.tokens = self.tokens
        mx.eval(lane.keys, lane.values)
        return lane


def _last_rows(pieces: list[TappedRows], bound: int) -> list[TappedRows]:
    """The last `bound` rows of the pieces (a probe's bounded catch-up)."""
    out = []
    for piece in reversed(pieces):
        if bound <= 0:
            break
        rows = piece.rows.shape[0]
        keep = min(rows, bound)
        out.append(piece if keep == rows else TappedRows(piece.start + rows - keep, piece.rows[rows - keep:]))
        bound -= keep
    return out[::-1]
