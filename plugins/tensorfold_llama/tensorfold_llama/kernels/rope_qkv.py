"""RoPE on the fused q|k|v projection's rows under contract: q's and k's heads roped at each row's own position, v's
copied, all three written in their heads' shape by one launch (where slices, reshapes and two ropes were ten ops)."""

from __future__ import annotations

import numpy as np

from tensorfold_contract import Control, KernelRecord, Launch, Shape, Source, oversize_threadgroup, swap, variant

from .common import LLAMA_1B, LLAMA_8B, TINY, TINY_DRAFTER, WIDEST, int_array, mx_dtype, rounded
from .rope import LLAMA3, THREADS, freqs, rotate, tolerance

# One thread per (row, head, pair) of a row's H + 2 KV heads, the rope record's arithmetic; the backends differ in
# the thread's index, the offsets' type and the angle (CUDA takes it in double; Metal has none, and takes it in
# float, as MLX's own rope does)
_BODY = """
const int rows = dims[0];
const int hq = dims[1];
const int hk = dims[2];
const int half = dims[3] / 2;
const int heads = hq + 2 * hk;
const int total = rows * heads * half;
const int idx = @IDX@;
if (idx >= total) return;
const int i = idx % half;
const int head = (idx / half) % heads;
const int row = idx / (half * heads);
const @SIZE@ src = (@SIZE@)(idx / half) * (2 * half);
const int ia = TRADITIONAL ? 2 * i : i;
const int ib = TRADITIONAL ? 2 * i + 1 : i + half;
if (head >= hq + hk) {  // v: copied into its heads
  const @SIZE@ dst = ((@SIZE@)row * hk + (head - hq - hk)) * (2 * half);
  v[dst + ia] = qkv[src + ia];
  v[dst + ib] = qkv[src + ib];
  return;
}
@ANGLE@
const float a = static_cast<float>(qkv[src + ia]);
const float b = static_cast<float>(qkv[src + ib]);
const T ra = static_cast<T>(a * c - b * s);
const T rb = static_cast<T>(a * s + b * c);
if (head < hq) {
  const @SIZE@ dst = ((@SIZE@)row * hq + head) * (2 * half);
  q[dst + ia] = ra;
  q[dst + ib] = rb;
} else {
  const @SIZE@ dst = ((@SIZE@)row * hk + (head - hq)) * (2 * half);
  k[dst + ia] = ra;
  k[dst + ib] = rb;
}
"""

CUDA = (_BODY.replace("@IDX@", "blockIdx.x * blockDim.x + threadIdx.x").replace("@SIZE@", "size_t")
        .replace("@ANGLE@", "const double theta = (double)positions[row] / (double)freqs[i];\n"
                            "const float c = (float)cos(theta);\nconst float s = (float)sin(theta);"))
METAL = (_BODY.replace("@IDX@", "(int)thread_position_in_grid.x").replace("@SIZE@", "int")
         .replace("@ANGLE@", "const float theta = (float)positions[row] / freqs[i];\n"
                             "const float c = metal::precise::cos(theta);\n"
                             "const float s = metal::precise::sin(theta);"))


def _heads(dims) -> tuple[int, int, int]:
    return dims["heads"], dims["kv_heads"], dims["head_dim"]


def make(dims, rows, rng):
    h, kv, d = _heads(dims)
    qkv = rng.standard_normal((rows, (h + 2 * kv) * d)).astype(np.float32)
    positions = (dims["offset"] + np.arange(rows)).astype(np.int32)
    return {"qkv": rounded(qkv, dims["dtype"]), "positions": positions, "freqs": freqs(dims)}


def reference_for(traditional: bool):
    def reference(case):
        h, kv, d = _heads(case.dims)
        rows = case.rows
        x = case["qkv"].astype(np.float64).reshape(rows, h + 2 * kv, d)
        theta = case["positions"].astype(np.float64)[:, None] / case["freqs"].astype(np.float64)[None]
        cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
        return {"q": rotate(x[:, :h], cos, sin, traditional), "k": rotate(x[:, h:h + kv], cos, sin, traditional),
                "v": x[:, h + kv:]}

    return reference


