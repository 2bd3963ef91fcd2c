"""Window attention for every stream of a forward in one launch: the fixed-split attention of attention.py, each row
over its own stream's cache, with the window's keys and values read from the packed rows (the caches are written once
a forward, after its last layer)."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from tensorfold_contract import Control, KernelRecord, Shape, Source, oversize_threadgroup, swap, variant

from .attention import (CUDA_DROPPED_LAST_KEY, CUDA_WARPS_REVERSED_WHEN_MANY, LOOSE_ON_CUDA, NOT_INVARIANT_ON_CUDA,
                        SMALL, SPLIT, STALE, VMAX, WIDE, _attend, _geometry, _scale, tolerance)
from .attention import shape as single_stream_shape
from .attention_sources import CUDA_STREAMS, METAL_STREAMS, STREAM_SLOTS
from tensorfold_contract.helpers import WIDEST, mx_dtype, rounded
from tensorfold_contract.kernel_text import build as build_kernel, narrowed


def names(slots: int) -> tuple[str, ...]:
    """The inputs of a launch naming `slots` streams' caches."""
    caches = (*(f"k{s}" for s in range(slots)), *(f"v{s}" for s in range(slots)))
    return ("q", "kn", "vn", *caches, "rowmap", "scale", "dims")


NAMES = names(STREAM_SLOTS)


def slots_for(streams: int) -> int:
    """Cache slots a launch of `streams` streams names: a power of two (few texts to build), since each input costs
    MLX host time at every launch; all of them under TENSORFOLD_NARROW_INPUTS=0 (the text the slots narrow)."""
    if os.environ.get("TENSORFOLD_NARROW_INPUTS") == "0":
        return STREAM_SLOTS
    return min(STREAM_SLOTS, 1 << (streams - 1).bit_length())


def narrowed_text(body: str, slots: int) -> str:
    return narrowed(body, ("const auto kc = ", "const auto vc = "), slots)


LAYERS = 2  # layers of the contract's caches: the call reads the last, the first is NaN
# splits a block runs side by side: two, as the single-stream kernel (1,024 threads of its registers pass what a
# block may hold on sm_90)
GROUPS = 2


@dataclass(frozen=True)
class Packed:
    """A forward's streams as the kernel reads them: each one's (first packed row, rows, cache offset), the per-row
    map (slot, position, first row of its window) as an int32 array, made once for every layer."""

    spans: tuple[tuple[int, int, int], ...]
    rowmap: "mx.array"


def packed(spans: Sequence[tuple[int, int, int]]) -> Packed:
    """The rowmap of streams whose windows sit at (start, rows, offset) in the packed rows, slots in order."""
    import mlx.core as mx

    rows = [(slot, offset + i, start) for slot, (start, n, offset) in enumerate(spans) for i in range(n)]
    # streams with no rows keep their slot (a contract case's prefix of rows), and name no row
    return Packed(tuple(spans), mx.array(np.array(rows, np.int32).reshape(-1, 3)))


def mlx_streams_attention(q, kn, vn, keys: Sequence, values: Sequence, streams: Packed, layer: int, scale: float,
                          window: int | None = None):
    """Composed ops: each stream's window through the single-stream attention over its cache's keys before the
    window and the packed keys of the window, in the kernels' split order."""
    import mlx.core as mx

    outs = []
    for (start, n, offset), k, v in zip(streams.spans, keys, values):
        if n == 0:
            continue
        rows = slice(start, start + n)
        ks = mx.concatenate([k[layer, :, :offset], kn[rows].transpose(1, 0, 2)], axis=1)
        vs = mx.concatenate([v[layer, :, :offset], vn[rows].transpose(1, 0, 2)], axis=1)
        outs.append(_attend(q[rows], ks, vs, offset, scale, window).astype(q.dtype))
    if not outs:
        return mx.zeros((0, *q.shape[1:]), q.dtype)
    return outs[0] if len(outs) == 1 else mx.concatenate(outs)


_BUILT: dict = {}


