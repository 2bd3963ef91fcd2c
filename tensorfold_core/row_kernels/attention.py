"""Window attention under contract: fixed key splits at absolute positions, so a row's result depends on p alone."""

from __future__ import annotations

import functools
import hashlib
import os

import numpy as np

from tensorfold_contract import Control, Finding, KernelRecord, Launch, Shape, Source, Tolerance, \
    oversize_threadgroup, swap, variant

from .attention_sources import CUDA, METAL
from tensorfold_contract.helpers import EPS32, WIDEST, kept_array, mx_dtype, rounded
from tensorfold_contract.kernel_text import build as build_kernel

SPLIT = 256  # keys a split: split s holds the absolute positions s*SPLIT .. s*SPLIT+SPLIT-1, whatever the call
# splits a block runs side by side (cuda, metal): a long context's splits no longer queue one by one; two, since
# loading every key before its first use holds 70-80 registers a thread on sm_90, too many for 1,024 threads
GROUPS = 2
THREADS = GROUPS * SPLIT  # one thread a key of each split a block runs
# "KC,VC": the CUDA body's 16-byte key loads and value loads a thread issues together (a measurement: bits never move)
CHUNKS_ENV = "TENSORFOLD_ATTENTION_CHUNKS"
STALE = 37  # keys the test cache holds past a window's last row: NaN, so a kernel that reads one fails
VMAX = 2.0  # |v| <= VMAX in the drawn inputs; the tolerance is in units of it
QSPREAD = 1.0  # q rows scaled by 10^(-QSPREAD..QSPREAD): flat and one-hot softmaxes alike
NAMES = ("q", "k", "v", "scale", "dims")


def check(q, k, v, offset: int, window: int | None) -> tuple[int, int, int, int, int]:
    """(rows, heads, head_dim, kv_heads, capacity) of a call; a shape no kernel here serves is refused, with why."""
    if q.ndim != 3:
        raise ValueError(f"window attention takes q as [rows, heads, head_dim], got shape {tuple(q.shape)}")
    rows, heads, dim = q.shape
    ks, vs = tuple(k.shape), tuple(v.shape)  # shapes only: a forward calls this once a layer, so it makes no array
    if len(ks) == 4 and ks[0] == 1 and vs[:1] == (1,):  # the llama KVCache's [1, kv_heads, capacity, head_dim]
        ks, vs = ks[1:], vs[1:]
    if len(ks) != 3 or ks != vs or ks[2] != dim:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be [kv_heads, capacity, {dim}]")
    kv_heads, capacity = ks[0], ks[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} heads are not a multiple of {kv_heads} kv heads")
    if dim % 32 or SPLIT % dim:
        raise ValueError(f"head_dim {dim}: the kernels take 32, 64, 128 or 256")
    if offset < 0 or offset + rows > capacity:
        raise ValueError(f"rows at positions {offset}..{offset + rows - 1} do not fit a cache of {capacity} keys")
    if window is not None and window < 1:
        raise ValueError(f"a sliding window of {window} keys: it must hold at least the row's own key")
    return rows, heads, dim, kv_heads, capacity


def mlx_window_attention(q, k, v, offset: int, scale: float, window: int | None = None) -> "mx.array":
    """Composed ops in the kernels' split order: each row's state moves only on the splits that hold its keys."""
    return _attend(q, k, v, offset, scale, window)


