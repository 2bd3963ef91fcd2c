"""The LFM2 short conv for every stream of a forward in one launch: the stream conv record's arithmetic on each row."""

from __future__ import annotations

import functools
import hashlib
from typing import Sequence

import numpy as np

from tensorfold_contract import Control, KernelRecord, Launch, Shape, Source, oversize_threadgroup, swap, variant
from tensorfold_contract.kernel_text import build as build_kernel, served_text

from . import conv
from .common import DTYPES, LFM2_1B, TINY_LFM2, WIDEST, groups, int_array, kept_array, mx_dtype, rounded

THREADS = conv.THREADS
LAYERS = 2  # conv layers of the contract's stacked tails: the call reads the last, the first is NaN

CUDA = """
// One thread per (row, channel) of every stream's packed rows. The rowmap gives the row's stream and its window's
// first packed row; then conv.py's arithmetic over [the stream's tail of this layer; its window's rows]: the L taps
// oldest first as fp32 FMAs, then the bias; then the L-1 inputs keep() leaves after this row. Nothing a thread does
// depends on the row count or on another stream.
const int rows = dims[0];
const int C = dims[1];
const int layers = dims[2];
const int layer = dims[3];
const int i = blockIdx.x * blockDim.x + threadIdx.x;
if (i >= rows * C) return;
const int r = i / C;
const int c = i - r * C;
const int s = rowmap[2 * r];
const int first = rowmap[2 * r + 1];
const int p = r - first;  // the row's index in its window
const size_t tail = (size_t)(s * layers + layer) * (L - 1);  // the stream's tail of this layer, in rows of C
float acc = 0.0f;
for (int j = 0; j < L; ++j) {
  const int t = p + j;  // position in [tail; window rows]
  const float v = t < L - 1 ? static_cast<float>(tails[(tail + t) * C + c])
                            : static_cast<float>(bx[(size_t)(first + t - (L - 1)) * C + c]);
  acc = fmaf(static_cast<float>(w[(size_t)c * L + j]), v, acc);
}
if (HAS_BIAS) acc += static_cast<float>(bias[c]);
y[i] = static_cast<T>(acc);
for (int q = 0; q < L - 1; ++q) {
  const int t = p + 1 + q;
  states[((size_t)r * (L - 1) + q) * C + c] = t < L - 1 ? tails[(tail + t) * C + c]
                                                        : bx[(size_t)(first + t - (L - 1)) * C + c];
}
"""

METAL = """
// One thread per (row, channel); the same stream lookup and fixed tap order as the CUDA source.
const int rows = dims[0];
const int C = dims[1];
const int layers = dims[2];
const int layer = dims[3];
const int i = (int)thread_position_in_grid.x;
if (i >= rows * C) return;
const int r = i / C;
const int c = i - r * C;
const int s = rowmap[2 * r];
const int first = rowmap[2 * r + 1];
const int p = r - first;
const int tail = (s * layers + layer) * (L - 1);
float acc = 0.0f;
for (int j = 0; j < L; ++j) {
  const int t = p + j;
  const float v = t < L - 1 ? static_cast<float>(tails[(tail + t) * C + c])
                            : static_cast<float>(bx[(first + t - (L - 1)) * C + c]);
  acc = metal::fma(static_cast<float>(w[c * L + j]), v, acc);
}
if (HAS_BIAS) acc += static_cast<float>(bias[c]);
y[i] = static_cast<T>(acc);
for (int q = 0; q < L - 1; ++q) {
  const int t = p + 1 + q;
  states[(r * (L - 1) + q) * C + c] = t < L - 1 ? tails[(tail + t) * C + c] : bx[(first + t - (L - 1)) * C + c];
}
"""

NAMES = ("bx", "tails", "rowmap", "w", "bias", "dims")  # the kernels' inputs, in the order a call passes them
OUTPUTS = ("y", "states")


