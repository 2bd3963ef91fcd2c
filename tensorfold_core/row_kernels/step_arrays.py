"""The small arrays a forward's kernels read at every layer (the rows' positions, the streams' row maps), made by
device ops: MLX keeps an array made on the host in CUDA managed memory, and every launch reading one paid for it on
the H200 (docs/gpu.md), where an arange's bounds travel as its launch's parameters and read no memory at all."""

from __future__ import annotations

import os
from typing import Sequence

import mlx.core as mx
import numpy as np

from tensorfold_core.families import Span, row_positions as host_row_positions
from tensorfold_core.row_kernels.attention_streams import STREAM_SLOTS, Packed, packed
from tensorfold_core.row_kernels.modules import ShapeCompiled

# "0": made on the host each step instead, as before (a measurement: bench variant `:host-arrays`)
DEVICE_ARRAYS_ENV = "TENSORFOLD_DEVICE_STEP_ARRAYS"
# int32 values past MLX's 8-byte scalar pool, which is managed memory shared with every small array the host makes
SMALLEST_ROWS = 3
STATIC_LIMIT = 4096  # row-map layouts kept; a drafting group meets a few hundred
# a traced forward of more rows than this runs padded to a multiple of it: each mix of a drafted round's depths is
# then one of a few row counts, each traced once, where every count from 9 to 48 at 8 streams was a trace (and a
# round run from Python first) of its own. "0" pads nothing (a measurement: bench variant `:unpadded`)
PAD_ROWS_ENV = "TENSORFOLD_WHOLE_PAD_ROWS"
PAD_ROWS = 8

_STATIC: dict = {}  # streams' (first row, rows) -> their rows' (slot, 0, window's first row), in device memory
_COLUMN: list = []  # (0, 1, 0) in device memory: where a row map's position goes


def device_made() -> bool:
    """Whether a forward's step arrays come from device ops (the default) or from the host."""
    return os.environ.get(DEVICE_ARRAYS_ENV, "1") != "0"


def row_positions(spans: Sequence[Span]) -> mx.array:
    """Each packed row's absolute position in its stream, once a forward for every layer's rope and row map: one
    arange a stream, the last run on past the scalar pool's size and the padding cut off by a view."""
    if not device_made():
        return host_row_positions(spans)
    return arange_positions([(cache.offset, n) for _, n, cache, _ in spans])


def arange_positions(runs: Sequence[tuple[int, int]]) -> mx.array:
    """Packed rows' positions from runs of (first position, rows), made by device ops as row_positions makes them."""
    bounds = [[first, first + n] for first, n in runs if n]
    if not bounds:
        return mx.zeros((0,), mx.int32)
    rows = sum(stop - start for start, stop in bounds)
    pad = max(0, SMALLEST_ROWS - rows)
    bounds[-1][1] += pad
    parts = [mx.arange(start, stop, dtype=mx.int32) for start, stop in bounds]
    out = parts[0] if len(parts) == 1 else mx.concatenate(parts)
    return out[:rows] if pad else out


def _with_positions(static: mx.array, positions: mx.array, column: mx.array) -> mx.array:
    return static + positions[:, None] * column


# one launch, not a multiply and an add; its traces counted, so the rounds that run them are not timed
_rowmap_of = ShapeCompiled(_with_positions)


def rowmap(spans: Sequence[tuple[int, int, int]], positions: mx.array) -> mx.array:
    """The row map of streams at (first row, rows, cache offset), each row's (slot, position, window's first row), as
    `packed` makes it on the host: from the group's rows of row_positions and a device copy of the layout's slots and
    windows, made once a layout (the copy's kernel is the only one that reads host memory for it)."""
    if not device_made():
        return packed(spans).rowmap
    key = tuple((start, n) for start, n, _ in spans)
    static = _STATIC.get(key)
    if static is None:
        if len(_STATIC) >= STATIC_LIMIT:
            _STATIC.clear()
        rows = [(slot, 0, start) for slot, (start, n) in enumerate(key) for _ in range(n)]
        static = _STATIC[key] = mx.abs(mx.array(np.array(rows, np.int32).reshape(-1, 3)))
    if not _COLUMN:
        _COLUMN.append(mx.abs(mx.array(np.array([0, 1, 0], np.int32))))
    if static.shape[0] == 0:
        return static
    return _rowmap_of(static, positions, _COLUMN[0])


StreamGroup = tuple  # (first row, row past the last, Packed, the streams' key buffers, their value buffers)


def stream_groups(spans: Sequence[Span], positions: mx.array) -> list[StreamGroup]:
    """A forward's streams in groups of as many as one packed-streams launch takes, each with its rows' map."""
    groups = []
    for g in range(0, len(spans), STREAM_SLOTS):
        part = spans[g:g + STREAM_SLOTS]
        lo = part[0][0]
        hi = part[-1][0] + part[-1][1]
        layout = tuple((start - lo, n, cache.offset) for start, n, cache, _ in part)
        groups.append((lo, hi, Packed(layout, rowmap(layout, positions[lo:hi])), [s[2].keys[0] for s in part],
                       [s[2].values[0] for s in part]))
    return groups


def pad_rows(spans_key_trace: bool) -> int:
    """The multiple a family's traced whole forward pads its rows to: none where the spans key the trace anyway (every
    mix of depths is a key of its own there, so padding would add rows and save nothing)."""
    return 0 if spans_key_trace else int(os.environ.get(PAD_ROWS_ENV, str(PAD_ROWS)))


def padded_spans(spans: Sequence[Span], multiple: int) -> Sequence[Span]:
    """The spans with the last window run on to a multiple of `multiple` rows past it (the spans themselves where
    none is needed, or `multiple` is 0). A row's sums never depend on the rows beside it (the contract's gate 4)
    and attention is causal, so every real row computes as unpadded."""
    rows = spans[-1].start + spans[-1].n
    if not multiple or rows <= multiple or rows % multiple == 0:
        return spans
    return [*spans[:-1], spans[-1]._replace(n=spans[-1].n + multiple - rows % multiple)]


def padded_forward(h: mx.array, spans: Sequence[Span], positions: mx.array | None,
                   multiple: int) -> tuple[mx.array, Sequence[Span], mx.array | None]:
    """A forward's rows, spans and positions padded as padded_spans says: the pad rows repeat the last row, run on
    after the last window's and are never stored nor read (the caller cuts them from its output)."""
    padded = padded_spans(spans, multiple)
    if padded is spans:
        return h, spans, positions
    h = mx.concatenate([h, mx.repeat(h[-1:], padded[-1].n - spans[-1].n, axis=0)])
    return h, padded, None if positions is None else row_positions(padded)
