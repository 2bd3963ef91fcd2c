"""One stream's state in an LFM2 model: attention keys and values, the conv layers' rolling inputs, kept states."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from tensorfold_core.families import WINDOW_SLACK, grown
from tensorfold_core.protocols import TappedRows


@dataclass(frozen=True)
class Shape:
    """What a cache holds per layer kind: attention layers' keys and values, conv layers' last inputs."""

    attention_layers: int
    kv_heads: int
    head_dim: int
    conv_layers: int
    conv_dim: int
    conv_tail: int  # inputs a conv layer carries to the next token: conv_L_cache - 1
    dtype: mx.Dtype

    def kv_bytes(self, tokens: int) -> int:
        return 2 * self.attention_layers * self.kv_heads * self.head_dim * tokens * self.dtype.size

    def conv_bytes(self) -> int:
        return self.conv_layers * self.conv_tail * self.conv_dim * self.dtype.size


@dataclass(frozen=True)
class KeptState:
    """A cache kept for a later request: keys and values of `tokens` tokens, conv states at each resume point."""

    shape: Shape
    tokens: int
    keys: tuple[mx.array, ...]  # per attention layer, [1, kv_heads, tokens, head_dim] (stacked: one, [layers, ...])
    values: tuple[mx.array, ...]
    conv: dict[int, tuple[mx.array, ...]]  # resume point -> per conv layer, [1, conv_tail, conv_dim]
    stacked: bool = False  # one array of every layer in each tuple, as a stacked cache holds them

    @property
    def points(self) -> list[int]:
        """The token counts a cache can be restored at: the chunk marks passed, and `tokens` itself."""
        return sorted(self.conv)

    def resume_point(self, limit: int) -> int:
        """The most tokens a restore can start from without passing `limit` (0: none)."""
        return max((p for p in self.conv if p <= limit), default=0)

    @property
    def nbytes(self) -> int:
        arrays = [*self.keys, *self.values, *(a for states in self.conv.values() for a in states)]
        return sum(a.nbytes for a in arrays)


class HybridCache:
    """One stream's keys and values (attention layers) and last conv inputs (conv layers), kept per window row."""

    # A forward remembers each conv layer's input over the window ([tail; gated rows]), so commit(rows) slices the
    # tail at the last accepted row: a rejected draft costs no second pass. A conv state can never be rewound, so
    # every `marks` tokens (a chunk mark) the tail is copied aside: a kept state resumes there, keys trimmed.

    def __init__(self, shape: Shape, capacity: int, marks: int = 0, stacked: bool = False):
        self.shape = shape
        self.offset = 0
        self.capacity = capacity
        self.marks = marks
        self.window: int | None = None  # rows of the last forward, until kept
        # stacked: one buffer for every attention layer's keys (values alike) and one for every conv layer's tail,
        # [layers, ...], which a streams forward reads for all its streams and writes once, after its last layer
        self.stacked = stacked
        if stacked:  # a kind with no layers has no buffer
            kv_layers, kv_count = shape.attention_layers, int(shape.attention_layers > 0)
            conv_layers, conv_count = shape.conv_layers, int(shape.conv_layers > 0)
        else:
            kv_layers, kv_count, conv_layers, conv_count = 1, shape.attention_layers, 1, shape.conv_layers
        kv = (kv_layers, shape.kv_heads, capacity + WINDOW_SLACK, shape.head_dim)
        self.keys = [mx.zeros(kv, shape.dtype) for _ in range(kv_count)]
        self.values = [mx.zeros(kv, shape.dtype) for _ in range(kv_count)]
        self.conv = [mx.zeros((conv_layers, shape.conv_tail, shape.conv_dim), shape.dtype) for _ in range(conv_count)]
        self.inputs: list[mx.array | None] = [None] * conv_count  # [tail; window rows] of the last forward
        # or, where the stream conv record served the window, the tail each row leaves [rows, conv_tail, conv_dim]
        # ([rows, conv_layers, conv_tail, conv_dim] where stacked)
        self.states: list[mx.array | None] = [None] * conv_count
        self.kept_conv: dict[int, tuple[mx.array, ...]] = {}  # chunk mark -> conv tails there
        self.asked: set[int] = set()  # token counts to keep conv tails at, besides every `marks`
        self.tapped: mx.array | None = None  # the last window's tapped rows, while the model taps layers
        self.staged: list[mx.array] = []  # tapped rows committed and not yet taken, from position `staged_from`
        self.taps_from = 0  # a window ending at or before this position is not tapped (Model.tap_from)
        self.staged_from = 0

    def mark(self, tokens: int) -> None:
        """Keep the conv tails at `tokens` once the cache passes it, even inside a window."""
        # e.g. a prompt's last-but-one token: where a repeat of the prompt resumes
        if tokens > self.offset:
            self.asked.add(tokens)

    def reserve(self, n: int) -> None:
        """Grow the key and value storage when a window reaches past it (a long prefill chunk near capacity)."""
        self.keys, self.values = grown(self.keys, self.offset + n), grown(self.values, self.offset + n)

    def store(self, slot: int, k: mx.array, v: mx.array) -> None:
        """Store the window's keys and values at offset.. (a window attention record reads the whole buffer)."""
        end = self.offset + k.shape[2]
        self.keys[slot][..., self.offset:end, :] = k
        self.values[slot][..., self.offset:end, :] = v

    def write(self, slot: int, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Store the window's keys and values at offset..; return every key and value up to its last row."""
        self.store(slot, k, v)
        end = self.offset + k.shape[2]
        return self.keys[slot][..., :end, :], self.values[slot][..., :end, :]

    def store_window(self, k: mx.array, v: mx.array, states: mx.array | None) -> None:
        """A stacked cache's window of every layer at offset..: keys and values [rows, attention_layers, kv_heads,
        head_dim], and the tail each row leaves in every conv layer [rows, conv_layers, conv_tail, conv_dim]."""
        if self.keys:
            end = self.offset + k.shape[0]
            self.keys[0][:, :, self.offset:end, :] = k.transpose(1, 2, 0, 3)
            self.values[0][:, :, self.offset:end, :] = v.transpose(1, 2, 0, 3)
        if self.conv:
            self.states[0] = states

    def conv_input(self, slot: int, gated: mx.array) -> mx.array:
        """The conv layer's input for the window: its committed tail, then the window's gated rows [1, n, dim]."""
        self.inputs[slot] = mx.concatenate([self.conv[slot], gated], axis=1)
        return self.inputs[slot]

    def conv_states(self, slot: int, states: mx.array) -> None:
        """The tail each of the window's rows leaves in a conv layer, [rows, conv_tail, conv_dim] (the record's)."""
        self.states[slot] = states[:, None]

    def _tail(self, slot: int, r: int) -> mx.array:
        """The conv layer's tail after the window's first `r` rows, [1, conv_tail, conv_dim]: a copy, so the window's
        arrays are freed (after none, the committed tail itself)."""
        if self.states[slot] is not None:
            return self.conv[slot] if r == 0 else mx.contiguous(self.states[slot][r - 1])
        return mx.contiguous(self.inputs[slot][:, r:r + self.shape.conv_tail])

    def commit(self, rows: int) -> list[mx.array]:
        """Keep the window's first `rows` rows, lazily: the offset moves, each conv tail ends at the last kept row."""
        marked, layers = [], range(len(self.conv))
        tails = lambda r: tuple(self._tail(slot, r) for slot in layers)
        passed = {p for p in self.asked if p <= self.offset + rows}
        if self.marks:
            passed.update(range(-(-(self.offset + 1) // self.marks) * self.marks, self.offset + rows + 1, self.marks))
        windowed = bool(self.conv) and (self.inputs[0] is not None or self.states[0] is not None)
        for mark in sorted(passed) if windowed else ():
            self.kept_conv[mark] = tails(mark - self.offset)
            marked.extend(self.kept_conv[mark])
        self.asked -= passed
        if windowed:
            self.conv = list(tails(rows))
        if self.tapped is not None and rows:
            if not self.staged:
                self.staged_from = self.offset
            self.staged.append(mx.contiguous(self.tapped[:rows]))
            marked.append(self.staged[-1])
        self.tapped = None
        self.offset += rows
        self.window = None
        self.inputs = [None] * len(self.conv)
        self.states = [None] * len(self.conv)
        return [*self.keys, *self.values, *self.conv, *marked]  # what keep() evaluates to cut the graph

    def take_taps(self) -> TappedRows | None:
        """The tapped rows committed since the last take, handed over (a kept state never holds them)."""
        if not self.staged:
            return None
        rows = self.staged[0] if len(self.staged) == 1 else mx.concatenate(self.staged)
        self.staged = []
        return TappedRows(self.staged_from, rows)

    def snapshot(self) -> KeptState:
        """The committed state, copied: restorable at `offset` and at every chunk mark it passed."""
        if self.window is not None:
            raise ValueError("keep() the cache's last window before a snapshot")
        cut = lambda arrays: tuple(mx.contiguous(a[..., :self.offset, :]) for a in arrays)
        conv = {mark: states for mark, states in self.kept_conv.items() if mark <= self.offset}
        conv[self.offset] = tuple(mx.contiguous(a) for a in self.conv)
        state = KeptState(self.shape, self.offset, cut(self.keys), cut(self.values), conv, self.stacked)
        mx.eval(state.keys, state.values, list(conv.values()))
        return state

    @classmethod
    def restored(cls, shape: Shape, state: KeptState, tokens: int, capacity: int, marks: int = 0,
                 stacked: bool = False) -> "HybridCache":
        """A cache holding the first `tokens` tokens of a kept state; `tokens` must be one of its points."""
        if state.shape != shape or state.stacked != stacked:
            raise ValueError(f"a kept state of {state.shape} ({'' if state.stacked else 'not '}stacked) cannot "
                             f"restore into a cache of {shape} ({'' if stacked else 'not '}stacked)")
        if tokens not in state.conv:
            raise ValueError(f"a kept state of {state.tokens} tokens resumes at {state.points}, not at {tokens}")
        if tokens > capacity:
            raise ValueError(f"a cache of capacity {capacity} cannot hold {tokens} kept tokens")
        cache = cls(shape, capacity, marks, stacked)
        for slot, (k, v) in enumerate(zip(state.keys, state.values)):
            cache.keys[slot][..., :tokens, :] = k[..., :tokens, :]
            cache.values[slot][..., :tokens, :] = v[..., :tokens, :]
        cache.conv = list(state.conv[tokens])
        cache.kept_conv = {m: s for m, s in state.conv.items() if m <= tokens}
        cache.offset = tokens
        mx.eval(cache.keys, cache.values)
        return cache
