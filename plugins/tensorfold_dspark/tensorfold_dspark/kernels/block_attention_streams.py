"""Every block of a DSpark hold in one launch a layer: the block attention record's arithmetic on each block's rows."""

# A call's layout: q [rows, heads, head_dim], every block's rows packed in block order; one lane buffer each, its
# context keys and values [1 or none, kv_heads, capacity, head_dim] (the lane's own capacity, its first n rows valid,
# the rest possibly stale); the blocks' own keys and values packed by key, [keys, kv_heads, head_dim], block s's B keys
# at rows K_s = B_0 + ... + B_(s-1) onward. `blocks` holds each block's (start, rows, n, B): its first packed q row,
# its q rows, its lane's n and its size. A forward has rows == B for every block, so its q rows and key rows coincide;
# a contract case's one-row call keeps each block's whole B keys with fewer q rows, and the kernels find a row's keys
# through the rowmap [rows, 4]: (slot, n, K_s, B_s), never through its q row.

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Sequence

import numpy as np

from tensorfold_contract import Control, KernelRecord, Shape, Source, oversize_threadgroup, swap, variant
from tensorfold_contract.helpers import mx_dtype, rounded
from tensorfold_contract.kernel_text import build as build_kernel, narrowed, served_text
from tensorfold_core.row_kernels.attention import SPLIT, STALE, VMAX
from tensorfold_core.row_kernels.attention_streams import slots_for

from . import block_attention
from .block_attention import (CUDA_DROPPED_LAST_CONTEXT_KEY, CUDA_SPLIT_BY_ROW_COUNT, LFM2_24B, ON_CUDA, QSPREAD,
                              TINY, _attend, _geometry, _small, mlx_block_attention, tolerance)
from .block_attention_streams_sources import CUDA_STREAMS, METAL_STREAMS, ROWMAP, STREAM_SLOTS

INFLATED = dict(heads=16, kv_heads=4, head_dim=128, block=8)  # tools/zoo/inflate_lfm2.py's lfm2-dspark-0.1b
SHORTER = 37  # keys each later lane of a case holds fewer than the one before: lanes of different n and capacity


def names(slots: int) -> tuple[str, ...]:
    """The inputs of a launch naming `slots` lanes' buffers."""
    lanes = (*(f"k{s}" for s in range(slots)), *(f"v{s}" for s in range(slots)))
    return ("q", *lanes, "block_keys", "block_values", "rowmap", "scale", "dims")


NAMES = names(STREAM_SLOTS)


def narrowed_text(body: str, slots: int) -> str:
    return narrowed(body, ("const auto kc = ", "const auto vc = "), slots)


def rowmap(blocks: Sequence[tuple[int, int, int, int]]):
    """Each q row's (slot, n, its block's first packed key row, B) as int32 [rows, 4], from `blocks`."""
    # a forward makes it once a layout, for every layer
    import mlx.core as mx

    out = np.zeros((sum(count for _, count, _, _ in blocks), ROWMAP), np.int32)
    key = 0
    for slot, (start, count, n, size) in enumerate(blocks):
        out[start:start + count] = (slot, n, key, size)
        key += size
    # an abs of the host's copy: the map every layer's launch reads lives in device memory, not in the managed memory
    # a host array takes (read at each launch; the streams conv's map does the same)
    return mx.abs(mx.array(out))


# --- checks --------------------------------------------------------------------------------------------------------


def _lane(shape: tuple) -> tuple:
    return shape[1:] if len(shape) == 4 and shape[0] == 1 else shape  # the lane's [1, kv_heads, capacity, head_dim]


