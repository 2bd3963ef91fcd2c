"""RMSNorm under contract: one row per group, a fixed-order sum of squares, so no row depends on its neighbours."""

from __future__ import annotations

import numpy as np

from tensorfold_contract import (Control, Finding, KernelRecord, Launch, Shape, Source, Tolerance,
                                 oversize_threadgroup, swap, variant)

from tensorfold_contract.helpers import BF16_ULP, EPS32, WIDEST, int_array, mx_dtype, rounded, row_scales

THREADS = 256

CUDA = """
// One block per row. Each thread sums its strided squares in order; warps fold with a fixed xor tree; warp
// partials are added in warp order by every thread: the row's result never depends on the row count.
const int rows = dims[0];
const int d = dims[1];
const int row = blockIdx.x;
if (row >= rows) return;
const T* xr = x + (size_t)row * d;
float ss = 0.0f;
for (int i = threadIdx.x; i < d; i += blockDim.x) {
  const float v = static_cast<float>(xr[i]);
  ss = fmaf(v, v, ss);
}
for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
__shared__ float part[32];
if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
__syncthreads();
const int warps = blockDim.x >> 5;
float total = 0.0f;
for (int k = 0; k < warps; ++k) total += part[k];
const float inv = rsqrtf(total / (float)d + eps[0]);
for (int i = threadIdx.x; i < d; i += blockDim.x) {
  out[(size_t)row * d + i] = static_cast<T>(static_cast<float>(xr[i]) * inv * static_cast<float>(w[i]));
}
"""

METAL = """
// One threadgroup per row; the same fixed order as the CUDA source (strided squares, xor tree, warp order).
const int rows = dims[0];
const int d = dims[1];
const uint row = threadgroup_position_in_grid.x;
const uint tid = thread_position_in_threadgroup.x;
const uint n = threads_per_threadgroup.x;
threadgroup float part[32];
if ((int)row >= rows) return;
float ss = 0.0f;
for (uint i = tid; i < (uint)d; i += n) {
  const float v = static_cast<float>(x[row * d + i]);
  ss = metal::fma(v, v, ss);
}
for (ushort o = 16; o > 0; o >>= 1) ss += simd_shuffle_xor(ss, o);
if (thread_index_in_simdgroup == 0) part[simdgroup_index_in_threadgroup] = ss;
threadgroup_barrier(mem_flags::mem_threadgroup);
float total = 0.0f;
for (uint k = 0; k < n / 32; ++k) total += part[k];
const float inv = metal::rsqrt(total / (float)d + eps[0]);
for (uint i = tid; i < (uint)d; i += n) {
  out[row * d + i] = static_cast<T>(static_cast<float>(x[row * d + i]) * inv * static_cast<float>(w[i]));
}
"""


def make(dims, rows, rng):
    d, dtype = dims["d"], dims["dtype"]
    x = rng.standard_normal((rows, d)).astype(np.float32) * row_scales(rng, rows)
    w = 1.0 + 0.1 * rng.standard_normal(d).astype(np.float32)
    return {"x": rounded(x, dtype), "w": rounded(w, dtype), "eps": np.array([dims["eps"]], np.float32)}


def reference(case):
    x, w = case["x"].astype(np.float64), case["w"].astype(np.float64)
    eps = float(case["eps"][0])  # the kernels add eps in float32; the same float32 value here
    return {"out": x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w}


def tolerance(dims):
    # fp32: a sum of d squares drifts about as sqrt(d); bf16 outputs are rounded up to twice (MLX's own kernel)
    rtol = 64 * EPS32 + 4 * EPS32 * np.sqrt(dims["d"]) + (2 * BF16_ULP if dims["dtype"] == "bfloat16" else 0.0)
    return Tolerance(rtol=rtol)


def mlx_rmsnorm(case):
    import mlx.core as mx

    dt = mx_dtype(case.dims["dtype"])
    return {"out": mx.fast.rms_norm(case.array("x", dt), case.array("w", dt), float(case["eps"][0]))}


def _inputs(case):
    dt = mx_dtype(case.dims["dtype"])
    return [case.array("x", dt), case.array("w", dt), case.array("eps"), int_array([case.rows, case.dims["d"]])]