def rowmap(spans: Sequence[tuple[int, int]]):
    """Each packed row's (stream, its window's first packed row) as an int32 [rows, 2] array, from the streams'
    (start, rows); made once a forward, for every conv layer."""
    import mlx.core as mx

    rows = max((start + n for start, n in spans), default=0)
    out = np.zeros((rows, 2), np.int32)
    for s, (start, n) in enumerate(spans):
        out[start:start + n] = (s, start)
    return mx.array(out)


# --- mlx: what the family's nn.Conv1d computes over each stream's [tail; rows] ----------------------------------------


def _windows(bx, tails, layer: int, spans):
    """Each stream with rows as (rows, [its tail of `layer`; its rows]), in stream order."""
    import mlx.core as mx

    for s, (start, n) in enumerate(spans):
        if n:
            yield n, mx.concatenate([tails[s, layer], bx[start:start + n]])


@functools.lru_cache(maxsize=256)
def _kept(n: int, tail: int):
    """Where row i's kept tail sits in [tail; rows]: i + 1 .. i + tail, for each of n rows (made once a size)."""
    import mlx.core as mx

    # from host values, not a lazy op: a cached array may first be evaluated on another thread's stream
    return mx.array(np.arange(n, dtype=np.int32)[:, None] + np.arange(1, tail + 1, dtype=np.int32)[None])


def _states(seq, n: int):
    """The tail keep(i + 1) leaves for each of the window's n rows: seq[i + 1 : i + L], copies."""
    return seq[_kept(n, seq.shape[0] - n)]


def _joined(bx, w, ys: list, states: list):
    import mlx.core as mx

    if not ys:
        C, L = w.shape
        return mx.zeros((0, C), bx.dtype), mx.zeros((0, L - 1, C), bx.dtype)
    return (ys[0], states[0]) if len(ys) == 1 else (mx.concatenate(ys), mx.concatenate(states))


def mlx_streams_conv(bx, tails, layer: int, spans, rowmap, w, bias=None):
    """Composed ops: each stream's window through nn.Conv1d's own ops (a depthwise mx.conv1d, then the bias) over its
    tail and rows, as the stream conv record's mlx path; states sliced from the same input. `rowmap` is the kernels'."""
    import mlx.core as mx

    weight = w[:, :, None]  # nn.Conv1d's depthwise layout [C, L, 1], as the family's sanitize leaves it
    ys, states = [], []
    for n, seq in _windows(bx, tails, layer, spans):
        y = mx.conv1d(seq[None], weight, groups=w.shape[0])[0]
        ys.append(y + bias if bias is not None else y)
        states.append(_states(seq, n))
    return _joined(bx, w, ys, states)


# --- cuda / metal ----------------------------------------------------------------------------------------------------


