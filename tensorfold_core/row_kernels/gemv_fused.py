"""The bf16 GEMV with a layer's neighbouring ops folded in: the residual added to its rounded output, and swiglu
computed from the gate and up halves, as the inputs are read or as the outputs are stored. A forward's launches fall
by one or two a projection, and every (row, column) sum is still the plain GEMV's one fixed chain (row-invariant
alike).

    residual          y = bf16(bf16(x w^T) + res)                                     (a layer's o_proj)
    swiglu residual   y = bf16(bf16(h w^T) + res), h = swiglu(x[:, :K], x[:, K:])      (a layer's down_proj)
    swiglu            y = swiglu(bf16(x w[:N]^T), bf16(x w[N:]^T))                     (a layer's gate|up)

The last computes each swiglu once, where `swiglu residual` computes it again in every block of down_proj's columns.

swiglu rounds as MLX's bf16 ops do, each step to bf16: s = sigmoid(g), a = g s, h = a u.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tensorfold_contract import (Control, KernelRecord, Launch, Shape, Source, Tolerance, oversize_threadgroup,
                                 relaunch, swap, variant)
from tensorfold_contract.helpers import BF16_ULP, bf16, groups, int_array

from .gemv import (NOT_INVARIANT_ON_CUDA, OUT, WARPS_REVERSED_WHEN_MANY, WIDEST_CALL, _launch_bf16,
                   _one_group_short, template_value, tolerance as gemv_tolerance)
from .gemv_sources import CUDA_BF16, CUDA_BF16_HEADER, METAL_BF16

FUSIONS = ("residual", "swiglu residual", "swiglu")

_STORE = "y[(size_t)row * N + col] = static_cast<T>(v);"
_STORE_RESIDUAL = ("y[(size_t)row * N + col] = static_cast<T>(static_cast<float>(static_cast<T>(v)) + "
                   "static_cast<float>(res[(size_t)row * N + col]));")
_CUDA_LOAD_X = "tf_load8(x, r, k, K, vec)"
_METAL_LOAD_X = "static_cast<float>(x[(size_t)row * K + k])"

# 8 consecutive inputs of swiglu from input k on: the gate at k, the up half at K + k of a row 2K wide, zeros past K
CUDA_SWIGLU_HEADER = CUDA_BF16_HEADER + """
__device__ __forceinline__ __nv_bfloat16 tf_swiglu1(__nv_bfloat16 g, __nv_bfloat16 u) {
  const float gf = __bfloat162float(g);
  const __nv_bfloat16 s = __float2bfloat16(1.0f / (1.0f + expf(-gf)));
  const __nv_bfloat16 a = __float2bfloat16(gf * __bfloat162float(s));
  return __float2bfloat16(__bfloat162float(a) * __bfloat162float(u));
}