@functools.lru_cache(maxsize=1024)
def _shapes(q: tuple, keys: tuple, values: tuple, bk: tuple, bv: tuple) -> tuple[int, ...]:
    """(kv_heads, capacity of each lane) of a call's shapes; a shape no kernel here serves is refused, with why."""
    if not 1 <= len(keys) <= STREAM_SLOTS or len(values) != len(keys):
        raise ValueError(f"{len(keys)} lanes' keys and {len(values)} values in one launch: it takes 1 to "
                         f"{STREAM_SLOTS} blocks, each over one lane's buffer")
    if len(q) != 3:
        raise ValueError(f"block attention takes q as [rows, heads, head_dim], got shape {q}")
    _, heads, dim = q
    if len(bk) != 3 or bk != bv or bk[2] != dim:
        raise ValueError(f"block keys {bk} and values {bv} must both be [keys, kv_heads, {dim}]")
    kv = bk[1]
    lanes = [(_lane(k), _lane(v)) for k, v in zip(keys, values)]
    for s, (k, v) in enumerate(lanes):
        if len(k) != 3 or k != v or k[0] != kv or k[2] != dim:
            raise ValueError(f"lane {s}'s keys {k} and values {v} must both be [{kv}, capacity, {dim}]")
    if heads % kv:
        raise ValueError(f"{heads} heads are not a multiple of {kv} kv heads")
    if dim % 32 or SPLIT % dim:
        raise ValueError(f"head_dim {dim}: the kernels take 32, 64, 128 or 256")
    return (kv, *(k[1] for k, _ in lanes))


@functools.lru_cache(maxsize=1024)
def _check_blocks(blocks: tuple, rows: int, keys: int, capacities: tuple) -> None:
    """Blocks that do not tile the packed rows and keys, or whose n overruns its lane, are refused, with why."""
    if len(blocks) != len(capacities):
        raise ValueError(f"{len(blocks)} blocks over {len(capacities)} lanes' buffers: one lane a block")
    start = key = 0
    for s, (first, count, n, size) in enumerate(blocks):
        if first != start or count < 0:
            raise ValueError(f"block {s} holds rows {first}..{first + count - 1}: a block's rows follow the block "
                             f"before's, from row {start}")
        if size < 1:
            raise ValueError(f"block {s} of {size} keys: a block holds at least its pending token's key")
        if not 0 <= n <= capacities[s]:
            raise ValueError(f"block {s}: a context of {n} keys does not fit its lane's buffer of {capacities[s]}")
        start, key = start + count, key + size
    if start != rows or key != keys:
        raise ValueError(f"blocks of {start} rows and {key} keys, for q of {rows} rows and {keys} packed block keys")


def _checked(q, context_keys, context_values, blocks, block_keys, block_values) -> tuple:
    """(kv_heads, capacities) of a call, every shape and block checked (once a shape, once a layout)."""
    kv, *capacities = _shapes(tuple(q.shape), tuple(tuple(k.shape) for k in context_keys),
                              tuple(tuple(v.shape) for v in context_values), tuple(block_keys.shape),
                              tuple(block_values.shape))
    _check_blocks(tuple(tuple(b) for b in blocks), q.shape[0], block_keys.shape[0], tuple(capacities))
    dtype = context_keys[0].dtype
    if any(a.dtype != dtype for a in (*context_keys, *context_values)):
        raise ValueError("the lanes' buffers must share one dtype (a launch reads them through one pointer type)")
    return kv, capacities


# --- mlx: the drafter's own call on each block ------------------------------------------------------------------------


def _each_block(q, context_keys, context_values, blocks, block_keys, block_values):
    """Each block with rows as the one-block call's arguments: q rows, lane keys, values, n, own keys, own values."""
    # a block's own keys [kv_heads, B, head_dim] are the transpose of its packed rows
    key = 0
    for (start, count, n, size), ck, cv in zip(blocks, context_keys, context_values):
        if count:
            yield (q[start:start + count], ck, cv, n, block_keys[key:key + size].transpose(1, 0, 2),
                   block_values[key:key + size].transpose(1, 0, 2))
        key += size


def _joined(q, outs: list):
    import mlx.core as mx

    if not outs:
        return mx.zeros((0, *q.shape[1:]), mx.float32)
    return outs[0] if len(outs) == 1 else mx.concatenate(outs)


