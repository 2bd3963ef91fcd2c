"""What families share: config dataclasses read from config.json, window packing, forward and keep checks, swiglu."""

from __future__ import annotations

import types
import typing
from dataclasses import MISSING, fields
from functools import partial
from typing import NamedTuple, Protocol, Sequence

import mlx.core as mx
import mlx.nn as nn

from .errors import CheckpointError
from .protocols import Cache

WINDOW_SLACK = 16  # rows a cache holds beyond its capacity, for the window that is not kept yet
GROW_STEP = 256  # rows a cache's keys and values grow by when a window reaches past them


class ConfigArgs:
    """Base of a family's config dataclass: built from config.json, unknown keys ignored, then checked."""

    @classmethod
    def from_config(cls, config: dict, source: str = "config.json"):
        missing = [f.name for f in fields(cls) if f.default is MISSING and config.get(f.name) is None]
        if missing:
            raise CheckpointError(f"{source}: missing {', '.join(missing)}")
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            if f.name in config and not _fits(config[f.name], hints[f.name]):
                raise CheckpointError(f"{source}: {f.name} is {config[f.name]!r} ({_json_kind(config[f.name])}), "
                                      f"expected {_json_kind_of(hints[f.name])}")
        names = {f.name for f in fields(cls)}
        args = cls(**{k: v for k, v in config.items() if k in names})
        args.check(source)
        return args

    def check(self, source: str) -> None:
        """Refuse a config the family cannot serve, naming the key."""


_JSON_KINDS = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", dict: "an object",
               list: "a list", type(None): "null"}


def _fits(value, annotation) -> bool:
    """Whether a config.json value has the type a config field declares (an int is a float; a bool is not an int)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if origin is list:
        return isinstance(value, list) and all(_fits(v, args[0]) for v in value) if args else isinstance(value, list)
    if origin is dict or annotation is dict:
        return isinstance(value, dict)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation in (bool, str, list, type(None)):
        return isinstance(value, annotation)
    return True  # a type config.json cannot spell: the family's check() judges it


def _json_kind(value) -> str:
    return _JSON_KINDS.get(type(value), type(value).__name__)


def _json_kind_of(annotation) -> str:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " or ".join(_json_kind_of(a) for a in typing.get_args(annotation))
    if typing.get_origin(annotation) is list:
        return f"a list of {_json_kind_of(typing.get_args(annotation)[0]).split(' ', 1)[-1]}s"
    return _JSON_KINDS.get(annotation, getattr(annotation, "__name__", str(annotation)))


@partial(mx.compile, shapeless=True)
def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    return nn.silu(gate) * x


class WindowCache(Cache, Protocol):
    """What packing asks of a family's cache: the rows of its unkept window, room for more, a lazy commit."""

    window: int | None  # rows of the last forward, until kept

    def reserve(self, n: int) -> None:
        """Make room for a window of `n` rows at the offset."""

    def commit(self, rows: int) -> list[mx.array]:
        """Move the offset past the window's first `rows` rows, lazily; the arrays to evaluate to cut the graph."""


class Span(NamedTuple):
    """One stream's rows in the packed matrix: rows start..start+n run on `cache` at its offset."""

    start: int
    n: int
    cache: WindowCache
    mask: mx.array | None


def causal_mask(offset: int, n: int, window: int | None = None) -> mx.array | None:
    """Causal within the window (and within a sliding window); None where every key is visible."""
    if n == 1 and (window is None or offset < window):
        return None
    rows = mx.arange(offset, offset + n)[:, None]
    cols = mx.arange(offset + n)[None]
    mask = cols <= rows
    return mask & (cols > rows - window) if window else mask


def packed_ids(windows: Sequence[Sequence[int]], vocab_size: int) -> mx.array:
    """Every window's token ids in one uint32 array; an id outside the vocabulary is refused."""
    tokens = [token for window in windows for token in window]
    if tokens and (min(tokens) < 0 or max(tokens) >= vocab_size):
        raise ValueError(f"token ids must lie in 0..{vocab_size - 1}, got {min(tokens)}..{max(tokens)}")
    return mx.array(tokens, dtype=mx.uint32)