def _source_streams_attention(kind: str, q, kn, vn, keys: Sequence, values: Sequence, streams: Packed, layer: int,
                              scale: float, window: int | None = None):
    import mlx.core as mx

    inputs, launch = _kernel_call(q, kn, vn, keys, values, streams, layer, scale, window)
    if q.shape[0] == 0:
        return mx.zeros((0, *q.shape[1:]), q.dtype)
    slots = slots_for(len(keys))
    kernel = _BUILT.get((kind, slots))
    if kernel is None:
        body = narrowed_text(CUDA_STREAMS if kind == "cuda" else METAL_STREAMS, slots)
        name = f"tf_streams_attention_{hashlib.sha1(body.encode()).hexdigest()[:12]}"  # MLX caches kernels by name
        kernel = _BUILT[(kind, slots)] = build_kernel(kind, name, names(slots), ["out"], body)
    (out,) = kernel(inputs=inputs, **launch)
    return out


def _kernel_call(q, kn, vn, keys: Sequence, values: Sequence, streams: Packed, layer: int, scale: float,
                 window: int | None) -> tuple[list, dict]:
    """The kernel's inputs in NAMES order and its launch arguments, as a forward and the contract's cases pass them;
    the checks, dims and launch are made once for each shape and layer (a forward calls this once a layer)."""
    dims, launch = _prepared(tuple(q.shape), tuple(kn.shape), tuple(tuple(k.shape) for k in keys), layer, window or 0,
                             str(q.dtype).removeprefix("mlx.core."))
    pad = slots_for(len(keys)) - len(keys)  # a slot no row names is never read
    return [q, kn, vn, *keys, *[keys[0]] * pad, *values, *[values[0]] * pad, streams.rowmap, _scale(scale),
            dims], launch


def _check(q: tuple, kn: tuple, keys: Sequence[tuple]) -> None:
    """A call no kernel here serves is refused, with why (from the shapes of q, kn and the caches)."""
    if not 1 <= len(keys) <= STREAM_SLOTS:
        raise ValueError(f"{len(keys)} streams in one launch: it takes 1 to {STREAM_SLOTS}")
    rows, heads, dim = q
    if kn != (rows, kn[1], dim) or any(len(k) != 4 or k[1:] != (kn[1], k[2], dim) for k in keys):
        raise ValueError(f"packed keys {kn} and caches {list(keys)} do not match queries {q} as "
                         f"[rows, kv_heads, {dim}] and [layers, kv_heads, capacity, {dim}]")
    if heads % kn[1] or dim % 32 or SPLIT % dim:
        raise ValueError(f"{heads} heads over {kn[1]} kv heads of head_dim {dim}: the kernels take kv heads "
                         "dividing the heads and head_dim 32, 64, 128 or 256")


@functools.lru_cache(maxsize=1024)
def _prepared(q: tuple, kn: tuple, keys: tuple, layer: int, window: int, dtype: str) -> tuple:
    """A call's dims (the layer and the caches' capacities move them) and launch arguments (written in the queries'
    dtype `dtype`), its shapes checked."""
    import mlx.core as mx

    _check(q, kn, keys)
    capacities = [k[2] for k in keys] + [keys[0][2]] * (STREAM_SLOTS - len(keys))
    dims = mx.array([q[0], q[1], kn[1], layer, window, *capacities], mx.int32)
    launch = _geometry(q[0], q[1], q[2], GROUPS, mx_dtype(dtype))
    return dims, dict(template=list(launch.template), grid=launch.grid, threadgroup=launch.threadgroup,
                      output_shapes=list(launch.output_shapes), output_dtypes=list(launch.output_dtypes))


def cuda_streams_attention(*args, **kwargs):
    return _source_streams_attention("cuda", *args, **kwargs)


def metal_streams_attention(*args, **kwargs):
    """The metal kernel, the same algorithm as cuda's (never run here: no Apple machine)."""
    return _source_streams_attention("metal", *args, **kwargs)


# What a forward calls, by implementation kind: out[r] = softmax(scale q[r] k[lo..p]^T) v[lo..p] over row r's own
# stream, [rows, heads, head_dim] in the queries' dtype (the fp32 result rounded once), for at most STREAM_SLOTS
# streams' [layers, kv_heads, capacity, head_dim] caches and the window's packed keys and values
# [rows, kv_heads, head_dim]
STREAMS_ATTENTION = {"mlx": mlx_streams_attention, "cuda": cuda_streams_attention, "metal": metal_streams_attention}