def mlx_block_streams(q, context_keys, context_values, blocks, rowmap, block_keys, block_values, scale: float):
    """Composed ops: each block through the block attention record's mlx call alone (`rowmap` is the kernels')."""
    _checked(q, context_keys, context_values, blocks, block_keys, block_values)
    return _joined(q, [mlx_block_attention(*one, scale)
                       for one in _each_block(q, context_keys, context_values, blocks, block_keys, block_values)])


# --- cuda / metal ----------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1024)
def _prepared(rows: int, heads: int, dim: int, kv: int, capacities: tuple) -> tuple:
    """A call's dims (the row count and the lanes' capacities move them) and launch arguments."""
    import mlx.core as mx

    padded = [*capacities, *[capacities[0]] * (STREAM_SLOTS - len(capacities))]
    dims = mx.array([rows, heads, kv, *padded], mx.int32)
    launch = _geometry(rows, heads, dim)
    return dims, dict(template=list(launch.template), grid=launch.grid, threadgroup=launch.threadgroup,
                      output_shapes=list(launch.output_shapes), output_dtypes=list(launch.output_dtypes))


def _kernel_call(q, context_keys, context_values, blocks, rowmap, block_keys, block_values,
                 scale: float) -> tuple[list, dict]:
    """The kernels' inputs in names(slots) order and launch arguments; checks, dims and launch made once a shape."""
    kv, capacities = _checked(q, context_keys, context_values, blocks, block_keys, block_values)
    if tuple(rowmap.shape) != (q.shape[0], ROWMAP):
        raise ValueError(f"rowmap {tuple(rowmap.shape)} is not [{q.shape[0]}, {ROWMAP}] for q {tuple(q.shape)}")
    dims, launch = _prepared(*q.shape, kv, tuple(capacities))
    pad = slots_for(len(context_keys)) - len(context_keys)  # a slot no row names is never read
    return [q, *context_keys, *[context_keys[0]] * pad, *context_values, *[context_values[0]] * pad, block_keys,
            block_values, rowmap, _small((scale,), "float32"), dims], launch


_BUILT: dict = {}  # (kind, slots) -> the kernel, built once


def _source_block_streams(kind: str, q, context_keys, context_values, blocks, rowmap, block_keys, block_values,
                          scale: float):
    import mlx.core as mx

    inputs, launch = _kernel_call(q, context_keys, context_values, blocks, rowmap, block_keys, block_values, scale)
    if q.shape[0] == 0:
        return mx.zeros((0, *q.shape[1:]), mx.float32)
    slots = slots_for(len(context_keys))
    kernel = _BUILT.get((kind, slots))
    if kernel is None:
        body = narrowed_text(CUDA_STREAMS if kind == "cuda" else METAL_STREAMS, slots)
        # named by its text: MLX caches compiled kernels by name, in memory and on disk
        name = f"tf_dspark_block_streams_{hashlib.sha1(served_text(body).encode()).hexdigest()[:12]}"
        kernel = _BUILT[(kind, slots)] = build_kernel(kind, name, names(slots), ["out"], body)
    (out,) = kernel(inputs=inputs, **launch)
    return out


def cuda_block_streams(q, context_keys, context_values, blocks, rowmap, block_keys, block_values, scale: float):
    """The cuda kernel; pass each lane's whole buffer (a [..., :n, :] slice is copied to be made contiguous)."""
    return _source_block_streams("cuda", q, context_keys, context_values, blocks, rowmap, block_keys, block_values,
                                 scale)


def metal_block_streams(q, context_keys, context_values, blocks, rowmap, block_keys, block_values, scale: float):
    """The metal kernel, the same algorithm as cuda's (never run here: no Apple machine)."""
    return _source_block_streams("metal", q, context_keys, context_values, blocks, rowmap, block_keys, block_values,
                                 scale)