def _geometry(rows: int, C: int, L: int, dtype: str, bias: bool) -> Launch:
    dt = mx_dtype(dtype)
    return Launch(grid=(groups(rows * C, THREADS) * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
                  output_shapes=((rows, C), (rows, L - 1, C)), output_dtypes=(dt, dt),
                  template=(("T", dt), ("L", L), ("HAS_BIAS", bias)))


def _check(bx: tuple, tails: tuple, w: tuple, rowmap: tuple, layer: int) -> None:
    """A call no kernel here serves is refused, with why (from the shapes of its arrays)."""
    if len(bx) != 2 or len(w) != 2 or w[0] != bx[1] or w[1] < 1:
        raise ValueError(f"rows {bx} and weights {w} do not match as [rows, channels] and [channels, L]")
    C, L = w
    if len(tails) != 4 or tails[2:] != (L - 1, C):
        raise ValueError(f"tails {tails} are not [streams, layers, {L - 1}, {C}] for weights {w}")
    if not 0 <= layer < tails[1]:
        raise ValueError(f"layer {layer} of tails of {tails[1]} layers")
    if rowmap != (bx[0], 2):
        raise ValueError(f"rowmap {rowmap} is not [{bx[0]}, 2] for rows {bx}")


@functools.lru_cache(maxsize=1024)
def _prepared(bx: tuple, tails: tuple, w: tuple, rowmap: tuple, layer: int, dtype: str, bias: bool) -> tuple:
    """A call's dims (the row count and the layer move them) and launch arguments, its shapes checked."""
    _check(bx, tails, w, rowmap, layer)
    launch = _geometry(bx[0], w[0], w[1], dtype, bias)
    return kept_array([bx[0], w[0], tails[1], layer], np.int32), dict(
        template=list(launch.template), grid=launch.grid, threadgroup=launch.threadgroup,
        output_shapes=list(launch.output_shapes), output_dtypes=list(launch.output_dtypes))


def _kernel_call(bx, tails, layer: int, spans, rowmap, w, bias=None) -> tuple[list, dict]:
    """The kernels' inputs in NAMES order and their launch arguments, as a forward and the contract's cases pass
    them; `spans` is the mlx path's (the kernels read the rowmap)."""
    dims, launch = _prepared(tuple(bx.shape), tuple(tails.shape), tuple(w.shape), tuple(rowmap.shape), layer,
                             str(bx.dtype).removeprefix("mlx.core."), bias is not None)
    return [bx, tails, rowmap, w, w if bias is None else bias, dims], launch  # no bias: never read (HAS_BIAS)


_BUILT: dict = {}  # kind -> the kernel, built once (MLX instantiates it for each dtype, L and bias it is called with)


def _source_streams_conv(kind: str, bx, tails, layer: int, spans, rowmap, w, bias=None):
    import mlx.core as mx

    inputs, launch = _kernel_call(bx, tails, layer, spans, rowmap, w, bias)
    if bx.shape[0] == 0:
        return tuple(mx.zeros(s, d) for s, d in zip(launch["output_shapes"], launch["output_dtypes"]))
    kernel = _BUILT.get(kind)
    if kernel is None:
        body = CUDA if kind == "cuda" else METAL
        name = f"tf_lfm2_streams_conv_{hashlib.sha1(served_text(body).encode()).hexdigest()[:12]}"  # MLX caches by name
        kernel = _BUILT[kind] = build_kernel(kind, name, NAMES, OUTPUTS, body)
    y, states = kernel(inputs=inputs, **launch)
    return y, states


def cuda_streams_conv(*args, **kwargs):
    return _source_streams_conv("cuda", *args, **kwargs)


def metal_streams_conv(*args, **kwargs):
    """The metal kernel, the same arithmetic as cuda's (never run here: no Apple machine)."""
    return _source_streams_conv("metal", *args, **kwargs)


# What a forward calls, by implementation kind: fn(bx, tails, layer, spans, rowmap, w, bias) -> (y, states) for the
# packed gated rows bx [rows, C] of every stream, their committed tails [streams, layers, L-1, C], each stream's
# (start, rows) and the rowmap of those spans; y [rows, C] in bx's dtype, states [rows, L-1, C]
STREAMS_CONV = {"mlx": mlx_streams_conv, "cuda": cuda_streams_conv, "metal": metal_streams_conv}


# --- the record ------------------------------------------------------------------------------------------------------


def _counts(rows: int, streams: int, idle: int | None) -> list[int]:
    """Rows of each stream: split over those but `idle`, the first ones one more."""
    live = [s for s in range(streams) if s != idle]
    share = {s: rows // len(live) + (k < rows % len(live)) for k, s in enumerate(live)}
    return [share.get(s, 0) for s in range(streams)]


def make(dims, rows, rng):
    """`streams` streams sharing `rows` rows, each after a tail of its own; `tails` holds for each row the tail before
    it (the state keep() leaves after its stream's rows before), so a one-row call of any row starts where it does in
    the window; `slot` names each row's stream (a dims' `idle` stream gets no rows)."""
    C, L, dtype = dims["channels"], dims["L"], dims["dtype"]
    bx = rounded(rng.standard_normal((rows, C)), dtype)
    tails = np.zeros((rows, L - 1, C), np.float32)
    slot = np.zeros(rows, np.int32)
    start = 0
    for s, n in enumerate(_counts(rows, dims["streams"], dims.get("idle"))):
        seq = np.concatenate([rounded(rng.standard_normal((L - 1, C)), dtype), bx[start:start + n]])
        for i in range(n):
            tails[start + i] = seq[i:i + L - 1]
        slot[start:start + n] = s
        start += n
    out = {"bx": bx, "tails": tails, "slot": slot, "w": rounded(0.5 * rng.standard_normal((C, L)), dtype)}
    if dims["bias"]:
        out["bias"] = rounded(0.1 * rng.standard_normal(C), dtype)
    return out


def _spans(case) -> tuple[tuple[int, int], ...]:
    """(start, rows) of each stream of a call, from its rows' slots (a stream's rows are consecutive, so a prefix or
    one row of a case is a call of its own); (0, 0) for a stream with none."""
    slot = case["slot"]
    spans = []
    for s in range(case.dims["streams"]):
        rows = np.flatnonzero(slot == s)
        spans.append((int(rows[0]), len(rows)) if len(rows) else (0, 0))
    return tuple(spans)


def _call(case):
    """The arguments a forward passes: the packed rows, every stream's tails stacked (the layer read holds each
    stream's first row's tail, the other and a stream without rows NaN), the layer, spans, rowmap, weights."""
    import mlx.core as mx

    d = case.dims
    dt = mx_dtype(d["dtype"])
    spans = _spans(case)
    tails = np.full((d["streams"], LAYERS, d["L"] - 1, d["channels"]), np.nan, np.float32)
    for s, (start, n) in enumerate(spans):
        if n:
            tails[s, LAYERS - 1] = case["tails"][start]
    return (case.array("bx", dt), mx.array(tails).astype(dt), LAYERS - 1, spans, rowmap(spans), case.array("w", dt),
            case.array("bias", dt) if d["bias"] else None)


def reference(case):
    """The conv in float64 on the host, each row over its own tail and itself; its state the last L-1 of those."""
    seq = np.concatenate([case["tails"], case["bx"][:, None]], axis=1).astype(np.float64)  # [rows, L, C]
    w = case["w"].astype(np.float64)
    y = np.zeros((case.rows, case.dims["channels"]))
    for j in range(case.dims["L"]):
        y += w[:, j] * seq[:, j]
    if case.dims["bias"]:
        y += case["bias"].astype(np.float64)
    return {"y": y, "states": seq[:, 1:]}


def composed(fn=mlx_streams_conv):
    return lambda case: dict(zip(OUTPUTS, fn(*_call(case))))


def first_tail_for_all(bx, tails, layer, spans, rowmap, w, bias=None):
    """Planted: every row reads the first stream's tail."""
    import mlx.core as mx

    return mlx_streams_conv(bx, mx.broadcast_to(tails[:1], tails.shape), layer, spans, rowmap, w, bias)


def _taps(order):
    """A planted served call: each stream's taps summed in fp32 in `order(rows, L)` (the call's rows), then the bias."""
    import mlx.core as mx

    def fn(bx, tails, layer, spans, rowmap, w, bias=None):
        wf, ys, states = w.astype(mx.float32), [], []
        for n, seq in _windows(bx, tails, layer, spans):
            x, acc = seq.astype(mx.float32), None
            for j in order(bx.shape[0], w.shape[1]):
                term = wf[:, j] * x[j:j + n]
                acc = term if acc is None else acc + term
            ys.append((acc + bias.astype(mx.float32) if bias is not None else acc).astype(bx.dtype))
            states.append(_states(seq, n))
        return _joined(bx, w, ys, states)

    return fn


dropped_last_tap = _taps(lambda rows, L: range(L - 1))  # planted: the row's own B·x (tap L-1) never read
# planted: the taps summed newest first when the call has more than one row (oldest first otherwise)
order_when_many = _taps(lambda rows, L: range(L - 1, -1, -1) if rows > 1 else range(L))


def _single_stream(kind: str):
    """The stream conv record's `kind` implementation on each stream's window alone, after its own tail: the claim
    that the packed launch gives every row the bits the single-stream call does."""
    from tensorfold_contract.serving import ServedCall, call

    def claim(case):
        bx, tails, layer, spans, _, w, bias = _call(case)
        ys, states = [], []
        for s, (start, n) in enumerate(spans):
            if n:
                arrays = {"tails": tails[s, layer], "bx": bx[start:start + n], "w": w,
                          **({"bias": bias} if bias is not None else {})}
                out = call(kind, conv.RECORD.implementations[kind], ServedCall(n, case.dims, arrays))
                ys.append(out["y"])
                states.append(out["states"])
        y, st = _joined(bx, w, ys, states)
        return {"y": y, "states": st}

    claim.__name__ = f"the stream conv record's {kind} per stream"
    return claim


def source(kind: str) -> Source:
    return Source("lfm2_streams_conv", NAMES, OUTPUTS, CUDA if kind == "cuda" else METAL,
                  inputs=lambda case: _kernel_call(*_call(case))[0],
                  launch=lambda case: _geometry(case.rows, case.dims["channels"], case.dims["L"], case.dims["dtype"],
                                                bool(case.dims["bias"])))


def _shape(label, C, streams, L=3, dtype="bfloat16", rows=WIDEST, bias=False, **more):
    return Shape(label, {"channels": C, "L": L, "dtype": dtype, "bias": bias, "streams": streams, **more}, rows)


SERVED = tuple(_shape(f"{name} {dtype}, {streams} streams", dims["hidden"], streams, dims["conv_L"], dtype)
               for name, dims in (("tiny-lfm2", TINY_LFM2), ("LFM2-1.2B", LFM2_1B)) for dtype in DTYPES
               for streams in (8, 3))

RECORD = KernelRecord(
    name="lfm2 streams conv",
    family="lfm2",
    description="the stream conv record for several streams' packed rows in one call: y[r] = sum_j w[:, j] * "
                "[tail; bx][i + j] (+ bias) over row r's own stream's tail and window (i its index there), with the "
                "state keep(i + 1) commits",
    make=make,
    reference=reference,
    implementations={"mlx": composed(), "cuda": source("cuda"), "metal": source("metal")},
    shapes=SERVED,
    edges=(
        _shape("1 row", TINY_LFM2["hidden"], 2, rows=1),
        _shape("8 streams of 2 rows, fp32", TINY_LFM2["hidden"], 8, dtype="float32", rows=16),
        _shape("a stream with no rows between two", TINY_LFM2["hidden"], 3, rows=9, idle=1),
        _shape("C=100, off the group", 100, 3, dtype="float32", rows=5),
        _shape("L=2, bias", 64, 3, L=2, dtype="float32", rows=7, bias=True),
        _shape("L=4, bias bf16", 96, 2, L=4, rows=9, bias=True),
        _shape("empty", TINY_LFM2["hidden"], 2, rows=0),
    ),
    tolerance=conv.tolerance,
    row_inputs=("bx", "tails", "slot"),
    bit_equal_to={kind: _single_stream(kind) for kind in ("mlx", "cuda", "metal")},
    controls=(
        Control("every row on the first stream's tail", "mlx", 2, variant(composed(first_tail_for_all))),
        Control("dropped last tap", "mlx", 2, variant(composed(dropped_last_tap))),
        Control("row-count-dependent tap order", "mlx", 4, variant(composed(order_when_many))),
        Control("every row on the first stream's tail", "cuda", 2, swap("const int s = rowmap[2 * r];",
                                                                       "const int s = 0;")),
        Control("dropped last tap", "cuda", 2, conv.CUDA_DROPPED_LAST_TAP),
        Control("state one row early", "cuda", 2, swap("const int t = p + 1 + q;", "const int t = p + q;")),
        Control("row-count-dependent tap order", "cuda", 4, conv.CUDA_TAP_ORDER_WHEN_MANY),
        Control("over-sized threadgroup", "cuda", 5, oversize_threadgroup()),
        Control("over-sized threadgroup", "metal", 5, oversize_threadgroup()),
    ),
)
