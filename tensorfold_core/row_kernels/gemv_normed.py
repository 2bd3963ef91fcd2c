"""The bf16 GEMV that reads its rows through an RMSNorm: a layer's input norm and its q|k|v, or its post-attention norm
and gate|up storing swiglu, in one launch where there were two. Each block works out its rows' inverse norms first,
in the rmsnorm record's order (its 256 threads are that record's group), then rounds each normed input to bf16 as it
loads it, exactly as the rmsnorm record stores it: the GEMV then sums the same bf16 inputs in its own fixed chain.

    norm          y = bf16(xn w^T),                                   xn = bf16(x * inv(x) * nw)
    norm swiglu   y = swiglu(bf16(xn w[:N]^T), bf16(xn w[N:]^T))

inv(x) = rsqrt(sum(x^2) / K + eps), each row's own: no row's result depends on its neighbours or on the row count.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tensorfold_contract import Control, KernelRecord, Shape, Source, Tolerance, oversize_threadgroup, swap, variant
from tensorfold_contract.helpers import BF16_ULP, bf16, int_array, row_scales

from .gemv import NOT_INVARIANT_ON_CUDA, OUT, WARPS_REVERSED_WHEN_MANY, WIDEST_CALL, _launch_bf16, template_value
from .gemv import tolerance as gemv_tolerance
from .rmsnorm import THREADS as NORM_THREADS
from .gemv_fused import (CUDA_SWIGLU_HEADER, METAL_SWIGLU_PAIR_HEADER, _launch_swiglu, _text, edges, mlx_for, once,
                         swiglu_host, tolerance_swiglu)
from .gemv_sources import CUDA_BF16, CUDA_BF16_HEADER, METAL_BF16

FUSIONS = ("norm", "norm swiglu")

# 8 normed inputs of row `row` from input k on, each rounded to bf16 as the rmsnorm record rounds its output
CUDA_NORM_HEADER = """
__device__ __forceinline__ uint4 tf_norm8(const __nv_bfloat16* x, const __nv_bfloat16* nw, float inv, int row, int k,
                                         int K, bool vec) {
  const uint4 a = tf_load8(x, row, k, K, vec);
  const uint4 b = tf_load8(nw, 0, k, K, vec);
  uint4 h;
  const __nv_bfloat16* ah = reinterpret_cast<const __nv_bfloat16*>(&a);
  const __nv_bfloat16* bh = reinterpret_cast<const __nv_bfloat16*>(&b);
  __nv_bfloat16* hh = reinterpret_cast<__nv_bfloat16*>(&h);
#pragma unroll
  for (int e = 0; e < 8; ++e) hh[e] = __float2bfloat16(__bfloat162float(ah[e]) * inv * __bfloat162float(bh[e]));
  return h;
}
"""

_NORM_WARPS = f"constexpr int NW = {NORM_THREADS // 32};  // the rmsnorm record's warps, whatever the K split"
_CUDA_EPS = "const int K = dims[2];\nconst float tf_eps = __int_as_float(dims[3]);"  # eps's float32 bits
_CUDA_CB = "constexpr int CB = 16 * MT;  // columns a block"
_CUDA_LOOP = "for (int s0 = warp; s0 < steps; s0 += WARPS * U) {"
# every warp takes a first step, its loads zeros past K and its sums skipped, so that the whole block meets the
# barriers of the norms worked out inside it, while that step's weights are on their way
_CUDA_FIRST = "for (int s0 = warp, tf_first = 1; tf_first || s0 < steps; s0 += WARPS * U) {"
_CUDA_SUMS = "#pragma unroll\n  for (int u = 0; u < U; ++u) {\n    if (s0 + u * WARPS < steps) {"
# the block's rows' inverse norms, in the rmsnorm record's order: thread i of its first NW warps (the record's group,
# whatever the GEMV's K split) sums squares i, i + 256, ... of a row (8 loads at a time; a square of a zero past K
# adds nothing); a warp folds them by a fixed xor tree; the NW warps' sums are added in warp order
_CUDA_INV = """  if (tf_first) {
    tf_first = 0;
    for (int j = 0; warp < NW && j < RB && row0 + j < rows; ++j) {
      const __nv_bfloat16* xr = x + (size_t)(row0 + j) * K;
      float ss = 0.0f;
      for (int i0 = threadIdx.x; i0 < K; i0 += 8 * NW * 32) {
        float v[8];
        if (i0 + 7 * NW * 32 < K) {  // unpredicated, so that the 8 loads go out together
#pragma unroll
          for (int e = 0; e < 8; ++e) v[e] = __bfloat162float(xr[i0 + e * NW * 32]);
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e) v[e] = i0 + e * NW * 32 < K ? __bfloat162float(xr[i0 + e * NW * 32]) : 0.0f;
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) ss = fmaf(v[e], v[e], ss);
      }
      for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
      if (lane == 0) tf_ss[j][warp] = ss;
    }
    __syncthreads();
    if ((int)threadIdx.x < RB && row0 + (int)threadIdx.x < rows) {
      float total = 0.0f;
      for (int p = 0; p < NW; ++p) total += tf_ss[threadIdx.x][p];
      tf_inv[threadIdx.x] = rsqrtf(total / (float)K + tf_eps);
    }
    __syncthreads();
  }
