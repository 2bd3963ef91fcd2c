"""RoPE under contract, neox (rotate halves) and interleaved (rotate pairs), at each row's absolute position."""

from __future__ import annotations

import numpy as np

from tensorfold_contract import Control, KernelRecord, Launch, Shape, Source, Tolerance, oversize_threadgroup, \
    swap, variant

from .common import BF16_ULP, EPS32, LLAMA_1B, LLAMA_8B, TINY, WIDEST, int_array, mx_dtype, rounded

THREADS = 256

CUDA = """
// One thread per (row, head, pair). The angle is taken in double, so long contexts keep their precision;
// each element depends only on its own row's position.
const int rows = dims[0];
const int heads = dims[1];
const int half = dims[2] / 2;
const int total = rows * heads * half;
const int idx = blockIdx.x * blockDim.x + threadIdx.x;
if (idx >= total) return;
const int i = idx % half;
const int row = idx / (half * heads);
const size_t base = (size_t)(idx / half) * (2 * half);
const int ia = TRADITIONAL ? 2 * i : i;
const int ib = TRADITIONAL ? 2 * i + 1 : i + half;
const double theta = (double)positions[row] / (double)freqs[i];
const float c = (float)cos(theta);
const float s = (float)sin(theta);
const float a = static_cast<float>(x[base + ia]);
const float b = static_cast<float>(x[base + ib]);
out[base + ia] = static_cast<T>(a * c - b * s);
out[base + ib] = static_cast<T>(a * s + b * c);
"""

METAL = """
// One thread per (row, head, pair). Metal has no double: the angle is taken in float, as MLX's own rope does.
const int rows = dims[0];
const int heads = dims[1];
const int half = dims[2] / 2;
const int total = rows * heads * half;
const int idx = (int)thread_position_in_grid.x;
if (idx >= total) return;
const int i = idx % half;
const int row = idx / (half * heads);
const int base = (idx / half) * (2 * half);
const int ia = TRADITIONAL ? 2 * i : i;
const int ib = TRADITIONAL ? 2 * i + 1 : i + half;
const float theta = (float)positions[row] / freqs[i];
const float c = metal::precise::cos(theta);
const float s = metal::precise::sin(theta);
const float a = static_cast<float>(x[base + ia]);
const float b = static_cast<float>(x[base + ib]);
out[base + ia] = static_cast<T>(a * c - b * s);
out[base + ib] = static_cast<T>(a * s + b * c);
"""


def freqs(dims) -> np.ndarray:
    """The divisors of each pair's angle, as the llama family computes them (llama3 scaling where asked)."""
    d, base = dims["head_dim"], dims["base"]
    f = base ** (np.arange(0, d, 2, dtype=np.float64) / d)
    scaling = dims.get("llama3")
    if scaling:
        factor, low, high, context = scaling
        wavelens = 2 * np.pi * f
        f = np.where(wavelens > context / low, f * factor, f)
        medium = (wavelens > context / high) & (wavelens < context / low)
        smooth = (context / wavelens - low) / (high - low)
        f = np.where(medium, f / ((1 - smooth) / factor + smooth), f)
    return f.astype(np.float32)


def make(dims, rows, rng):
    x = rng.standard_normal((rows, dims["heads"], dims["head_dim"])).astype(np.float32)
    positions = (dims["offset"] + np.arange(rows)).astype(np.int32)
    return {"x": rounded(x, dims["dtype"]), "positions": positions, "freqs": freqs(dims)}


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, traditional: bool) -> np.ndarray:
    out = np.empty_like(x)
    half = x.shape[-1] // 2
    ia = slice(0, None, 2) if traditional else slice(0, half)
    ib = slice(1, None, 2) if traditional else slice(half, None)
    a, b = x[..., ia], x[..., ib]
    out[..., ia], out[..., ib] = a * cos - b * sin, a * sin + b * cos
    return out


def reference_for(traditional: bool):
    def reference(case):
        theta = case["positions"].astype(np.float64)[:, None] / case["freqs"].astype(np.float64)[None]
        cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
        return {"out": rotate(case["x"].astype(np.float64), cos, sin, traditional)}

    return reference


def tolerance(dims):
    # MLX's own rope takes the angle in float32: its error grows with the position, about 2^-24 per unit
    reach = dims["offset"] + WIDEST
    return Tolerance(rtol=64 * EPS32 + 4 * reach * EPS32 + (2 * BF16_ULP if dims["dtype"] == "bfloat16" else 0))