# What a hold calls, by implementation kind: fn(q, context_keys, context_values, blocks, rowmap, block_keys,
# block_values, scale) -> out [rows, heads, head_dim] float32, row r of block s = softmax(scale q[r] [ck_s[:n_s];
# bk_s]^T) [cv_s[:n_s]; bv_s] over all B_s keys of its block, each row bit-equal to the block attention record's call
# on its block alone; for 1 to STREAM_SLOTS blocks, `blocks` their (start, rows, n, B), `rowmap` rowmap(blocks)
BLOCK_STREAMS = {"mlx": mlx_block_streams, "cuda": cuda_block_streams, "metal": metal_block_streams}


# --- the record ------------------------------------------------------------------------------------------------------


def contexts(dims) -> list[int]:
    """Each lane's n in a case: the first dims["context"], each later one SHORTER fewer (at least 1, unless 0)."""
    n = dims["context"]
    return [max(n - SHORTER * s, min(n, 1)) for s in range(dims["blocks"])]


def _counts(rows: int, dims) -> list[int]:
    """q rows of each block: split over the blocks but `idle`, the first ones one more."""
    # B each in a served shape; the kernels take any number, every one over the same B keys
    live = [s for s in range(dims["blocks"]) if s != dims.get("idle")]
    share = {s: rows // len(live) + (k < rows % len(live)) for k, s in enumerate(live)}
    return [share.get(s, 0) for s in range(dims["blocks"])]


def make(dims, rows, rng):
    """`blocks` blocks of B keys sharing `rows` q rows (`slot` each row's), lane s holding contexts(dims)[s] keys."""
    # the blocks' keys are no row's input: every row slice keeps them all, since a one-row call reads its whole block
    h, kv, d, b, dtype = (dims[k] for k in ("heads", "kv_heads", "head_dim", "block", "dtype"))
    spread = 10.0 ** rng.uniform(-QSPREAD, QSPREAD, size=(rows, h, 1))
    host = {"q": rounded(rng.standard_normal((rows, h, d)) * spread, dtype),
            "slot": np.repeat(np.arange(dims["blocks"], dtype=np.int32), _counts(rows, dims)),
            "block_keys": rounded(rng.standard_normal((dims["blocks"] * b, kv, d)), dtype),
            "block_values": rounded(rng.uniform(-VMAX, VMAX, (dims["blocks"] * b, kv, d)), dtype),
            "scale": np.array([d ** -0.5], np.float32)}
    for s, n in enumerate(contexts(dims)):
        host[f"k{s}"] = rounded(rng.standard_normal((1, kv, n + STALE, d)), dtype)
        host[f"v{s}"] = rounded(rng.uniform(-VMAX, VMAX, (1, kv, n + STALE, d)), dtype)
        host[f"k{s}"][:, :, n:] = np.nan  # a kernel that reads past n, or another lane's n, fails gate 2
        host[f"v{s}"][:, :, n:] = np.nan
    return host


def _blocks(case) -> tuple[tuple[int, int, int, int], ...]:
    """(start, rows, n, B) of each block of a call, from its rows' slots."""
    # a block's rows are consecutive, so a prefix or one row of a case is a call of its own
    slot, start, out = case["slot"], 0, []
    for s, n in enumerate(contexts(case.dims)):
        count = int(np.count_nonzero(slot == s))
        out.append((start, count, n, case.dims["block"]))
        start += count
    return tuple(out)


def _call(case):
    """The arguments a hold passes: every block's rows, each lane's whole buffer, the blocks' packed keys."""
    dt = mx_dtype(case.dims["dtype"])
    lanes = range(case.dims["blocks"])
    blocks = _blocks(case)
    return (case.array("q", dt), [case.array(f"k{s}", dt) for s in lanes], [case.array(f"v{s}", dt) for s in lanes],
            blocks, rowmap(blocks), case.array("block_keys", dt), case.array("block_values", dt),
            float(case["scale"][0]))


def reference(case):
    """Softmax attention in float64 on the host: each row over its lane's n context keys and all its block's keys."""
    q = case["q"].astype(np.float64)
    rows, h, d = q.shape
    b, scale = case.dims["block"], float(case["scale"][0])
    out = np.zeros((rows, h, d))
    for s, n in enumerate(contexts(case.dims)):
        at = np.flatnonzero(case["slot"] == s)
        own = slice(s * b, (s + 1) * b)
        k, v = (np.concatenate([case[f"{a}{s}"][0, :, :n], case[f"block_{w}"][own].transpose(1, 0, 2)], axis=1)
                .astype(np.float64) for a, w in (("k", "keys"), ("v", "values")))
        kv = k.shape[0]
        sc = np.einsum("rkgd,knd->rkgn", q[at].reshape(len(at), kv, h // kv, d), k) * scale
        w = np.exp(sc - sc.max(axis=-1, keepdims=True, initial=-np.inf))
        out[at] = (np.einsum("rkgn,knd->rkgd", w, v) / w.sum(axis=-1)[..., None]).reshape(len(at), h, d)
    return {"out": out}


def composed(fn=mlx_block_streams):
    return lambda case: {"out": fn(*_call(case))}


def _planted(**knobs):
    """Planted: each block through block_attention._attend with a knob turned (`cut`: as many keys as it has rows)."""
    cut = knobs.pop("cut", False)

    def fn(q, context_keys, context_values, blocks, rowmap, block_keys, block_values, scale):
        outs = []
        for one in _each_block(q, context_keys, context_values, blocks, block_keys, block_values):
            more = dict(block_end=min(one[0].shape[0], one[4].shape[1])) if cut else {}
            outs.append(_attend(*one, scale, **knobs, **more))
        return _joined(q, outs)

    return fn


def first_lane_for_all(q, context_keys, context_values, blocks, rowmap, block_keys, block_values, scale):
    """Planted: every block reads the first lane's context (each n fits it: the first lane's is the longest)."""
    lanes = len(context_keys)
    return mlx_block_streams(q, [context_keys[0]] * lanes, [context_values[0]] * lanes, blocks, rowmap, block_keys,
                             block_values, scale)


def stale_context_attended(q, context_keys, context_values, blocks, rowmap, block_keys, block_values, scale):
    """Planted: each lane's whole buffer attended, the rows past n too."""
    whole = tuple((start, count, k.shape[-2], size) for (start, count, _, size), k in zip(blocks, context_keys))
    return mlx_block_streams(q, context_keys, context_values, whole, rowmap, block_keys, block_values, scale)


def _single_block(kind: str):
    """The claim: each block's rows get the bits the block attention record's `kind` call gives that block alone."""
    from tensorfold_contract.serving import ServedCall, call

    single = block_attention.RECORD.implementations[kind]

    def claim(case):
        q, keys, values, blocks, _, bk, bv, _ = _call(case)
        outs = []
        for rows, ck, cv, n, own_k, own_v in _each_block(q, keys, values, blocks, bk, bv):
            arrays = {"q": rows, "context_keys": ck, "context_values": cv, "block_keys": own_k,
                      "block_values": own_v, "scale": case["scale"]}
            outs.append(call(kind, single, ServedCall(rows.shape[0], {**case.dims, "context": n}, arrays))["out"])
        return {"out": _joined(q, outs)}

    claim.__name__ = f"the block attention record's {kind} per block"
    return claim


def _narrow(source: Source, case) -> Source:
    """The text a case's launch serves: as many lane slots as `slots_for` its blocks."""
    slots = slots_for(case.dims["blocks"])
    return dataclasses.replace(source, name=f"{source.name}{slots}", input_names=names(slots),
                               body=narrowed_text(source.body, slots), narrow=None)


def source(kind: str) -> Source:
    """The text of every slot (a case launches its narrowed text: Source.at)."""
    return Source("dspark_block_streams", NAMES, ("out",), CUDA_STREAMS if kind == "cuda" else METAL_STREAMS,
                  inputs=lambda case: _kernel_call(*_call(case))[0],
                  launch=lambda case: _geometry(case.rows, case.dims["heads"], case.dims["head_dim"]), narrow=_narrow)


# The sources' planted defects (the last context key and the split size as in the one-block record: shared lines)
SLOT_IGNORED = swap(f"const int slot = rowmap[{ROWMAP} * row];", "const int slot = 0;")
# row - kb is the row's index in its block where its q rows and keys coincide, as in a forward and gate 2's calls
CUDA_CAUSAL_BLOCK = swap("if (base + t >= T) sc = NEG_INF;",
                         "if (base + t >= T || base + t - n > row - kb) sc = NEG_INF;")


def shape(label: str, model: dict, context: int, blocks: int, dtype: str = "float32", rows: int | None = None,
          heavy: bool = False, **more) -> Shape:
    """`blocks` blocks of a model's heads, the first over `context` keys; every block's rows, unless `rows` says."""
    dims = {**model, "context": context, "dtype": dtype, "blocks": blocks, **more}
    return Shape(label, dims, blocks * model["block"] if rows is None else rows, heavy)


SERVED = tuple(shape(f"{name} {dtype}, {blocks} blocks over {context} keys", model, context, blocks, dtype)
               for name, model, context in (("tiny drafter", TINY, 300), ("LFM2.5-24B-A2B drafter", LFM2_24B, 500),
                                            ("inflated lfm2 drafter", INFLATED, 700))
               for dtype in ("float32", "bfloat16") for blocks in (8, 3))

RECORD = KernelRecord(
    name="dspark block attention streams",
    family="dspark",
    description=f"the block attention record for up to {STREAM_SLOTS} blocks of a hold in one call: row r of block s "
                "= softmax(scale q[r] [ck_s[:n_s]; bk_s]^T) [cv_s[:n_s]; bv_s] over its own lane's context and all "
                "its block's keys, in the one-block record's split order; fp32 output",
    make=make,
    reference=reference,
    implementations={"mlx": composed(), "cuda": source("cuda"), "metal": source("metal")},
    shapes=(*SERVED, shape("LFM2.5-24B-A2B drafter bf16, 8 blocks over 4096 keys", LFM2_24B, 4096, 8, "bfloat16",
                           heavy=True)),
    edges=(
        shape("1 row", TINY, 300, 3, rows=1),
        shape("no context yet in any lane", TINY, 0, 3),
        shape("lanes down to 1 key (40, 3, 1)", TINY, 40, 3),
        shape("a lane with no rows between two", TINY, 300, 3, rows=16, idle=1),
        shape("context and block across a split boundary (250 + 8)", TINY, 250, 2),
        shape("context on a split's last key (256 + 8)", TINY, 256, 3),
        shape("blocks of 1, 8 lanes", {**TINY, "block": 1}, 40, 8),
        shape("head_dim 128, one split and a key (249 + 8)", INFLATED, 249, 2, "bfloat16"),
        shape("empty", TINY, 40, 3, rows=0),
    ),
    tolerance=tolerance,
    row_inputs=("q", "slot"),
    findings=ON_CUDA,
    bit_equal_to={kind: _single_block(kind) for kind in ("mlx", "cuda", "metal")},
    controls=(
        Control("every block on the first lane's context", "mlx", 2, variant(composed(first_lane_for_all))),
        Control("stale context keys attended", "mlx", 2, variant(composed(stale_context_attended))),
        Control("causal inside the block", "mlx", 2, variant(composed(_planted(causal=True)))),
        Control("block keys cut to the row count", "mlx", 4, variant(composed(_planted(cut=True)))),
        Control("every block on the first lane's context", "cuda", 2, SLOT_IGNORED),
        Control("last context key dropped", "cuda", 2, CUDA_DROPPED_LAST_CONTEXT_KEY),
        Control("block keys read causally", "cuda", 2, CUDA_CAUSAL_BLOCK),
        Control("split size by row count", "cuda", 4, CUDA_SPLIT_BY_ROW_COUNT),
        Control("over-sized threadgroup", "cuda", 5, oversize_threadgroup()),
        Control("every block on the first lane's context", "metal", 2, SLOT_IGNORED),
        Control("over-sized threadgroup", "metal", 5, oversize_threadgroup()),
    ),
)
