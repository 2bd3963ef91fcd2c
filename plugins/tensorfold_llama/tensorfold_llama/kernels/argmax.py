"""Greedy argmax under contract: the first largest logit (ties to the lowest id), NaN never wins and flags its row."""

from __future__ import annotations

import numpy as np

from tensorfold_contract import Control, KernelRecord, Launch, Shape, Source, oversize_threadgroup, swap, variant

from .common import LLAMA_8B, TINY, TINY_DRAFTER, WIDEST, int_array

THREADS = 256
SENTINEL = 0x7FFFFFFF  # no id yet: a row of NaNs only ends at id 0, as on the host

HEADER = """
// (value, id) pairs ordered by value, then by the lower id: the maximum under this order is unique, so no fold
// order can change which id wins.
#define TF_BETTER(v, i, bv, bi) ((v) > (bv) || ((v) == (bv) && (i) < (bi)))
"""

CUDA = """
const int rows = dims[0];
const int V = dims[1];
const int row = blockIdx.x;
if (row >= rows) return;
const float* p = logits + (size_t)row * V;
float best = -__int_as_float(0x7f800000);
int idx = 0x7fffffff;
int hasnan = 0;
for (int i = threadIdx.x; i < V; i += blockDim.x) {
  const float v = p[i];
  if (isnan(v)) { hasnan = 1; continue; }
  if (TF_BETTER(v, i, best, idx)) { best = v; idx = i; }
}
for (int o = 16; o > 0; o >>= 1) {
  const float ob = __shfl_xor_sync(0xffffffffu, best, o);
  const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
  hasnan |= __shfl_xor_sync(0xffffffffu, hasnan, o);
  if (TF_BETTER(ob, oi, best, idx)) { best = ob; idx = oi; }
}
__shared__ float wbest[32];
__shared__ int widx[32];
__shared__ int wnan[32];
const int warp = threadIdx.x >> 5;
if ((threadIdx.x & 31) == 0) { wbest[warp] = best; widx[warp] = idx; wnan[warp] = hasnan; }
__syncthreads();
if (threadIdx.x == 0) {
  for (int k = 1; k < (int)(blockDim.x >> 5); ++k) {
    if (TF_BETTER(wbest[k], widx[k], best, idx)) { best = wbest[k]; idx = widx[k]; }
    hasnan |= wnan[k];
  }
  ids[row] = idx == 0x7fffffff ? 0 : idx;
  flags[row] = hasnan;
}
"""

METAL = """
const int rows = dims[0];
const int V = dims[1];
const int row = (int)threadgroup_position_in_grid.x;
const int tid = (int)thread_position_in_threadgroup.x;
const int n = (int)threads_per_threadgroup.x;
threadgroup float wbest[32];
threadgroup int widx[32];
threadgroup int wnan[32];
if (row >= rows) return;
float best = -INFINITY;
int idx = 0x7fffffff;
int hasnan = 0;
for (int i = tid; i < V; i += n) {
  const float v = logits[(size_t)row * V + i];
  if (metal::isnan(v)) { hasnan = 1; continue; }
  if (TF_BETTER(v, i, best, idx)) { best = v; idx = i; }
}
for (ushort o = 16; o > 0; o >>= 1) {
  const float ob = simd_shuffle_xor(best, o);
  const int oi = simd_shuffle_xor(idx, o);
  hasnan |= simd_shuffle_xor(hasnan, o);
  if (TF_BETTER(ob, oi, best, idx)) { best = ob; idx = oi; }
}
if (thread_index_in_simdgroup == 0) {
  const uint warp = simdgroup_index_in_threadgroup;
  wbest[warp] = best;
  widx[warp] = idx;
  wnan[warp] = hasnan;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (tid == 0) {
  for (int k = 1; k < n / 32; ++k) {
    if (TF_BETTER(wbest[k], widx[k], best, idx)) { best = wbest[k]; idx = widx[k]; }
    hasnan |= wnan[k];
  }
  ids[row] = idx == 0x7fffffff ? 0 : idx;
  flags[row] = hasnan;
}
"""