def mlx_rope_for(traditional: bool, shift: int = 0):
    def mlx_rope(case):
        import mlx.core as mx

        x = case.array("x", mx_dtype(case.dims["dtype"]))
        if case.rows == 0:
            return {"out": x}
        positions = case["positions"]
        if not np.array_equal(positions, positions[0] + np.arange(case.rows)):
            raise ValueError("mx.fast.rope takes one offset: a window's positions must be consecutive")
        q = x.transpose(1, 0, 2)[None]  # (1, heads, rows, head_dim), as the model lays out a window
        y = mx.fast.rope(q, case.dims["head_dim"], traditional=traditional, base=None, scale=1.0,
                         offset=int(positions[0]) + shift, freqs=case.array("freqs"))
        return {"out": y[0].transpose(1, 0, 2)}

    return mlx_rope


def _inputs(case):
    return [case.array("x", mx_dtype(case.dims["dtype"])), case.array("positions"), case.array("freqs"),
            int_array([case.rows, case.dims["heads"], case.dims["head_dim"]])]


def launch_for(traditional: bool):
    def launch(case):
        pairs = case.rows * case.dims["heads"] * case.dims["head_dim"] // 2
        dt = mx_dtype(case.dims["dtype"])
        return Launch(grid=(pairs, 1, 1), threadgroup=(THREADS, 1, 1),
                      output_shapes=((case.rows, case.dims["heads"], case.dims["head_dim"]),), output_dtypes=(dt,),
                      template=(("T", dt), ("TRADITIONAL", traditional)))

    return launch


def source(kind: str, traditional: bool) -> Source:
    return Source("rope", ("x", "positions", "freqs", "dims"), ("out",), CUDA if kind == "cuda" else METAL,
                  inputs=_inputs, launch=launch_for(traditional))


LLAMA3 = (32.0, 1.0, 4.0, 8192)  # factor, low_freq_factor, high_freq_factor, original context


def _shape(label, model, offset, dtype="float32", base=10000.0, llama3=None, rows=WIDEST, heads=None):
    return Shape(label, {"heads": heads or model["heads"], "head_dim": model["head_dim"], "offset": offset,
                         "dtype": dtype, "base": base, "llama3": llama3}, rows)


SHAPES = (
    _shape("tiny fp32 at 0", TINY, 0),
    _shape("tiny bf16 at 1000", TINY, 1000, "bfloat16"),
    _shape("tiny kv heads fp32 at 300", TINY, 300, heads=TINY["kv_heads"]),
    _shape("1B bf16 llama3 at 8000", LLAMA_1B, 8000, "bfloat16", 500000.0, LLAMA3),
    _shape("8B fp32 llama3 at 30000", LLAMA_8B, 30000, "float32", 500000.0, LLAMA3),
)
EDGES = (
    _shape("1 row", TINY, 5, rows=1),
    _shape("widest window at the end of a 128k context", LLAMA_8B, 131072 - WIDEST, base=500000.0, llama3=LLAMA3),
    _shape("head_dim 80, one head", dict(heads=1, head_dim=80), 77, rows=3),
    _shape("empty", TINY, 10, rows=0),
)


def record(traditional: bool) -> KernelRecord:
    layout = "interleaved" if traditional else "neox"
    other = mlx_rope_for(not traditional)
    return KernelRecord(
        name=f"llama rope {layout}",
        family="llama",
        description=f"rotary embedding ({layout} pairs) at absolute positions, llama3 frequency scaling included",
        make=make,
        reference=reference_for(traditional),
        implementations={"mlx": mlx_rope_for(traditional), "cuda": source("cuda", traditional),
                         "metal": source("metal", traditional)},
        shapes=SHAPES,
        edges=EDGES,
        tolerance=tolerance,
        row_inputs=("x", "positions"),
        controls=(
            Control("off-by-one position", "mlx", 2, variant(mlx_rope_for(traditional, shift=1))),
            Control(f"pairs taken {'neox' if traditional else 'interleaved'}", "mlx", 2, variant(other)),
            Control("dropped tail pair", "cuda", 2, swap("if (idx >= total) return;",
                                                         "if (idx >= total - 1) return;")),
            Control("over-sized threadgroup", "cuda", 5, oversize_threadgroup()),
            Control("over-sized threadgroup", "metal", 5, oversize_threadgroup()),
        ),
    )


NEOX = record(False)
INTERLEAVED = record(True)