def mlx_for(traditional: bool, shift: int = 0, k_unroped: bool = False):
    """MLX's ops as the layers ran them: slices of the joined rows, each head roped by mx.fast.rope at its row's
    position (an offset a row), with the record's frequencies."""

    def mlx_rope_qkv(case):
        import mlx.core as mx

        h, kv, d = _heads(case.dims)
        rows = case.rows
        y = case.array("qkv", mx_dtype(case.dims["dtype"]))
        q, k, v = y[:, :h * d], y[:, h * d:(h + kv) * d], y[:, (h + kv) * d:]
        if rows == 0:
            return {"q": q.reshape(0, h, d), "k": k.reshape(0, kv, d), "v": v.reshape(0, kv, d)}
        positions = case.array("positions") + shift

        def roped(x, heads):
            return mx.fast.rope(x.reshape(rows, heads, 1, d), d, traditional=traditional, base=None, scale=1.0,
                                offset=positions, freqs=case.array("freqs")).reshape(rows, heads, d)

        return {"q": roped(q, h), "k": k.reshape(rows, kv, d) if k_unroped else roped(k, kv),
                "v": v.reshape(rows, kv, d)}

    return mlx_rope_qkv


def _inputs(case):
    return [case.array("qkv", mx_dtype(case.dims["dtype"])), case.array("positions"), case.array("freqs"),
            int_array([case.rows, *_heads(case.dims)])]


def launch_for(traditional: bool):
    def launch(case):
        h, kv, d = _heads(case.dims)
        dt = mx_dtype(case.dims["dtype"])
        return Launch(grid=(case.rows * (h + 2 * kv) * d // 2, 1, 1), threadgroup=(THREADS, 1, 1),
                      output_shapes=((case.rows, h, d), (case.rows, kv, d), (case.rows, kv, d)),
                      output_dtypes=(dt, dt, dt), template=(("T", dt), ("TRADITIONAL", traditional)))

    return launch


def source(kind: str, traditional: bool) -> Source:
    return Source("rope_qkv", ("qkv", "positions", "freqs", "dims"), ("q", "k", "v"),
                  CUDA if kind == "cuda" else METAL, inputs=_inputs, launch=launch_for(traditional))


def _shape(label, model, offset, dtype="bfloat16", base=10000.0, llama3=None, rows=WIDEST):
    return Shape(label, {"heads": model["heads"], "kv_heads": model["kv_heads"], "head_dim": model["head_dim"],
                         "offset": offset, "dtype": dtype, "base": base, "llama3": llama3}, rows)


SHAPES = (
    _shape("tiny fp32 at 0", TINY, 0, "float32"),
    _shape("tiny bf16 at 1000", TINY, 1000),
    _shape("tiny drafter bf16 at 300", TINY_DRAFTER, 300),
    _shape("1B bf16 llama3 at 8000", LLAMA_1B, 8000, base=500000.0, llama3=LLAMA3),
    _shape("8B fp32 llama3 at 30000", LLAMA_8B, 30000, "float32", 500000.0, LLAMA3),
)
EDGES = (
    _shape("1 row", TINY, 5, rows=1),
    _shape("widest window at the end of a 128k context", LLAMA_8B, 131072 - WIDEST, "float32", 500000.0, LLAMA3),
    _shape("head_dim 80, one head of each", dict(heads=1, kv_heads=1, head_dim=80), 77, "float32", rows=3),
    _shape("empty", TINY, 10, rows=0),
)

K_UNROPED = ("k[dst + ia] = ra;\n  k[dst + ib] = rb;", "k[dst + ia] = qkv[src + ia];\n  k[dst + ib] = qkv[src + ib];")


def record(traditional: bool) -> KernelRecord:
    layout = "interleaved" if traditional else "neox"
    return KernelRecord(
        name=f"llama rope qkv {layout}",
        family="llama",
        description=f"q|k|v projection rows split into heads, q and k roped ({layout} pairs) at each row's absolute "
                    "position (llama3 scaling included), v copied",
        make=make,
        reference=reference_for(traditional),
        implementations={"mlx": mlx_for(traditional), "cuda": source("cuda", traditional),
                         "metal": source("metal", traditional)},
        shapes=SHAPES,
        edges=EDGES,
        tolerance=tolerance,
        row_inputs=("qkv", "positions"),
        controls=(
            Control("off-by-one position", "mlx", 2, variant(mlx_for(traditional, shift=1))),
            Control("k left unroped", "mlx", 2, variant(mlx_for(traditional, k_unroped=True))),
            Control("k left unroped", "cuda", 2, swap(*K_UNROPED)),
            Control("dropped tail pair", "cuda", 2, swap("if (idx >= total) return;", "if (idx >= total - 1) return;")),
            Control("over-sized threadgroup", "cuda", 5, oversize_threadgroup()),
            Control("over-sized threadgroup", "metal", 5, oversize_threadgroup()),
        ),
    )


NEOX = record(False)
INTERLEAVED = record(True)