def make(dims, rows, rng):
    """`streams` streams sharing `rows` rows (the first ones one more), stream s's window ending at position
    keys - 1 - 37 s, over a cache of LAYERS layers that holds every key up to it, the window's too (so its 1-row
    calls, which read the window's earlier keys from the cache, see the values the packed rows carry), then STALE NaN
    keys; the layer the call does not read is NaN."""
    h, kv, d, dt = dims["heads"], dims["kv_heads"], dims["head_dim"], dims["dtype"]
    streams = dims["streams"]
    counts = [rows // streams + (s < rows % streams) for s in range(streams)]
    q = rounded(rng.standard_normal((rows, h, d)) * 10.0 ** rng.uniform(-1, 1, size=(rows, h, 1)), dt)
    out = {"q": q, "kn": np.zeros((rows, kv, d), np.float32), "vn": np.zeros((rows, kv, d), np.float32),
           "slot": np.zeros(rows, np.int32), "pos": np.zeros(rows, np.int32),
           "scale": np.array([d ** -0.5], np.float32)}
    start = 0
    for s, n in enumerate(counts):
        keys = max(dims["keys"] - 37 * s, max(n, 1))
        k = np.full((LAYERS, kv, keys + STALE, d), np.nan, np.float32)
        v = np.full((LAYERS, kv, keys + STALE, d), np.nan, np.float32)
        k[-1, :, :keys] = rounded(rng.standard_normal((kv, keys, d)), dt)
        v[-1, :, :keys] = rounded(rng.uniform(-VMAX, VMAX, (kv, keys, d)), dt)
        offset = keys - n
        out[f"k{s}"], out[f"v{s}"] = k, v
        out["kn"][start:start + n] = k[-1, :, offset:keys].transpose(1, 0, 2)
        out["vn"][start:start + n] = v[-1, :, offset:keys].transpose(1, 0, 2)
        out["slot"][start:start + n], out["pos"][start:start + n] = s, np.arange(offset, keys)
        start += n
    return out


def _spans(case) -> list[tuple[int, int, int]]:
    """(start, rows, offset) of each stream of a call, from its rows' slots and positions (rows of a stream are
    consecutive, so a prefix or one row of a case is a call of its own)."""
    slot, pos = case["slot"], case["pos"]
    spans = []
    for s in range(case.dims["streams"]):
        rows = np.flatnonzero(slot == s)
        spans.append((int(rows[0]), len(rows), int(pos[rows[0]])) if len(rows) else (0, 0, 0))
    return spans


def _call(case):
    """The arguments a forward passes: the case's streams (slots as the case numbers them), caches, packed rows."""
    dt = mx_dtype(case.dims["dtype"])
    streams = range(case.dims["streams"])
    keys = [case.array(f"k{s}", dt) for s in streams]
    values = [case.array(f"v{s}", dt) for s in streams]
    return (case.array("q", dt), case.array("kn", dt), case.array("vn", dt), keys, values, packed(_spans(case)),
            LAYERS - 1, float(case["scale"][0]), case.dims.get("window") or None)


def reference(case):
    """Softmax attention in float64 on the host, each row over keys lo..p of its own stream's last layer."""
    q = case["q"].astype(np.float64)
    rows, h, d = q.shape
    window, scale = case.dims.get("window", 0), float(case["scale"][0])
    out = np.zeros((rows, h, d))
    for r, (s, p) in enumerate(zip(case["slot"], case["pos"])):
        k, v = (case[f"{n}{s}"][-1].astype(np.float64) for n in ("k", "v"))
        kv, lo = k.shape[0], max(0, p - window + 1) if window else 0
        sc = np.einsum("kgd,knd->kgn", q[r].reshape(kv, h // kv, d), k[:, lo:p + 1]) * scale
        w = np.exp(sc - sc.max(axis=-1, keepdims=True))
        out[r] = (np.einsum("kgn,knd->kgd", w, v[:, lo:p + 1]) / w.sum(axis=-1)[..., None]).reshape(h, d)
    return {"out": out}


def streams_tolerance(dims):
    # the window attention's bound, and a bf16 output's one rounding (half a spacing at the values' largest, VMAX);
    # the fp32 edge keeps the tight bound, where a dropped key shows
    bound = tolerance(dims)
    return dataclasses.replace(bound, atol=bound.atol + (VMAX * 2.0 ** -8 if dims["dtype"] == "bfloat16" else 0.0))


def composed(fn=mlx_streams_attention):
    return lambda case: {"out": fn(*_call(case))}


def first_cache_for_all(q, kn, vn, keys, values, streams, layer, scale, window):
    """Planted: every row reads the first stream's cache."""
    return mlx_streams_attention(q, kn, vn, [keys[0]] * len(keys), [values[0]] * len(values), streams, layer, scale,
                                 window)


def _kernel_inputs(case) -> list:
    return _kernel_call(*_call(case))[0]


def _narrow(source: Source, case) -> Source:
    """The text a case's launch serves: as many cache slots as `slots_for` its streams."""
    slots = slots_for(case.dims["streams"])
    return dataclasses.replace(source, name=f"{source.name}{slots}", input_names=names(slots),
                               body=narrowed_text(source.body, slots), narrow=None)


def source(kind: str) -> Source:
    """The text of every slot (a case launches its narrowed text: Source.at)."""
    return Source("streams_attention", NAMES, ("out",), CUDA_STREAMS if kind == "cuda" else METAL_STREAMS,
                  inputs=_kernel_inputs,
                  launch=lambda case: _geometry(case.rows, case.dims["heads"], case.dims["head_dim"], GROUPS,
                                                mx_dtype(case.dims["dtype"])), narrow=_narrow)


CUDA_SLOT_IGNORED = swap("const int slot = rowmap[3 * row];", "const int slot = 0;")


def shape(label: str, model: dict, keys: int, streams: int, dtype: str = "bfloat16", rows: int = WIDEST,
          window: int = 0, heavy: bool = False) -> Shape:
    """`rows` rows of `streams` streams of a model's heads, the first stream's window ending at position keys - 1."""
    one = single_stream_shape(label, model, keys, dtype, rows, window, heavy)
    return dataclasses.replace(one, dims={**one.dims, "streams": streams})


def record(family: str, shapes: tuple[Shape, ...]) -> KernelRecord:
    """`family`'s packed-streams window attention record, proven at the shapes it serves."""
    return KernelRecord(
        name=f"{family} window attention streams",
        family=family,
        description=f"the window attention record's sums for up to {STREAM_SLOTS} streams in one call: row r over its "
                    "own stream's cache before its window and the window's packed keys; fp32 sums, written in "
                    "the queries' dtype",
        make=make,
        reference=reference,
        implementations={"mlx": composed(), "cuda": source("cuda"), "metal": source("metal")},
        shapes=shapes,
        edges=(
            shape("1 row", SMALL, 700, 1, rows=1),
            shape("p = 0", SMALL, 1, 1, rows=1),
            shape("8 streams of 2 rows, fp32", SMALL, 300, 8, "float32"),
            shape("windows across a split boundary", SMALL, 270, 3),
            shape("sliding window of 5 keys, 2 streams", SMALL, 100, 2, window=5),
            shape("head_dim 128, one split and a key", WIDE, 257, 2, rows=3),
            shape("empty", SMALL, 40, 2, rows=0),
        ),
        tolerance=streams_tolerance,
        row_inputs=("q", "kn", "vn", "slot", "pos"),
        findings=(NOT_INVARIANT_ON_CUDA, *LOOSE_ON_CUDA),
        controls=(
            Control("every row on the first stream's cache", "mlx", 2, variant(composed(first_cache_for_all))),
            Control("every row on the first stream's cache", "cuda", 2, CUDA_SLOT_IGNORED),
            Control("dropped last key", "cuda", 2, CUDA_DROPPED_LAST_KEY),
            Control("warp sums reversed when many rows", "cuda", 4, CUDA_WARPS_REVERSED_WHEN_MANY),
            Control("over-sized threadgroup", "cuda", 5, oversize_threadgroup()),
            Control("over-sized threadgroup", "metal", 5, oversize_threadgroup()),
        ),
    )
