"""One stream's state in a llama model: keys and values per layer, and the kept states restored from them."""

from __future__ import annotations

import mlx.core as mx

from tensorfold_core.families import WINDOW_SLACK, grown


class KeptKV:
    """Keys and values of `tokens` committed tokens, restorable at any prefix of them."""

    def __init__(self, tokens: int, keys: list, values: list):
        self.tokens, self.keys, self.values = tokens, keys, values

    def resume_point(self, limit: int) -> int:
        return max(0, min(limit, self.tokens))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys + self.values)


class KVCache:
    """One stream's keys and values per layer, preallocated for `capacity` tokens plus one window."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype: mx.Dtype):
        self.offset = 0
        self.capacity = capacity
        self.window: int | None = None  # rows of the last forward, until kept
        shape = (1, kv_heads, capacity + WINDOW_SLACK, head_dim)
        self.keys = [mx.zeros(shape, dtype) for _ in range(layers)]
        self.values = [mx.zeros(shape, dtype) for _ in range(layers)]

    def reserve(self, n: int) -> None:
        """Grow the storage when a window reaches past it (a long prefill chunk near capacity)."""
        self.keys, self.values = grown(self.keys, self.offset + n), grown(self.values, self.offset + n)

    def trim(self, tokens: int) -> None:
        """Keep only the first `tokens` committed tokens (a drafter slot cut back to its context's prefix)."""
        if not 0 <= tokens <= self.offset or self.window is not None:
            raise ValueError(f"cannot trim a cache of {self.offset} tokens (window {self.window}) to {tokens}")
        self.offset = tokens

    def store(self, layer: int, k: mx.array, v: mx.array) -> None:
        """Store the window's keys and values at offset.. (a window attention record reads the whole buffer)."""
        end = self.offset + k.shape[2]
        self.keys[layer][..., self.offset:end, :] = k
        self.values[layer][..., self.offset:end, :] = v

    def write(self, layer: int, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Store the window's keys and values at offset..; return every key and value up to its last row."""
        self.store(layer, k, v)
        end = self.offset + k.shape[2]
        return self.keys[layer][..., :end, :], self.values[layer][..., :end, :]

    def commit(self, rows: int) -> list[mx.array]:
        """Keep the window's first `rows` rows, lazily: keys past them are overwritten by the next window."""
        self.offset += rows
        self.window = None
        return [*self.keys, *self.values]  # what keep() evaluates to cut the graph

    def snapshot(self) -> KeptKV:
        """A standalone copy of the committed tokens' keys and values (a kept prompt state)."""
        n = self.offset
        keys = [mx.contiguous(k[..., :n, :]) for k in self.keys]
        values = [mx.contiguous(v[..., :n, :]) for v in self.values]
        mx.eval(keys, values)
        return KeptKV(n, keys, values)

    def restore(self, state: KeptKV, tokens: int) -> None:
        """Hold the first `tokens` tokens of a kept state (this cache fresh); keys trim to any prefix."""
        if not 0 <= tokens <= min(state.tokens, self.capacity):
            raise ValueError(f"cannot restore {tokens} tokens of a state of {state.tokens} into capacity "
                             f"{self.capacity}")
        for layer in range(len(self.keys)):
            self.keys[layer][..., :tokens, :] = state.keys[layer][..., :tokens, :]
            self.values[layer][..., :tokens, :] = state.values[layer][..., :tokens, :]
        self.offset = tokens
        mx.eval(self.keys, self.values)


class StackedKV:
    """A KVCache whose layers are one buffer each for keys and values, [layers, kv_heads, capacity, head_dim]: where
    every stream's window attention of a layer is one launch (the packed-streams record), a forward reads the caches
    as they were and writes each stream's window for all its layers at once, after the last layer."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype: mx.Dtype):
        self.offset = 0
        self.capacity = capacity
        self.window: int | None = None
        self.k = mx.zeros((layers, kv_heads, capacity + WINDOW_SLACK, head_dim), dtype)
        self.v = mx.zeros((layers, kv_heads, capacity + WINDOW_SLACK, head_dim), dtype)

    @property
    def keys(self) -> list[mx.array]:
        return [self.k]

    @property
    def values(self) -> list[mx.array]:
        return [self.v]

    def reserve(self, n: int) -> None:
        """Grow the storage when a window reaches past it (a long prefill chunk near capacity)."""
        (self.k,), (self.v,) = grown([self.k], self.offset + n), grown([self.v], self.offset + n)

    def trim(self, tokens: int) -> None:
        if not 0 <= tokens <= self.offset or self.window is not None:
            raise ValueError(f"cannot trim a cache of {self.offset} tokens (window {self.window}) to {tokens}")
        self.offset = tokens

    def store_window(self, k: mx.array, v: mx.array) -> None:
        """Store a window's keys and values of every layer, [rows, layers, kv_heads, head_dim], at offset.."""
        end = self.offset + k.shape[0]
        self.k[:, :, self.offset:end, :] = k.transpose(1, 2, 0, 3)
        self.v[:, :, self.offset:end, :] = v.transpose(1, 2, 0, 3)

    def commit(self, rows: int) -> list[mx.array]:
        self.offset += rows
        self.window = None
        return [self.k, self.v]

    def snapshot(self) -> KeptKV:
        n = self.offset
        keys, values = mx.contiguous(self.k[:, :, :n, :]), mx.contiguous(self.v[:, :, :n, :])
        mx.eval(keys, values)
        return KeptKV(n, [keys], [values])

    def restore(self, state: KeptKV, tokens: int) -> None:
        if not 0 <= tokens <= min(state.tokens, self.capacity):
            raise ValueError(f"cannot restore {tokens} tokens of a state of {state.tokens} into capacity "
                             f"{self.capacity}")
        self.k[:, :, :tokens, :] = state.keys[0][:, :, :tokens, :]
        self.v[:, :, :tokens, :] = state.values[0][:, :, :tokens, :]
        self.offset = tokens
        mx.eval(self.k, self.v)
