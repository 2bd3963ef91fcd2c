"""The layer's first launch whole: RMSNorm, the q|k|v GEMV and RoPE in one, where the normed GEMV and the rope qkv
record were two launches. A block takes 16 of rope's pairs, its two 16-column tiles the pairs' two elements (half a
head apart, neox); each output is the normed GEMV's sum, rounded to bf16, then roped as the rope qkv record ropes it
(v copied): the same bits as the two launches, one launch fewer a layer. Served where TENSORFOLD_ROPE_IN=1 asks it:
on the H200 it has been slower than the two launches so far (docs/performance.md).

    q, k, v = heads(bf16(xn w^T)), q and k roped at each row's own position,  xn = bf16(x * inv(x) * nw)
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tensorfold_contract import Control, KernelRecord, Shape, Source, Tolerance, oversize_threadgroup, swap, variant
from tensorfold_contract.helpers import groups
from tensorfold_contract.serving import ServedCall
from tensorfold_core.row_kernels import gemv_normed
from tensorfold_core.row_kernels.gemv import (NOT_INVARIANT_ON_CUDA, WARPS_REVERSED_WHEN_MANY, WIDEST_CALL,
                                              template_value)
from tensorfold_core.row_kernels.gemv_fused import once

from . import rope, rope_qkv
from .common import BF16_ULP, int_array
from .gemv import MODELS

OUTPUTS = ("yq", "yk", "yv")  # not q, k, v: the GEMV's fold names its sum v

# weight row (a column of y) of element m of pair p: neox pairs sit half a head apart
_PAIR_COL = "(p / half) * 2 * half + m * half + p % half"
CUDA_PAIR_HEADER = f"""
__device__ __forceinline__ int tf_pair_col(int p, int m, int half) {{ return {_PAIR_COL}; }}
"""
METAL_PAIR_HEADER = f"""
inline int tf_pair_col(int p, int m, int half) {{ return {_PAIR_COL}; }}
"""

# tile m = 0 holds the pairs' first elements, m = 1 their second: the first tile's rounded sums wait in tf_lo for the
# second's, then each pair is roped (q, k) or copied (v) into its head, exactly as the rope qkv record does it
_STORE = "y[(size_t)row * N + col] = static_cast<T>(v);"
_ROPE_STORE = """if (m == 0) {
        tf_lo[o] = static_cast<T>(v);
      } else {
        const int head = col / half;
        const int i = col % half;
        const T lo = tf_lo[o];
        const T hi = static_cast<T>(v);
        if (head >= hq + hk) {  // v: copied into its heads
          const @SIZE@ dst = ((@SIZE@)row * hk + (head - hq - hk)) * (2 * half);
          yv[dst + i] = lo;
          yv[dst + i + half] = hi;
        } else {
          @ANGLE@
          const float a = static_cast<float>(lo);
          const float b = static_cast<float>(hi);
          const T ra = static_cast<T>(a * c - b * s);
          const T rb = static_cast<T>(a * s + b * c);
          if (head < hq) {
            const @SIZE@ dst = ((@SIZE@)row * hq + head) * (2 * half);
            yq[dst + i] = ra;
            yq[dst + i + half] = rb;
          } else {
            const @SIZE@ dst = ((@SIZE@)row * hk + (head - hq)) * (2 * half);
            yk[dst + i] = ra;
            yk[dst + i + half] = rb;
          }
        }
      }"""
# the rope qkv record's angle on each backend (CUDA in double; Metal has none). On CUDA each (row, pair) of the block
# takes its cosine and sine while the first step's weights are on their way, in warps the norms leave idle (from the
# last warp down), off the store's path (the H200 timed the launch alike with the trig at the store)
_CUDA_TRIG = """    for (int e = WARPS * 32 - 1 - (int)threadIdx.x; e < RB * 16; e += WARPS * 32) {
      const int row = row0 + e / 16;
      const int i = min(col0 + e % 16, N / 2 - 1) % half;
      if (row < rows) {
        const double theta = (double)positions[row] / (double)freqs[i];
        tf_cos[e] = (float)cos(theta);
        tf_sin[e] = (float)sin(theta);
      }
    }
    __syncthreads();
    if ((int)threadIdx.x < RB && row0 + (int)threadIdx.x < rows) {"""
_ANGLE = {"cuda": "const float c = tf_cos[o];\n          const float s = tf_sin[o];",
          "metal": "const float theta = (float)positions[row] / freqs[i];\n"
                   "          const float c = metal::precise::cos(theta);\n"
                   "          const float s = metal::precise::sin(theta);"}
_HEADS = "\nconst int hq = dims[4];\nconst int hk = dims[5];\nconst int half = dims[6] / 2;"

_EDITS = {
    "cuda": (("const float tf_eps = __int_as_float(dims[3]);",
              "const float tf_eps = __int_as_float(dims[3]);" + _HEADS),
             ("const int col0 = (int)(blockIdx.x / row_blocks) * CB;",
              "const int col0 = (int)(blockIdx.x / row_blocks) * 16;"),
             ("tf_load8(w, min(col0 + 16 * m + g, N - 1), k, K, vec)",
              "tf_load8(w, tf_pair_col(min(col0 + g, N / 2 - 1), m, half), k, K, vec)"),
             ("tf_load8(w, min(col0 + 16 * m + g + 8, N - 1), k, K, vec)",
              "tf_load8(w, tf_pair_col(min(col0 + g + 8, N / 2 - 1), m, half), k, K, vec)"),
             ("__shared__ float part[WARPS][RB][16];",
              "__shared__ float part[WARPS][RB][16];\n__shared__ T tf_lo[RB * 16];"),
             ("__shared__ float tf_inv[RB];",
              "__shared__ float tf_inv[RB];\n__shared__ float tf_cos[RB * 16];\n__shared__ float tf_sin[RB * 16];"),
             ("    __syncthreads();\n    if ((int)threadIdx.x < RB && row0 + (int)threadIdx.x < rows) {", _CUDA_TRIG)),
    "metal": (("const int K = dims[2];", "const int K = dims[2];" + _HEADS),
              ("const int col0 = (int)(threadgroup_position_in_grid.x / row_blocks) * CB;",
               "const int col0 = (int)(threadgroup_position_in_grid.x / row_blocks) * 16;"),
              ("const int col = metal::min(col0 + 16 * m + c, N - 1);",
               "const int col = tf_pair_col(metal::min(col0 + c, N / 2 - 1), m, half);"),
              ("threadgroup float part[WARPS][RB][16];",
               "threadgroup float part[WARPS][RB][16];\nthreadgroup T tf_lo[RB * 16];")),
}


def _text(kind: str) -> str:
    body = gemv_normed._normed_text(kind, "norm")
    for old, new in _EDITS[kind]:
        body = once(body, old, new)
    body = once(body, "if (col0 >= N) return;", "if (col0 >= N / 2) return;")  # a block of pairs past the last
    body = once(body, "const int col = col0 + 16 * m + o % 16;", "const int col = col0 + o % 16;  // a pair")
    body = once(body, "if (row < rows && col < N) {", "if (row < rows && col < N / 2) {")
    store = _ROPE_STORE.replace("@ANGLE@", _ANGLE[kind]).replace("@SIZE@", "size_t" if kind == "cuda" else "int")
    return once(body, _STORE, store)


def _heads(dims) -> tuple[int, int, int]:
    return dims["heads"], dims["kv_heads"], dims["head_dim"]


def _inputs(case):
    import mlx.core as mx

    return [case.array("x", mx.bfloat16), case.array("w", mx.bfloat16), case.array("nw", mx.bfloat16),
            case.array("positions"), case.array("freqs"),
            int_array([case.rows, case.dims["n"], case.dims["k"], gemv_normed.eps_bits(case.dims["eps"]),
                       *_heads(case.dims)])]


def _launch_for(kind: str):
    def launch(case):
        """The normed GEMV's launch of the whole q|k|v width (its K split, so its sums), over blocks of 16 pairs with
        two tiles each; three outputs in their heads' shapes."""
        base = gemv_normed._launch_for("norm")(case)
        h, kv, d = _heads(case.dims)
        warps, maxt = template_value(base, "WARPS"), template_value(base, "MAXT")
        blocks = groups(case.dims["n"] // 2, 16) * groups(case.rows, 8 * maxt)
        template = tuple((name, 2 if name == "MT" else value) for name, value in base.template)
        per_pair = 2 + (8 if kind == "cuda" else 0)  # tf_lo's rounded sum (and on CUDA the pair's cosine and sine)
        return dataclasses.replace(
            base, grid=(blocks * warps * 32 if case.rows else 0, 1, 1), template=template,
            output_shapes=((case.rows, h, d), (case.rows, kv, d), (case.rows, kv, d)),
            output_dtypes=base.output_dtypes * 3, static_shared=base.static_shared + per_pair * 8 * maxt * 16)

    return launch


def source(kind: str) -> Source:
    """The cuda or metal implementation: the normed GEMV's text over pairs of columns, storing roped heads."""
    header = (gemv_normed.CUDA_BF16_HEADER + gemv_normed.CUDA_NORM_HEADER + CUDA_PAIR_HEADER) if kind == "cuda" \
        else METAL_PAIR_HEADER
    return Source("gemv16_norm_rope", ("x", "w", "nw", "positions", "freqs", "dims"), OUTPUTS, _text(kind),
                  inputs=_inputs, launch=_launch_for(kind), header=header)


def make(dims, rows, rng):
    case = gemv_normed.make_for("norm")(dims, rows, rng)
    return {**case, "positions": (dims["offset"] + np.arange(rows)).astype(np.int32), "freqs": rope.freqs(dims)}


def reference(case):
    """The normed GEMV's float64 sums, then rope in float64 (v as summed)."""
    h, kv, d = _heads(case.dims)
    y = gemv_normed.reference_for("norm")(case)["y"].reshape(case.rows, h + 2 * kv, d)
    theta = case["positions"].astype(np.float64)[:, None] / case["freqs"].astype(np.float64)[None]
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    return {"yq": rope.rotate(y[:, :h], cos, sin, False), "yk": rope.rotate(y[:, h:h + kv], cos, sin, False),
            "yv": y[:, h + kv:]}


def tolerance(dims):
    # the normed GEMV's bound, rope's (its angle's error grows with the position), and the sums rounded to bf16
    # before they turn: each moves an output by a part of one spacing of the row's largest
    return Tolerance(rtol=gemv_normed.tolerance_for("norm")(dims).rtol + rope.tolerance(dims).rtol + 2 * BF16_ULP)


def mlx_for(shift: int = 0, k_unroped: bool = False):
    """MLX's ops as the layers ran them apart: the normed GEMV's mlx implementation, then the rope qkv record's."""
    normed, roped = gemv_normed.mlx_normed("norm"), rope_qkv.mlx_for(False, shift, k_unroped)

    def normed_rope(case):
        y = normed(case)["y"]
        out = roped(ServedCall(case.rows, case.dims, {"qkv": y, "positions": case.array("positions"),
                                                      "freqs": case.array("freqs")}))
        return dict(zip(OUTPUTS, (out["q"], out["k"], out["v"])))

    return normed_rope


def shape(label: str, model: dict, offset: int, base: float = 10000.0, llama3=None, rows: int = WIDEST_CALL,
          heavy: bool = False) -> Shape:
    """A model's q|k|v behind its input norm, roped from `offset` on (bf16 in and out)."""
    h, kv, d = model["heads"], model["kv_heads"], model["head_dim"]
    normed = gemv_normed.shape(label, (h + 2 * kv) * d, model["hidden"], 1e-5, rows, heavy)
    return dataclasses.replace(normed, dims={**normed.dims, "heads": h, "kv_heads": kv, "head_dim": d,
                                             "offset": offset, "base": base, "llama3": llama3, "dtype": "bfloat16"})


_OFFSETS = {"tiny": (1000, 10000.0, None), "tiny drafter": (300, 10000.0, None),
            "1B": (8000, 500000.0, rope.LLAMA3), "8B": (30000, 500000.0, rope.LLAMA3)}
SHAPES = tuple(shape(f"{label} q|k|v at {_OFFSETS[label][0]}", m, *_OFFSETS[label], heavy=heavy)
               for label, m, heavy in MODELS)
_ONE_OF_EACH = dict(heads=1, kv_heads=1, head_dim=80, hidden=256)  # half a head 40: pair tiles across heads
EDGES = (
    shape("1 row", MODELS[0][1], 5, rows=1),
    shape("head_dim 80, one head of each", _ONE_OF_EACH, 77, rows=3),
    shape("K=203, not a multiple of 8", dict(heads=2, kv_heads=1, head_dim=16, hidden=203), 9, rows=5),
    shape("a prompt chunk beside 8 windows: 300 rows", dict(heads=1, kv_heads=1, head_dim=32, hidden=256), 0,
          rows=300),
    shape("empty", MODELS[0][1], 10, rows=0),
)

_SECOND_ROW_ANGLE = ("(double)positions[row] / (double)freqs[i]",
                     "(double)positions[min(row + 1, rows - 1)] / (double)freqs[i]")

RECORD = KernelRecord(
    name="llama gemv bf16 rmsnorm rope qkv neox",
    family="llama",
    description="q, k, v = heads(bf16(xn w^T)), xn = bf16(x / sqrt(mean(x^2) + eps) * nw), q and k roped (neox "
                "pairs) at each row's absolute position: the normed GEMV's sums, rounded, then rope's steps, in one "
                "launch; each row's result independent of the row count",
    make=make, reference=reference, tolerance=tolerance, shapes=SHAPES, edges=EDGES,
    implementations={"mlx": mlx_for(), "cuda": source("cuda"), "metal": source("metal")},
    row_inputs=("x", "positions"), max_rows=WIDEST_CALL, findings=(NOT_INVARIANT_ON_CUDA,),
    controls=(
        Control("off-by-one position", "mlx", 2, variant(mlx_for(shift=1))),
        Control("k left unroped", "mlx", 2, variant(mlx_for(k_unroped=True))),
        Control("each row roped at the next row's position", "cuda", 2, swap(*_SECOND_ROW_ANGLE)),
        Control("k left unroped", "cuda", 2, swap("yk[dst + i] = ra;\n            yk[dst + i + half] = rb;",
                                                  "yk[dst + i] = lo;\n            yk[dst + i + half] = hi;")),
        Control("warp sums folded in reverse when many rows", "cuda", 4, WARPS_REVERSED_WHEN_MANY),
        Control("over-sized threadgroup", "cuda", 5, oversize_threadgroup()),
        Control("over-sized threadgroup", "metal", 5, oversize_threadgroup()),
    ),
)