def pack_windows(caches: Sequence[WindowCache], ids: mx.array, lengths: Sequence[int], logit_rows: Sequence[int],
                 sliding_window: int | None = None) -> tuple[list[Span], list[int]]:
    """Check a forward's windows and pack them: each stream's span of rows, and the rows that give logits."""
    if not len(caches) == len(lengths) == len(logit_rows):
        raise ValueError(f"{len(caches)} caches, {len(lengths)} windows, {len(logit_rows)} logit_rows")
    if not caches:
        raise ValueError("a forward needs at least one window")
    for n, rows in zip(lengths, logit_rows):
        if n < 1 or not 0 <= rows <= n:
            raise ValueError(f"a window of {n} rows cannot give {rows} logit rows")
    if len({id(cache) for cache in caches}) < len(caches):
        raise ValueError("a cache appears twice in one forward")
    if any(cache.window is not None for cache in caches):
        raise ValueError("keep() the cache's last window before its next forward")
    if ids.size != sum(lengths):
        raise ValueError(f"{ids.size} ids for windows of {sum(lengths)} rows")
    spans, pick, start = [], [], 0
    for cache, n, rows in zip(caches, lengths, logit_rows):  # checked first, so a refused forward changes no cache
        cache.reserve(n)
        spans.append(Span(start, n, cache, causal_mask(cache.offset, n, sliding_window)))
        pick.extend(range(start + n - rows, start + n))
        start += n
    return spans, pick


def row_positions(spans: Sequence[Span]) -> mx.array:
    """Each packed row's absolute position in its stream (int32, made on the host): a rope of one position a row."""
    return mx.array([p for _, n, cache, _ in spans for p in range(cache.offset, cache.offset + n)], mx.int32)


def close_windows(spans: Sequence[Span], commit: bool) -> None:
    """After the graph is built: hold each window for keep(), or commit all its rows at once."""
    for span in spans:  # offsets were read while the graph was built, so they may move now
        if commit:
            span.cache.commit(span.n)
        else:
            span.cache.window = span.n


def picked_logits(h: mx.array, pick: Sequence[int], norm, head, vocab_size: int) -> mx.array:
    """Float32 logits of the picked rows of h; the final norm and head are row-wise, so rows are picked first."""
    if not pick:
        return mx.zeros((0, vocab_size), mx.float32)
    return head(norm(h[mx.array(pick)] if len(pick) < h.shape[0] else h)).astype(mx.float32)


def check_keep(cache: WindowCache, rows: int) -> None:
    """keep() commits a prefix of the cache's last window, and never past the cache's capacity."""
    if cache.window is None:
        raise ValueError("keep() without a forward on this cache")
    if not 0 <= rows <= cache.window:
        raise ValueError(f"cannot keep {rows} rows of a window of {cache.window}")
    if cache.offset + rows > cache.capacity:
        raise ValueError(f"a cache of capacity {cache.capacity} cannot hold {cache.offset + rows} tokens")


def size_class(tokens: int) -> int:
    """The least of 256 and the sizes m·2^e (m from 4 to 7) that holds `tokens`: four sizes an octave."""
    if tokens <= 256:
        return 256
    step = 1 << ((tokens - 1).bit_length() - 3)
    return -(-tokens // step) * step


def grown(arrays: list[mx.array], rows: int) -> list[mx.array]:
    """Keys or values [1 or layers, heads, size, dim] padded by GROW_STEP rows at a time until they hold `rows` rows."""
    size = arrays[0].shape[2] if arrays else rows
    if rows <= size:
        return arrays
    extra = -(-(rows - size) // GROW_STEP) * GROW_STEP
    return [mx.concatenate([a, mx.zeros((*a.shape[:2], extra, a.shape[3]), a.dtype)], axis=2) for a in arrays]


def activation_dtype(embedding: nn.Module) -> mx.Dtype:
    """The dtype a loaded model computes in: its embedding's weight, or a quantized embedding's scales."""
    return (embedding.scales if isinstance(embedding, nn.QuantizedEmbedding) else embedding.weight).dtype