def _launch(case):
    return Launch(grid=(case.rows * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
                  output_shapes=((case.rows, case.dims["d"]),), output_dtypes=(mx_dtype(case.dims["dtype"]),),
                  template=(("T", mx_dtype(case.dims["dtype"])),), static_shared=32 * 4)


def source(kind: str) -> Source:
    return Source("rmsnorm", ("x", "w", "eps", "dims"), ("out",), CUDA if kind == "cuda" else METAL,
                  inputs=_inputs, launch=_launch)


def fp16_sum_of_squares(case):
    """Planted: the sum of squares kept in fp16 (32 partial sums added in fp16)."""
    import mlx.core as mx

    x = case.array("x").astype(mx.float32)
    d = x.shape[-1]
    acc = mx.zeros((x.shape[0], 1), mx.float16)
    step = max(1, d // 32)
    for start in range(0, d, step):
        part = x[:, start:start + step]
        acc = acc + mx.sum(part * part, axis=-1, keepdims=True).astype(mx.float16)
    inv = mx.rsqrt(acc.astype(mx.float32) / d + float(case["eps"][0]))
    return {"out": (x * inv * case.array("w").astype(mx.float32)).astype(mx_dtype(case.dims["dtype"]))}


def neighbour_rms(case):
    """Planted: each row normalised by the next row's rms (off by one row)."""
    import mlx.core as mx

    x = case.array("x").astype(mx.float32)
    ms = mx.mean(x * x, axis=-1, keepdims=True)
    if x.shape[0] > 1:
        ms = mx.concatenate([ms[1:], ms[-1:]])
    out = x * mx.rsqrt(ms + float(case["eps"][0])) * case.array("w").astype(mx.float32)
    return {"out": out.astype(mx_dtype(case.dims["dtype"]))}


def split_when_many(case):
    """Planted: a different reduction when more than one row shares the call."""
    import mlx.core as mx

    if case.rows <= 1:
        return mlx_rmsnorm(case)
    x = case.array("x").astype(mx.float32)
    half = x.shape[-1] // 2
    ss = mx.sum(x[:, half:] ** 2, axis=-1, keepdims=True) + mx.sum(x[:, :half] ** 2, axis=-1, keepdims=True)
    out = x * mx.rsqrt(ss / x.shape[-1] + float(case["eps"][0])) * case.array("w").astype(mx.float32)
    return {"out": out.astype(mx_dtype(case.dims["dtype"]))}


# Seen on the H200 (contract/receipts/h200-2026-11-30/c_rmsnorm): MLX raises at eval on the empty call, where the
# cuda implementation (which launches nothing there) passes; most likely MLX adds a zero-block launch to its graph.
EMPTY_ON_CUDA = Finding("MLX 0.32.4's CUDA mx.fast.rms_norm on zero rows fails with cudaGraphAddKernelNode(...) "
                        "invalid argument: an MLX bug, not ours; the cuda implementation handles the empty call",
                        kind="mlx", gate=3, backend="cuda", case="empty", symptom="cudaGraphAddKernelNode",
                        mlx="0.32.4")


def shape(label: str, d: int, dtype: str = "float32", rows: int = WIDEST, eps: float = 1e-5) -> Shape:
    """A norm of width `d` over `rows` rows of `dtype` activations."""
    return Shape(label, {"d": d, "dtype": dtype, "eps": eps}, rows)


def record(family: str, shapes: tuple[Shape, ...]) -> KernelRecord:
    """`family`'s RMSNorm record, proven at the shapes it serves."""
    return KernelRecord(
        name=f"{family} rmsnorm",
        family=family,
        description="y = x / sqrt(mean(x^2) + eps) * w, per row; fp32 sums, output in the activation dtype",
        make=make,
        reference=reference,
        implementations={"mlx": mlx_rmsnorm, "cuda": source("cuda"), "metal": source("metal")},
        shapes=shapes,
        edges=(
            shape("1 row", 256, rows=1),
            shape("widest window", 4096, rows=WIDEST),
            shape("d=100, off the warp", 100, rows=5),
            shape("d=5000, past one pass of the group", 5000, rows=3),
            shape("d=1", 1, rows=2),
            shape("empty", 256, rows=0),
        ),
        tolerance=tolerance,
        row_inputs=("x",),
        findings=(EMPTY_ON_CUDA,),
        controls=(
            Control("fp16 accumulator", "mlx", 2, variant(fp16_sum_of_squares)),
            Control("off-by-one row", "mlx", 2, variant(neighbour_rms)),
            Control("row-count-dependent reduction order", "mlx", 4, variant(split_when_many)),
            Control("dropped tail element", "cuda", 2, swap("for (int i = threadIdx.x; i < d; i += blockDim.x) {\n  "
                                                            "const float v", "for (int i = threadIdx.x; i < d - 1; "
                                                            "i += blockDim.x) {\n  const float v")),
            Control("row-count-dependent reduction order", "cuda", 4, swap(
                "for (int k = 0; k < warps; ++k) total += part[k];",
                "if (rows > 1) { for (int k = warps - 1; k >= 0; --k) total += part[k]; } "
                "else { for (int k = 0; k < warps; ++k) total += part[k]; }")),
            Control("over-sized threadgroup", "cuda", 5, oversize_threadgroup()),
            Control("row-count-dependent reduction order", "metal", 4, swap(
                "for (uint k = 0; k < n / 32; ++k) total += part[k];",
                "if (rows > 1) { for (int k = (int)(n / 32) - 1; k >= 0; --k) total += part[k]; } "
                "else { for (uint k = 0; k < n / 32; ++k) total += part[k]; }")),
            Control("over-sized threadgroup", "metal", 5, oversize_threadgroup()),
        ),
    )