def make(dims, rows, rng):
    """Random logits with a planted case per row: the largest last, a tie, NaNs, only NaN, only -inf, largest first."""
    v = dims["vocab"]
    x = (3 * rng.standard_normal((rows, v))).astype(np.float32)
    for r in range(rows):
        kind, top = r % 6, float(x[r].max()) + 1.0
        if kind == 0:
            x[r, -1] = top
        elif kind == 1 and v > 1:
            i, j = sorted(rng.choice(v, 2, replace=False))
            x[r, i] = x[r, j] = top
        elif kind == 2:
            x[r, rng.choice(v, max(1, v // 7))] = np.nan
        elif kind == 3:
            x[r] = np.nan
        elif kind == 4:
            x[r] = -np.inf
        else:
            x[r, 0] = top
    return {"logits": x}


def reference(case):
    x = case["logits"].astype(np.float64)
    nan = np.isnan(x)
    return {"ids": np.argmax(np.where(nan, -np.inf, x), axis=-1).astype(np.int64),
            "flags": nan.any(axis=-1).astype(np.int64)}


def _empty(case):
    import mlx.core as mx

    return {"ids": mx.zeros((0,), mx.int32), "flags": mx.zeros((0,), mx.int32)}


def mlx_argmax(case):
    """The engine's own greedy ids (`greedy_ids`, what a greedy round reads), so the contract proves what serves."""
    import mlx.core as mx

    from tensorfold_core.lanes.ahead import greedy_ids

    if case.rows == 0:  # mx.argmax refuses a zero-size reduction
        return _empty(case)
    x = case.array("logits")
    return {"ids": greedy_ids(x).astype(mx.int32), "flags": mx.any(mx.isnan(x), axis=-1).astype(mx.int32)}


def highest_tie(case):
    """Planted: ties go to the highest id."""
    import mlx.core as mx

    x = case.array("logits")
    nan = mx.isnan(x)
    last = x.shape[-1] - 1 - mx.argmax(mx.where(nan, -mx.inf, x)[:, ::-1], axis=-1)
    return {"ids": last.astype(mx.int32), "flags": mx.any(nan, axis=-1).astype(mx.int32)}


def nan_wins(case):
    """Planted: NaN is not set aside (mx.argmax lets it win)."""
    import mlx.core as mx

    x = case.array("logits")
    return {"ids": mx.argmax(x, axis=-1).astype(mx.int32), "flags": mx.any(mx.isnan(x), axis=-1).astype(mx.int32)}


def dropped_tail(case):
    """Planted: the last logit is never looked at."""
    import mlx.core as mx

    x = case.array("logits")
    nan = mx.isnan(x)
    return {"ids": mx.argmax(mx.where(nan, -mx.inf, x)[:, :-1], axis=-1).astype(mx.int32),
            "flags": mx.any(nan, axis=-1).astype(mx.int32)}


def _inputs(case):
    return [case.array("logits"), int_array([case.rows, case.dims["vocab"]])]


def _launch(case):
    import mlx.core as mx

    return Launch(grid=(case.rows * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
                  output_shapes=((case.rows,), (case.rows,)), output_dtypes=(mx.int32, mx.int32),
                  static_shared=3 * 32 * 4)


def source(kind: str) -> Source:
    return Source("argmax", ("logits", "dims"), ("ids", "flags"), CUDA if kind == "cuda" else METAL,
                  inputs=_inputs, launch=_launch, header=HEADER)


def _shape(label, vocab, rows=WIDEST):
    return Shape(label, {"vocab": vocab}, rows)


RECORD = KernelRecord(
    name="llama greedy argmax",
    family="llama",
    description="greedy token per row: first largest logit, ties to the lowest id, NaN never wins and flags the row",
    make=make,
    reference=reference,
    implementations={"mlx": mlx_argmax, "cuda": source("cuda"), "metal": source("metal")},
    shapes=(_shape("tiny vocab", TINY["vocab"]), _shape("tiny drafter vocab", TINY_DRAFTER["vocab"]),
            _shape("llama3 vocab", LLAMA_8B["vocab"])),
    edges=(_shape("1 row", TINY["vocab"], 1), _shape("vocab 1", 1, 4), _shape("vocab 1000, off the group", 1000, 7),
           _shape("vocab 33", 33, 12), _shape("empty", TINY["vocab"], 0)),
    row_inputs=("logits",),
    bit_equal_to={"cuda": "mlx", "metal": "mlx"},
    controls=(
        Control("ties to the highest id", "mlx", 2, variant(highest_tie)),
        Control("NaN wins", "mlx", 2, variant(nan_wins)),
        Control("dropped tail element", "mlx", 2, variant(dropped_tail)),
        Control("ties to the highest id", "cuda", 2, swap("(i) < (bi)", "(i) > (bi)", where="header")),
        Control("NaN rows not flagged", "cuda", 2, swap("hasnan = 1; continue;", "continue;")),
        Control("dropped tail element", "cuda", 2, swap("i < V; i += blockDim.x", "i < V - 1; i += blockDim.x")),
        Control("over-sized threadgroup", "cuda", 5, oversize_threadgroup()),
        Control("over-sized threadgroup", "metal", 5, oversize_threadgroup()),
    ),
)