def _attend(q, k, v, offset: int, scale: float, window: int | None, *, split: int = SPLIT, origin: int = 0,
            reverse: bool = False, reach: int = 0, acc=None):
    """mlx_window_attention, with the knobs the planted defects turn (served: none of them)."""
    import mlx.core as mx

    rows, heads, dim, kv_heads, capacity = check(q, k, v, offset, window)
    if rows == 0:
        return mx.zeros((0, heads, dim), mx.float32)
    k, v = k.reshape(kv_heads, capacity, dim), v.reshape(kv_heads, capacity, dim)
    g, last = heads // kv_heads, offset + rows - 1
    pos = mx.arange(offset, offset + rows)[:, None]
    lo = mx.maximum(pos - window + 1, 0) if window else mx.zeros_like(pos)
    # rows ride the batch axes (row, kv head) of both products, so a row's dot products never share a GEMM's M
    # with another row's; every reduction has a fixed length (head_dim or the split)
    qs = (q.astype(mx.float32) * mx.array(scale, mx.float32)).reshape(rows, kv_heads, g, dim)
    m_run = mx.full((rows, kv_heads, g, 1), -mx.inf)
    l_run = mx.zeros((rows, kv_heads, g, 1), mx.float32)
    o_run = mx.zeros((rows, kv_heads, g, dim), mx.float32)
    first = max(0, offset - window + 1) if window else 0
    splits = range((first - origin) // split, (last - origin) // split + 1)
    for s in reversed(splits) if reverse else splits:
        start = origin + s * split
        # keys past the window's last row are never read (they may be stale): the split is padded with zeros
        ks, vs = (_window_of(a, start, min(start + split, last + 1), split) for a in (k, v))
        keys = mx.arange(start, start + split)[None]
        inside = ((keys <= pos + reach) & (keys >= lo))[:, None, None, :]
        active = ((start <= pos) & (start + split > lo))[:, :, None, None]
        scores = mx.where(inside, qs @ ks.transpose(0, 2, 1), -mx.inf)
        m = mx.where(active, scores.max(axis=-1, keepdims=True), 0.0)  # 0 where the split holds none of the row's
        e = mx.exp(scores - m)
        values = e @ vs if acc is None else (e.astype(mx_dtype(acc)) @ vs.astype(mx_dtype(acc))).astype(mx.float32)
        m_new = mx.maximum(m_run, m)
        alpha, beta = mx.exp(m_run - m_new), mx.exp(m - m_new)
        l_run = mx.where(active, l_run * alpha + e.sum(axis=-1, keepdims=True) * beta, l_run)
        o_run = mx.where(active, o_run * alpha + values * beta, o_run)
        m_run = mx.where(active, m_new, m_run)
    return (o_run / l_run).reshape(rows, heads, dim)


def _window_of(a, start: int, stop: int, split: int):
    """Keys start..stop-1 of a [kv, capacity, d] cache in float32, zero-padded on either side to `split` keys."""
    import mlx.core as mx

    part = a[:, max(start, 0):stop].astype(mx.float32)
    before, after = max(0, -start), split - (stop - start)
    pads = [mx.zeros((a.shape[0], n, a.shape[2]), mx.float32) for n in (before, after)]
    return mx.concatenate([pads[0], part, pads[1]], axis=1) if before or after else part


def chunks() -> tuple[tuple[str, int], ...]:
    """The CUDA body's KC and VC: loads in flight, not sums, so any choice gives the same bits."""
    kc, vc = (int(v) for v in os.environ.get(CHUNKS_ENV, "8,16").split(","))
    return ("KC", kc), ("VC", vc)


@functools.lru_cache(maxsize=1024)
def _geometry(rows: int, heads: int, dim: int, groups: int = GROUPS, out=None) -> Launch:
    """One block of `groups` x SPLIT threads per (row, head): grid in threads, x the head, y the row. The groups only
    run splits side by side (they are folded in split order whatever their number), so they never move a bit. `out`:
    the output dtype (float32 by default), the fp32 result rounded once to it."""
    import mlx.core as mx

    threads = groups * SPLIT
    return Launch(grid=(heads * threads if rows else 0, rows, 1), threadgroup=(threads, 1, 1),
                  output_shapes=((rows, heads, dim),), output_dtypes=(out or mx.float32,),
                  template=(("D", dim), ("SPLIT", SPLIT), ("GROUPS", groups), *chunks()),
                  # wmax, wsum, ew, part, smax, ssum and sval, each one a group, and the scaled query row
                  static_shared=4 * (groups * (2 * (SPLIT // 32) + 2 * SPLIT + 2 + dim) + dim))


def _kernel_inputs(q, k, v, offset: int, scale: float, window: int | None) -> list:
    import mlx.core as mx

    rows, heads, _, kv_heads, capacity = check(q, k, v, offset, window)
    k, v = (a.reshape(kv_heads, capacity, -1) for a in (k, v))
    dims = mx.array([rows, heads, kv_heads, capacity, offset, window or 0], mx.int32)  # the offset moves each call
    return [q, k, v, _scale(scale), dims]


@functools.lru_cache(maxsize=64)
def _scale(scale: float):
    return kept_array([scale], np.float32)


_BUILT: dict = {}


def _source_attention(kind: str, q, k, v, offset: int, scale: float, window: int | None):
    import mlx.core as mx

    rows, heads, dim, kv_heads, capacity = check(q, k, v, offset, window)
    if rows == 0:
        return mx.zeros((0, heads, dim), mx.float32)
    kernel = _BUILT.get(kind)
    if kernel is None:
        body = CUDA if kind == "cuda" else METAL
        # named by its text: MLX caches compiled kernels by name, in memory and on disk
        name = f"tf_window_attention_{hashlib.sha1(body.encode()).hexdigest()[:12]}"
        kernel = _BUILT[kind] = build_kernel(kind, name, NAMES, ["out"], body)
    # the cache's [1, kv_heads, capacity, head_dim] buffer goes in as it is: the same memory as _kernel_inputs'
    # [kv_heads, capacity, head_dim], with no reshape to build on every layer's call
    dims = _dims(rows, heads, kv_heads, capacity, offset, window or 0)
    (out,) = kernel(inputs=[q, k, v, _scale(scale), dims], **_launch_arguments(rows, heads, dim))
    return out


@functools.lru_cache(maxsize=256)
def _dims(*values: int):
    """The dims a call reads, made once for all the layers of a forward (the offset moves each token)."""
    import mlx.core as mx

    return mx.array(values, mx.int32)


@functools.lru_cache(maxsize=1024)
def _launch_arguments(rows: int, heads: int, dim: int) -> dict:
    launch = _geometry(rows, heads, dim)
    return dict(template=list(launch.template), grid=launch.grid, threadgroup=launch.threadgroup,
                output_shapes=list(launch.output_shapes), output_dtypes=list(launch.output_dtypes))


def cuda_window_attention(q, k, v, offset: int, scale: float, window: int | None = None) -> "mx.array":
    """The cuda kernel; pass the cache's whole buffer (a [..., :end, :] slice is copied to be made contiguous)."""
    return _source_attention("cuda", q, k, v, offset, scale, window)


def metal_window_attention(q, k, v, offset: int, scale: float, window: int | None = None) -> "mx.array":
    """The metal kernel, the same algorithm as cuda's (never run here: no Apple machine)."""
    return _source_attention("metal", q, k, v, offset, scale, window)


# What a forward calls, by implementation kind: out[r] = softmax(scale q[r] k[lo..p]^T) v[lo..p], p = offset + r,
# float32 [rows, heads, head_dim] for q of any float dtype and a cache [kv_heads or 1 x kv_heads, capacity, head_dim].
WINDOW_ATTENTION = {"mlx": mlx_window_attention, "cuda": cuda_window_attention, "metal": metal_window_attention}


def make(dims, rows, rng):
    """A window of `rows` rows whose last sits at position keys - 1, over a cache holding STALE keys past it."""
    h, kv, d = dims["heads"], dims["kv_heads"], dims["head_dim"]
    offset = max(0, dims["keys"] - max(rows, 1))  # a call wider than the shape's keys starts at 0 (nvcc's builds)
    keys = offset + max(rows, 1)
    spread = 10.0 ** rng.uniform(-QSPREAD, QSPREAD, size=(rows, h, 1))
    q = rounded(rng.standard_normal((rows, h, d)) * spread, dims["dtype"])
    k = rounded(rng.standard_normal((kv, keys + STALE, d)), dims["dtype"])
    v = rounded(rng.uniform(-VMAX, VMAX, (kv, keys + STALE, d)), dims["dtype"])
    k[:, keys:], v[:, keys:] = np.nan, np.nan
    return {"q": q, "k": k, "v": v, "pos": np.arange(offset, offset + rows, dtype=np.int32),
            "scale": np.array([d ** -0.5], np.float32)}


def reference(case):
    """Softmax attention in float64 on the host, each row over keys lo..p of its position p."""
    q, k, v = (case[n].astype(np.float64) for n in ("q", "k", "v"))
    rows, h, d = q.shape
    kv, window, scale = k.shape[0], case.dims.get("window", 0), float(case["scale"][0])
    out = np.zeros((rows, h, d))
    for r, p in enumerate(int(p) for p in case["pos"]):
        lo = max(0, p - window + 1) if window else 0
        s = np.einsum("kgd,knd->kgn", q[r].reshape(kv, h // kv, d), k[:, lo:p + 1]) * scale
        w = np.exp(s - s.max(axis=-1, keepdims=True))
        out[r] = (np.einsum("kgn,knd->kgd", w, v[:, lo:p + 1]) / w.sum(axis=-1)[..., None]).reshape(h, d)
    return {"out": out}


def tolerance(dims):
    # in units of VMAX (an output can average out to ~0, so no relative bound): fp32 scores err by about
    # u sqrt(head_dim) times their size (up to ~10^QSPREAD), and each moves its weight by that much; the fp32 sums of
    # exp and of weighted values add about u sqrt(keys)
    return Tolerance(atol=VMAX * EPS32 * (32 + 2 * np.sqrt(dims["head_dim"]) * 10 ** QSPREAD
                                          + 4 * np.sqrt(dims["keys"])))


def _call(case):
    """The call a forward makes: one row sees exactly its p + 1 keys, a wider window the whole buffer past it."""
    dt = mx_dtype(case.dims["dtype"])
    k, v = case.array("k", dt), case.array("v", dt)
    offset = int(case["pos"][0]) if case.rows else case.dims["keys"]
    if case.rows == 1:
        # gate 4 holds each row of a k-row call (cache of keys + STALE) to this call: the cache's length never counts
        k, v = k[:, :offset + 1], v[:, :offset + 1]
    return case.array("q", dt), k, v, offset, float(case["scale"][0]), case.dims.get("window") or None


def composed(**knobs):
    """The mlx implementation on a case; a planted defect turns one of _attend's knobs."""
    return lambda case: {"out": _attend(*_call(case), **knobs)}


def source(kind: str) -> Source:
    return Source("window_attention", NAMES, ("out",), CUDA if kind == "cuda" else METAL,
                  inputs=lambda case: _kernel_inputs(*_call(case)),
                  launch=lambda case: _geometry(case.rows, case.dims["heads"], case.dims["head_dim"]))


def split_by_row_count(case):
    """Planted: splits of SPLIT / 2 keys when more than one row shares the call."""
    return {"out": _attend(*_call(case), split=SPLIT if case.rows <= 1 else SPLIT // 2)}


def split_from_cache_end(case):
    """Planted: split boundaries counted back from the cache's end, so they move with its length."""
    q, k, v, offset, scale, window = _call(case)
    return {"out": _attend(q, k, v, offset, scale, window, origin=k.shape[-2] % SPLIT)}


def splits_reversed_when_many(case):
    """Planted: the splits folded last to first when more than one row shares the call."""
    return {"out": _attend(*_call(case), reverse=case.rows > 1)}


# The cuda source's planted defects: edits of its text, each on a line it holds once.
CUDA_DROPPED_LAST_KEY = swap("if (base + t < lo || base + t > p) sc = NEG_INF;",
                             "if (base + t < lo || base + t >= p) sc = NEG_INF;")
CUDA_WARPS_REVERSED_WHEN_MANY = swap(
    "for (int w = 1; w < WARPS; ++w) ls += wsum[g][w];",
    "if (rows > 1) { ls = wsum[g][WARPS - 1]; for (int w = WARPS - 2; w >= 0; --w) ls += wsum[g][w]; }\n"
    "  else { for (int w = 1; w < WARPS; ++w) ls += wsum[g][w]; }")
_VALUE_FMA = "fmaf(ew[g][j - base], vj, acc)"
CUDA_FP16_ACCUMULATOR = swap(f"acc = {_VALUE_FMA};", f"acc = __half2float(__float2half({_VALUE_FMA}));")

NOT_INVARIANT_ON_CUDA = Finding("MLX's matmul is not row-invariant on CUDA (DESIGN §10), and the mlx implementation "
                                "is composed of it: the cuda implementation is the exact one there",
                                kind="mlx", gate=4, backend="cuda")
# Seen on the H200 (contract/receipts/h200-2026-12-01-serving/attention-contract.txt): the composed ops stray
# 0.0007-0.0084 from float64 on every shape, bf16 and fp32 alike, about what TF32-rounded matmul inputs give,
# while the cuda implementation passes the same cases; MLX's CUDA matmul precision was not checked further
LOOSE_ON_CUDA = tuple(Finding("MLX's CUDA matmul is less precise than the record's float32 tolerance (TF32-like), "
                              "and the mlx implementation is composed of it: the cuda implementation serves there",
                              kind="mlx", gate=gate, backend="cuda", symptom=" off by ", mlx="0.32.4")
                      for gate in (2, 3))


def shape(label: str, model: dict, keys: int, dtype: str = "bfloat16", rows: int = WIDEST, window: int = 0,
          heavy: bool = False) -> Shape:
    """`rows` rows ending at position keys - 1 of a model's heads (a dict of heads, kv_heads and head_dim)."""
    dims = {"heads": model["heads"], "kv_heads": model["kv_heads"], "head_dim": model["head_dim"], "keys": keys,
            "window": window, "dtype": dtype}
    return Shape(label, dims, rows, heavy)


SMALL = dict(heads=8, kv_heads=2, head_dim=32)  # the edges' heads: few and narrow, so the CPU runs them quickly
WIDE = dict(heads=32, kv_heads=8, head_dim=128)


def record(family: str, shapes: tuple[Shape, ...]) -> KernelRecord:
    """`family`'s window attention record, proven at the shapes it serves."""
    return KernelRecord(
        name=f"{family} window attention",
        family=family,
        description=f"out[r] = softmax(scale q[r] k[lo..p]^T) v[lo..p] at p = offset + r, GQA, fixed splits of {SPLIT} "
                    "keys at absolute positions folded in order; fp32 output",
        make=make,
        reference=reference,
        implementations={"mlx": composed(), "cuda": source("cuda"), "metal": source("metal")},
        shapes=shapes,
        edges=(
            shape("1 row", SMALL, 700, rows=1),
            shape("p = 0", SMALL, 1, rows=1),
            shape("16 rows from p = 0", SMALL, 16, "float32"),
            shape("window across a split boundary (254..269)", SMALL, 270),
            shape("last row on a split's last key (507..511)", SMALL, 512, rows=5),
            shape("sliding window of 5 keys under 16 rows", SMALL, 100, window=5),
            shape("head_dim 128, one split and a key", WIDE, 257, rows=3),
            shape("empty", SMALL, 40, rows=0),
        ),
        tolerance=tolerance,
        row_inputs=("q", "pos"),
        findings=(NOT_INVARIANT_ON_CUDA, *LOOSE_ON_CUDA),
        controls=(
            Control("split size by row count", "mlx", 4, variant(split_by_row_count)),
            Control("splits cut from the cache's end", "mlx", 4, variant(split_from_cache_end)),
            Control("splits folded in reverse when many rows", "mlx", 4, variant(splits_reversed_when_many)),
            Control("dropped last key", "mlx", 2, variant(composed(reach=-1))),
            Control("fp16 value accumulator", "mlx", 2, variant(composed(acc="float16"))),
            Control("dropped last key", "cuda", 2, CUDA_DROPPED_LAST_KEY),
            Control("warp sums reversed when many rows", "cuda", 4, CUDA_WARPS_REVERSED_WHEN_MANY),
            Control("fp16 value accumulator", "cuda", 2, CUDA_FP16_ACCUMULATOR),
            Control("over-sized threadgroup", "cuda", 5, oversize_threadgroup()),
            Control("over-sized threadgroup", "metal", 5, oversize_threadgroup()),
        ),
    )