"""
_CUDA_NORMED = "tf_norm8(x, nw, tf_inv[r - row0], r, k, K, vec)"
_CUDA_INV_TOTAL = "tf_inv[threadIdx.x] = rsqrtf(total / (float)K + tf_eps);"

_METAL_PART = "threadgroup float part[WARPS][RB][16];"
_METAL_SHARED = "\n" + _NORM_WARPS + "\nthreadgroup float tf_ss[RB][NW];\nthreadgroup float tf_inv[RB];"
_METAL_STEPS = "const int steps = (K + 31) / 32;"
_METAL_INV = _METAL_STEPS + """
for (int j = 0; warp < NW && j < RB && row0 + j < rows; ++j) {
  float ss = 0.0f;
  for (int i = (int)thread_position_in_threadgroup.x; i < K; i += NW * 32) {
    const float v = static_cast<float>(x[(size_t)(row0 + j) * K + i]);
    ss = metal::fma(v, v, ss);
  }
  for (ushort o = 16; o > 0; o >>= 1) ss += simd_shuffle_xor(ss, o);
  if (lane == 0) tf_ss[j][warp] = ss;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if ((int)thread_position_in_threadgroup.x < RB && row0 + (int)thread_position_in_threadgroup.x < rows) {
  float total = 0.0f;
  for (int p = 0; p < NW; ++p) total += tf_ss[thread_position_in_threadgroup.x][p];
  tf_inv[thread_position_in_threadgroup.x] = metal::rsqrt(total / (float)K + as_type<float>(dims[3]));
}
threadgroup_barrier(mem_flags::mem_threadgroup);"""
_METAL_LOAD = "static_cast<float>(x[(size_t)row * K + k])"
_METAL_NORMED = ("static_cast<float>(static_cast<bfloat16_t>(static_cast<float>(x[(size_t)row * K + k]) * "
                 "tf_inv[row - row0] * static_cast<float>(nw[k])))")


def _normed_text(kind: str, fusion: str) -> str:
    body = CUDA_BF16 if kind == "cuda" else METAL_BF16
    if fusion == "norm swiglu":
        body = _text(body, "swiglu", kind)
    if kind == "cuda":
        body = once(body, "const int K = dims[2];", _CUDA_EPS)
        body = once(body, _CUDA_CB, _CUDA_CB + "\n" + _NORM_WARPS + "\n__shared__ float tf_ss[RB][NW];\n"
                    "__shared__ float tf_inv[RB];")
        body = once(body, _CUDA_LOOP, _CUDA_FIRST)
        body = once(body, _CUDA_SUMS, _CUDA_INV + _CUDA_SUMS)
        return once(body, "tf_load8(x, r, k, K, vec)", _CUDA_NORMED)
    body = once(body, _METAL_PART, _METAL_PART + _METAL_SHARED)
    body = once(body, _METAL_STEPS, _METAL_INV)
    return once(body, _METAL_LOAD, _METAL_NORMED)


def eps_bits(eps: float) -> int:
    """eps's float32 bits as an int32, as it rides in a kernel's dims array."""
    return int(np.array([eps], np.float32).view(np.int32)[0])


def _inputs(case):
    import mlx.core as mx

    # eps rides in the dims array as its float32 bits: on the H200 a kernel that read it from an input of its own (4
    # bytes) took 13 us longer a launch (docs/kernel-contract.md)
    return [case.array("x", mx.bfloat16), case.array("w", mx.bfloat16), case.array("nw", mx.bfloat16),
            int_array([case.rows, case.dims["n"], case.dims["k"], eps_bits(case.dims["eps"])])]


def _launch_for(fusion: str):
    def launch(case):
        base = _launch_swiglu(case) if fusion == "norm swiglu" else _launch_bf16(case)
        rb = 8 * template_value(base, "MAXT")  # tf_ss and tf_inv
        return dataclasses.replace(base, static_shared=base.static_shared + 4 * rb * (NORM_THREADS // 32 + 1))

    return launch


def source(kind: str, fusion: str) -> Source:
    """The cuda or metal implementation: the bf16 GEMV's text (the swiglu store's, for gate|up) reading normed rows."""
    swiglu = fusion == "norm swiglu"
    if kind == "cuda":
        header = (CUDA_SWIGLU_HEADER if swiglu else CUDA_BF16_HEADER) + CUDA_NORM_HEADER
    else:
        header = METAL_SWIGLU_PAIR_HEADER if swiglu else ""
    return Source("gemv16_norm_swiglu" if swiglu else "gemv16_norm", ("x", "w", "nw", "dims"), ("y",),
                  _normed_text(kind, fusion), inputs=_inputs, launch=_launch_for(fusion), header=header)


def make_for(fusion: str):
    def make(dims, rows, rng):
        n, k = dims["n"], dims["k"]
        x = bf16(rng.standard_normal((rows, k)).astype(np.float32) * row_scales(rng, rows))  # rows of every size
        nw = bf16(1.0 + 0.1 * rng.standard_normal(k).astype(np.float32))
        width = 2 * n if fusion == "norm swiglu" else n  # the gate's rows, then the up's
        w = bf16((rng.standard_normal((width, k)) / np.sqrt(k)).astype(np.float32))
        return {"x": x, "w": w, "nw": nw}

    return make


def normed_host(case) -> np.ndarray:
    """Each row through the RMSNorm in float64, rounded to bf16 (the served norm's output dtype)."""
    x, nw = case["x"].astype(np.float64), case["nw"].astype(np.float64)
    eps = float(np.float32(case.dims["eps"]))  # the kernels add eps in float32; the same float32 value here
    xn = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * nw
    return bf16(xn.astype(np.float32)).astype(np.float64)


def reference_for(fusion: str):
    def reference(case):
        y = normed_host(case) @ case["w"].astype(np.float64).T
        if fusion == "norm swiglu":  # the gate and up sums rounded to bf16 (the served output), then swiglu's steps
            return {"y": swiglu_host(bf16(y.astype(np.float32)), case.dims["n"])}
        return {"y": y}

    return reference


def tolerance_for(fusion: str):
    def tolerance(dims):
        # the GEMV's bound (or the swiglu store's), and a normed input that rounds to the bf16 next to the
        # reference's (its fp32 chain beside float64) moves a sum by a part of one spacing of that input
        base = tolerance_swiglu(dims) if fusion == "norm swiglu" else \
            Tolerance(rtol=gemv_tolerance({**dims, "out": OUT}).rtol)
        return Tolerance(rtol=base.rtol + 2 * BF16_ULP)

    return tolerance


def mlx_normed(fusion: str, unit_weight: bool = False):
    """MLX's ops: mx.fast.rms_norm in bf16, then the GEMV (or gate|up and swiglu) as MLX computes it."""
    plain = mlx_for("swiglu" if fusion == "norm swiglu" else "residual", drop_residual=True)

    def normed(case):
        import mlx.core as mx

        from tensorfold_contract.serving import ServedCall

        x, nw = case.array("x", mx.bfloat16), case.array("nw", mx.bfloat16)
        if x.shape[0] == 0:
            return {"y": mx.zeros((0, case.dims["n"]), mx.bfloat16)}
        xn = mx.fast.rms_norm(x, mx.ones_like(nw) if unit_weight else nw, float(case.dims["eps"]))  # no host read
        return plain(ServedCall(case.rows, case.dims, {"x": xn, "w": case.array("w", mx.bfloat16)}))

    return normed


def shape(label: str, n: int, k: int, eps: float, rows: int = WIDEST_CALL, heavy: bool = False) -> Shape:
    """A norm of width k (eps its own) read by a projection of n columns (n per half for gate|up), bf16 out."""
    return Shape(label, {"n": n, "k": k, "eps": eps, "out": OUT}, rows, heavy)


def record(family: str, fusion: str, shapes: tuple[Shape, ...]) -> KernelRecord:
    """`family`'s normed GEMV record (`fusion` one of FUSIONS), bf16 weights, proven at the shapes it serves."""
    assert fusion in FUSIONS, fusion
    swiglu = fusion == "norm swiglu"
    controls = [
        Control("norm weight dropped", "mlx", 2, variant(mlx_normed(fusion, unit_weight=True))),
        Control("each row normed by the next row's norm", "cuda", 2,
                swap(_CUDA_NORMED, "tf_norm8(x, nw, tf_inv[(r - row0 + 1) % RB], r, k, K, vec)")),
        Control("norm weight dropped", "cuda", 2,
                swap("* inv * __bfloat162float(bh[e])", "* inv", where="header")),
        Control("the norm's sum of squares in fp16 when many rows", "cuda", 4, swap(
            _CUDA_INV_TOTAL, "tf_inv[threadIdx.x] = rsqrtf((rows > 1 ? __half2float(__float2half(total)) : total) "
                             "/ (float)K + tf_eps);")),
        Control("warp sums folded in reverse when many rows", "cuda", 4, WARPS_REVERSED_WHEN_MANY),
        Control("over-sized threadgroup", "cuda", 5, oversize_threadgroup()),
        Control("over-sized threadgroup", "metal", 5, oversize_threadgroup()),
    ]
    sizes = [(shape_.label, shape_.dims["n"], shape_.dims["k"], shape_.rows) for shape_ in edges()]
    what = "swiglu(bf16(xn w[:N]^T), bf16(xn w[N:]^T))" if swiglu else "bf16(xn w^T)"
    return KernelRecord(
        name=f"{family} gemv bf16 rmsnorm{' gate|up swiglu' if swiglu else ''}",
        implementations={"mlx": mlx_normed(fusion), "cuda": source("cuda", fusion), "metal": source("metal", fusion)},
        controls=tuple(controls),
        description=f"y = {what}, xn = bf16(x / sqrt(mean(x^2) + eps) * nw): the RMSNorm folded into the bf16 GEMV's "
                    "loads, its sums in the rmsnorm record's order, the GEMV's in its own; each row's result "
                    "independent of the row count",
        family=family, make=make_for(fusion), reference=reference_for(fusion), shapes=shapes,
        edges=tuple(shape(label, n, k, 1e-5, rows) for label, n, k, rows in sizes),
        tolerance=tolerance_for(fusion), row_inputs=("x",), max_rows=WIDEST_CALL, findings=(NOT_INVARIANT_ON_CUDA,))