__device__ __forceinline__ uint4 tf_swiglu8(const __nv_bfloat16* a, int row, int k, int K, bool vec) {
  const uint4 g = tf_load8(a + (size_t)row * K, 0, k, K, vec);  // row `row` of 2K inputs is rows 2 row, 2 row + 1 of K
  const uint4 u = tf_load8(a + (size_t)row * K + K, 0, k, K, vec);
  uint4 h;
  const __nv_bfloat16* gh = reinterpret_cast<const __nv_bfloat16*>(&g);
  const __nv_bfloat16* uh = reinterpret_cast<const __nv_bfloat16*>(&u);
  __nv_bfloat16* hh = reinterpret_cast<__nv_bfloat16*>(&h);
#pragma unroll
  for (int e = 0; e < 8; ++e) hh[e] = tf_swiglu1(gh[e], uh[e]);
  return h;
}
"""

METAL_SWIGLU_HEADER = """
// input k of swiglu for row `row` of a 2K-wide gate|up row, rounded to bf16 at each step as MLX's ops are
inline float tf_swiglu(const device bfloat16_t* x, int row, int k, int K) {
  const float g = static_cast<float>(x[(size_t)row * 2 * K + k]);
  const float u = static_cast<float>(x[(size_t)row * 2 * K + K + k]);
  const float s = static_cast<float>(static_cast<bfloat16_t>(1.0f / (1.0f + metal::exp(-g))));
  const float a = static_cast<float>(static_cast<bfloat16_t>(g * s));
  return static_cast<float>(static_cast<bfloat16_t>(a * u));
}
"""


METAL_SWIGLU_PAIR_HEADER = """
// swiglu of a gate and an up output, rounded to bf16 at each step as MLX's ops are
inline bfloat16_t tf_swiglu1(bfloat16_t g, bfloat16_t u) {
  const float gf = static_cast<float>(g);
  const bfloat16_t s = static_cast<bfloat16_t>(1.0f / (1.0f + metal::exp(-gf)));
  const bfloat16_t a = static_cast<bfloat16_t>(gf * static_cast<float>(s));
  return static_cast<bfloat16_t>(static_cast<float>(a) * static_cast<float>(u));
}
"""

# `swiglu`: a block takes 16 columns of y, its tile m = 0 the gate's weight rows and m = 1 the up's (rows N on);
# each thread keeps the rounded gate sums it folds until the up tile's fold reaches the same (row, column)
_SWIGLU_EDITS = {
    "cuda": (("const int col0 = (int)(blockIdx.x / row_blocks) * CB;",
              "const int col0 = (int)(blockIdx.x / row_blocks) * 16;"),
             ("tf_load8(w, min(col0 + 16 * m + g, N - 1), k, K, vec)",
              "tf_load8(w, m * N + min(col0 + g, N - 1), k, K, vec)"),
             ("tf_load8(w, min(col0 + 16 * m + g + 8, N - 1), k, K, vec)",
              "tf_load8(w, m * N + min(col0 + g + 8, N - 1), k, K, vec)"),
             ("__shared__ float part[WARPS][RB][16];",
              "__shared__ float part[WARPS][RB][16];\n__shared__ T gate[RB * 16];")),
    "metal": (("const int col0 = (int)(threadgroup_position_in_grid.x / row_blocks) * CB;",
               "const int col0 = (int)(threadgroup_position_in_grid.x / row_blocks) * 16;"),
              ("const int col = metal::min(col0 + 16 * m + c, N - 1);",
               "const int col = m * N + metal::min(col0 + c, N - 1);"),
              ("threadgroup float part[WARPS][RB][16];",
               "threadgroup float part[WARPS][RB][16];\nthreadgroup T gate[RB * 16];")),
}
_STORE_SWIGLU = ("if (m == 0) gate[o] = static_cast<T>(v);\n"
                 "      else y[(size_t)row * N + col] = tf_swiglu1(gate[o], static_cast<T>(v));")


def once(text: str, old: str, new: str) -> str:
    """`text` with its one `old` replaced (an edit of a kernel's text that must land exactly once)."""
    assert text.count(old) == 1, old
    return text.replace(old, new)


def _text(body: str, fusion: str, kind: str) -> str:
    if fusion == "swiglu":
        for old, new in _SWIGLU_EDITS[kind]:
            body = once(body, old, new)
        body = once(body, "const int col = col0 + 16 * m + o % 16;", "const int col = col0 + o % 16;")
        return once(body, _STORE, _STORE_SWIGLU)
    body = once(body, _STORE, _STORE_RESIDUAL)
    if fusion == "swiglu residual":
        body = once(body, _CUDA_LOAD_X, "tf_swiglu8(x, 2 * r, k, K, vec)") if kind == "cuda" else \
            once(body, _METAL_LOAD_X, "tf_swiglu(x, row, k, K)")
    return body


def _inputs(case):
    import mlx.core as mx

    return [case.array("x", mx.bfloat16), case.array("w", mx.bfloat16), case.array("res", mx.bfloat16),
            int_array([case.rows, case.dims["n"], case.dims["k"]])]


def _inputs_swiglu(case):
    import mlx.core as mx

    return [case.array("x", mx.bfloat16), case.array("w", mx.bfloat16),
            int_array([case.rows, case.dims["n"], case.dims["k"]])]


def _launch_swiglu(case) -> Launch:
    """The bf16 GEMV's launch with two 16-column tiles a block, the gate's and the up's of the same 16 columns."""
    launch = _launch_bf16(case)
    warps, maxt = template_value(launch, "WARPS"), template_value(launch, "MAXT")
    blocks = groups(case.dims["n"], 16) * groups(case.rows, 8 * maxt)
    template = tuple((name, 2 if name == "MT" else value) for name, value in launch.template)
    return dataclasses.replace(launch, grid=(blocks * warps * 32 if case.rows else 0, 1, 1), template=template,
                               static_shared=launch.static_shared + 2 * 8 * maxt * 16)  # and the rounded gate sums


def source(kind: str, fusion: str) -> Source:
    """The cuda or metal implementation of a fusion: the bf16 GEMV's text with its x read and its store changed."""
    body = _text(CUDA_BF16 if kind == "cuda" else METAL_BF16, fusion, kind)
    if fusion == "swiglu":
        header = CUDA_SWIGLU_HEADER if kind == "cuda" else METAL_SWIGLU_PAIR_HEADER
        return Source("gemv16_swiglu", ("x", "w", "dims"), ("y",), body, inputs=_inputs_swiglu,
                      launch=_launch_swiglu, header=header)
    header = (CUDA_SWIGLU_HEADER if fusion == "swiglu residual" else CUDA_BF16_HEADER) if kind == "cuda" else \
        (METAL_SWIGLU_HEADER if fusion == "swiglu residual" else "")
    name = "gemv16_res" if fusion == "residual" else "gemv16_swiglu_res"
    return Source(name, ("x", "w", "res", "dims"), ("y",), body, inputs=_inputs, launch=_launch_bf16, header=header)


def swiglu_host(x: np.ndarray, k: int) -> np.ndarray:
    """swiglu of a row's gate and up halves in float64, rounded to bf16 at each step as the kernels do."""
    g, u = x[:, :k].astype(np.float64), x[:, k:].astype(np.float64)
    s = bf16((1.0 / (1.0 + np.exp(-g))).astype(np.float32)).astype(np.float64)
    a = bf16((g * s).astype(np.float32)).astype(np.float64)
    return bf16((a * u).astype(np.float32)).astype(np.float64)


def make_for(fusion: str):
    def make(dims, rows, rng):
        n, k = dims["n"], dims["k"]
        width = 2 * k if fusion == "swiglu residual" else k
        x = bf16(rng.standard_normal((rows, width)).astype(np.float32))
        if fusion == "swiglu":  # the gate's rows, then the up's
            return {"x": x, "w": bf16((rng.standard_normal((2 * n, k)) / np.sqrt(k)).astype(np.float32))}
        w = bf16((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32))
        res = bf16(rng.standard_normal((rows, n)).astype(np.float32))  # a residual stream as large as the output
        return {"x": x, "w": w, "res": res}

    return make


def reference_for(fusion: str):
    def reference(case):
        x = case["x"].astype(np.float64)
        if fusion == "swiglu":  # the gate and up sums rounded to bf16 (the served output), then swiglu's steps
            return {"y": swiglu_host(bf16((x @ case["w"].astype(np.float64).T).astype(np.float32)), case.dims["n"])}
        if fusion == "swiglu residual":
            x = swiglu_host(case["x"], case.dims["k"])
        return {"y": x @ case["w"].astype(np.float64).T + case["res"].astype(np.float64)}

    return reference


def tolerance_swiglu(dims):
    # the GEMV's bound, and a gate or up sum that rounds to the bf16 next to the reference's moves swiglu by about
    # |g u| / 128, at most twice the size of the row's outputs where g > 0; then swiglu's own three roundings
    return Tolerance(rtol=gemv_tolerance({**dims, "out": OUT}).rtol + 4 * BF16_ULP)


def tolerance(dims):
    # the GEMV's bound and two bf16 roundings (its output's, then the sum's), relative to outputs of the
    # residual's size; swiglu's own roundings are the reference's too
    return Tolerance(rtol=gemv_tolerance({**dims, "out": OUT}).rtol + 2 * BF16_ULP)


def mlx_for(fusion: str, drop_residual: bool = False, swapped_halves: bool = False):
    """MLX's ops: swiglu in bf16 (as a forward computes it), the matmul in fp32 rounded once, then the residual."""

    def mlx_fused(case):
        import mlx.core as mx
        import mlx.nn as nn

        x = case.array("x", mx.bfloat16)
        if x.shape[0] == 0:  # MLX 0.32.4's CUDA matmul dies of SIGFPE on zero rows (gate 3's empty edge on the H200)
            return {"y": mx.zeros((0, case.dims["n"]), mx.bfloat16)}
        if fusion == "swiglu":
            n = case.dims["n"]
            y = (x.astype(mx.float32) @ case.array("w", mx.float32).T).astype(mx.bfloat16)
            gate, up = (y[:, n:], y[:, :n]) if swapped_halves else (y[:, :n], y[:, n:])
            return {"y": nn.silu(gate) * up}
        if fusion == "swiglu residual":
            k = case.dims["k"]
            gate, up = (x[:, k:], x[:, :k]) if swapped_halves else (x[:, :k], x[:, k:])
            x = nn.silu(gate) * up
        y = (x.astype(mx.float32) @ case.array("w", mx.float32).T).astype(mx.bfloat16)
        return {"y": y if drop_residual else y + case.array("res", mx.bfloat16)}

    return mlx_fused


def edges() -> tuple[Shape, ...]:
    sizes = [("1 row", 256, 256, 1), ("K=203, not a multiple of 8", 40, 203, 5), ("N=33, off the columns", 33, 256, 7),
             ("K=4096, 9 rows", 64, 4096, 9), ("a prompt chunk beside 8 windows: 300 rows", 48, 256, 300),
             ("empty", 256, 256, 0)]
    return tuple(Shape(label, {"n": n, "k": k, "out": OUT}, rows) for label, n, k, rows in sizes)


def record(family: str, fusion: str, shapes: tuple[Shape, ...]) -> KernelRecord:
    """`family`'s fused GEMV record (`fusion` one of FUSIONS), bf16 weights, proven at the shapes it serves."""
    assert fusion in FUSIONS, fusion
    if fusion == "swiglu":
        return _record_swiglu(family, shapes)
    swiglu = fusion == "swiglu residual"
    cuda, metal = source("cuda", fusion), source("metal", fusion)
    controls = [
        Control("residual dropped", "mlx", 2, variant(mlx_for(fusion, drop_residual=True))),
        Control("residual dropped", "cuda", 2, swap(_STORE_RESIDUAL, _STORE)),
        Control("warp sums folded in reverse when many rows", "cuda", 4, WARPS_REVERSED_WHEN_MANY),
        Control("over-sized threadgroup", "cuda", 5, oversize_threadgroup()),
        Control("over-sized threadgroup", "metal", 5, oversize_threadgroup()),
    ]
    if swiglu:
        controls += [
            Control("gate and up halves swapped", "mlx", 2, variant(mlx_for(fusion, swapped_halves=True))),
            Control("gate and up halves swapped", "cuda", 2,
                    swap("hh[e] = tf_swiglu1(gh[e], uh[e]);", "hh[e] = tf_swiglu1(uh[e], gh[e]);", where="header")),
        ]
    what = "swiglu(x[:, :K], x[:, K:])" if swiglu else "x"
    return KernelRecord(
        name=f"{family} gemv bf16 {'swiglu ' if swiglu else ''}+ residual",
        implementations={"mlx": mlx_for(fusion), "cuda": cuda, "metal": metal}, controls=tuple(controls),
        description=f"y = bf16(bf16({what} w^T) + res) for any number of rows, bf16 weights, fp32 sums in the plain "
                    "GEMV's order; each row's result independent of the row count",
        family=family, make=make_for(fusion), reference=reference_for(fusion), shapes=shapes, edges=edges(),
        tolerance=tolerance, row_inputs=("x", "res"), max_rows=WIDEST_CALL,
        findings=(NOT_INVARIANT_ON_CUDA,))


def _record_swiglu(family: str, shapes: tuple[Shape, ...]) -> KernelRecord:
    controls = (
        Control("gate and up halves swapped", "mlx", 2, variant(mlx_for("swiglu", swapped_halves=True))),
        Control("gate and up halves swapped", "cuda", 2,
                swap("tf_swiglu1(gate[o], static_cast<T>(v))", "tf_swiglu1(static_cast<T>(v), gate[o])")),
        Control("unwritten last columns (grid one group short)", "cuda", 2, relaunch(_one_group_short)),
        Control("warp sums folded in reverse when many rows", "cuda", 4, WARPS_REVERSED_WHEN_MANY),
        Control("over-sized threadgroup", "cuda", 5, oversize_threadgroup()),
        Control("over-sized threadgroup", "metal", 5, oversize_threadgroup()),
    )
    return KernelRecord(
        name=f"{family} gemv bf16 gate|up swiglu",
        implementations={"mlx": mlx_for("swiglu"), "cuda": source("cuda", "swiglu"),
                         "metal": source("metal", "swiglu")},
        controls=controls,
        description="y = swiglu(bf16(x w[:N]^T), bf16(x w[N:]^T)) for any number of rows: the gate and up weights "
                    "stacked, each sum the plain GEMV's fp32 chain rounded once, swiglu rounded at each step as MLX's "
                    "bf16 ops; each row's result independent of the row count",
        family=family, make=make_for("swiglu"), reference=reference_for("swiglu"), shapes=shapes, edges=edges(),
        tolerance=tolerance_swiglu, row_inputs=("x",), max_rows=WIDEST_CALL, findings=(NOT_INVARIANT_ON_CUDA,))
