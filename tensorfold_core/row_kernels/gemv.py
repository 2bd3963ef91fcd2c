"""The exact-verify GEMV under contract: any number of rows, bf16 or MLX affine 4/8-bit weights, row-invariant.

A family builds its own records from it (`record`), proven at the shapes it serves.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from tensorfold_contract import Control, Finding, KernelRecord, Launch, Shape, Source, Tolerance, \
    oversize_threadgroup, relaunch, swap, variant

from tensorfold_contract.helpers import BF16_ULP, EPS32, bf16, groups, int_array, mx_dtype

from .gemv_sources import CUDA_AFFINE, CUDA_BF16, CUDA_BF16_HEADER, CUDA_FOLD, METAL_AFFINE, METAL_BF16

THREADS = 128  # four warps a group (affine)
WARPS = 8  # the bf16 kernel's K split: warp w of a group takes the 32-input steps w, w + 8, ... of every column
# The widest call gate 4 proves row by row: 8 streams' windows of 16 rows, four of the bf16 kernel's 32-row blocks
# and eight of the affine kernel's 16-row groups; a wider call (a prompt chunk beside windows) repeats those blocks
WIDEST_CALL = 128
STEPS_ENV = "TENSORFOLD_GEMV_STEPS"  # U, the 32-input steps a warp loads at once (a measurement; bits never move)
# up to 16 rows a warp of the 8-warp split loads one step at a time, of the 16-warp split two: each the faster (cold)
WIDE_STEPS, NARROW_STEPS = 1, 2
# The K split of calls with fewer than NARROW_COLUMNS outputs (a 1B's q|k|v, o_proj and down_proj): twice the warps,
# each one's chain half as long, so that a call of so few column blocks keeps enough loads in flight. It orders those
# shapes' sums anew, alike at any row count (the contract proves each record at it).
NARROW_WARPS = 16
NARROW_COLUMNS = 4096  # below this a call has fewer 32-column blocks than the H200 has SMs (132)
# and one 16-column tile a warp there, not two: twice the blocks (128 for 2,048 outputs), each column's sum as before
NARROW_TILES = 1
# 8-row tiles a block past 16 rows (a measurement: 2 repeats 16-row blocks as before; bits never move)
MAXT_ENV = "TENSORFOLD_GEMV_MAXT"
DEEP_TILES = 4
# the fold's shared sums a block may hold: with the fusions' own buffers a launch stays under Metal's 32 KB
FOLD_BYTES = 16 * 1024
# "W" or "W:MT": another split (and column tiles a warp) for those calls, a measurement the contract must prove again
NARROW_ENV = "TENSORFOLD_GEMV_NARROW"
OUT = "bfloat16"  # what the served projections give back: the activation dtype, rounded once from the fp32 sum


def buckets(rows: int) -> tuple[int, int]:
    """The affine kernel's (MAXR, COLS) for a call of `rows` rows: rows in groups of up to 16."""
    # rows round up to 1, 2, 4, 8 or 16 a group, and many rows take fewer columns a warp (registers); neither
    # changes any (row, column) chain, so the rounding never shows in a result
    maxr = next(b for b in (1, 2, 4, 8, 16) if b >= min(max(rows, 1), 16))
    return maxr, 8 if maxr <= 4 else 4


def tiles(rows: int, steps: int) -> tuple[int, int, int]:
    """The bf16 kernel's (MAXT, MT, U) for a call of `rows` rows: 8-row tiles a group, 16-column tiles a warp, and
    steps loaded together; past the deepest tile the grid repeats blocks. None of it changes a (row, column) sum."""
    # up to 16 rows, the fastest on the H200 (bench/bench_gemv_tiles.py, which found every geometry's output
    # bit-equal): one 8-row tile a group up to 8 rows, two from 9, two column tiles a warp, `steps` loads at once.
    # Past 16 rows a block's warps read the weights once for up to 32 rows: repeated 16-row blocks each re-read them
    # (and the whole x) from L2, which set the pace of a verify's 40 rows and a prompt chunk's (docs/performance.md)
    steps = int(os.environ.get(STEPS_ENV, steps))
    if rows <= 16:
        return (1, 2, steps) if rows <= 8 else (2, 2, steps)
    deep = int(os.environ.get(MAXT_ENV, str(DEEP_TILES)))
    # a deep tile's x loads and accumulators take the registers a second step's loads would
    return (deep, 2, 1) if deep > 2 else (2, 2, steps)


def geometry(n: int, rows: int) -> tuple[int, int, int, int]:
    """The bf16 kernel's (WARPS, MAXT, MT, U) for a call of `rows` rows and `n` outputs: the K split follows the
    shape alone, never the rows, so each (row, column) sum keeps its order in a call of any row count."""
    warps, narrow_tiles = WARPS, None
    if n < NARROW_COLUMNS:
        split, _, tiles_set = os.environ.get(NARROW_ENV, f"{NARROW_WARPS}:{NARROW_TILES}").partition(":")
        warps, narrow_tiles = int(split), int(tiles_set) if tiles_set else None
    steps = WIDE_STEPS if warps == WARPS else NARROW_STEPS
    maxt, mt, u = tiles(rows, steps)
    mt = narrow_tiles or mt
    # every warp's sums wait in shared memory for the fold (4 bytes a row and column): a split whose fold holds fewer
    # tiles keeps the 16-row blocks, loaded as up to 16 rows are (four tiles at 16 warps lost on the H100 as well)
    if maxt > FOLD_BYTES // (4 * 8 * 16 * warps):
        maxt, _, u = tiles(16, steps)
    return warps, maxt, mt, u


def template_value(launch: Launch, name: str) -> int:
    """One of a launch's template constants."""
    return dict(launch.template)[name]


def shard_sizes(columns: list[tuple[str, int, int]], rows: list[tuple[str, int, int]], bits: int, group: int = 64,
                ranks: int = 2, served: tuple[tuple[int, int], ...] = (),
                pairs: tuple[tuple[str, str, int, int], ...] = ()) -> list[tuple[str, int, int]]:
    """A group rank's projections (label, n, k) not already `served` (n, k): those split by outputs keep n / ranks,
    those split by inputs k / ranks (where that keeps whole quantization groups: elsewhere the load refuses it), and
    each pair (column label, row label, width, d) its ranks' widths as `tensorfold_core.shard` cuts them."""
    from tensorfold_core.shard import pair_bounds

    out = [(f"{what}, 1 of {ranks} ranks", n // ranks, k) for what, n, k in columns]
    out += [(f"{what}, 1 of {ranks} ranks", n, k // ranks) for what, n, k in rows
            if bits == 16 or (k // ranks) % group == 0]
    for column, row, width, d in pairs:
        try:
            widths = sorted({hi - lo for lo, hi in (pair_bounds(width, None if bits == 16 else group, rank, ranks)
                                                    for rank in range(ranks))}, reverse=True)
        except ValueError:  # fewer whole groups than ranks: the load refuses it
            widths = []
        out += [(f"{what}, 1 of {ranks} ranks", n, k) for w in widths
                for what, n, k in ((column, w, d), (row, d, w))]
    seen = set(served)
    return [size for size in out if size[1:] not in seen and not seen.add(size[1:])]


def make_for(bits: int):
    def make(dims, rows, rng):
        n, k = dims["n"], dims["k"]
        x = bf16(rng.standard_normal((rows, k)).astype(np.float32))
        w = bf16((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32))
        if bits == 16:
            return {"x": x, "w": w}
        import mlx.core as mx

        wq, scales, biases = mx.quantize(mx.array(w).astype(mx.bfloat16), group_size=dims["group"], bits=bits)
        return {"x": x, "wq": np.array(wq), "scales": np.array(scales.astype(mx.float32)),
                "biases": np.array(biases.astype(mx.float32))}

    return make


def dequantize(wq: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group: int) -> np.ndarray:
    """MLX affine weights in float64: values packed low bits first, w = scale * q + bias per group."""
    per_word = 32 // bits
    shifts = (np.arange(per_word, dtype=np.uint32) * bits)[None, None, :]
    q = (wq[:, :, None] >> shifts) & np.uint32((1 << bits) - 1)
    q = q.reshape(wq.shape[0], -1).astype(np.float64)
    return q * np.repeat(scales.astype(np.float64), group, axis=1) + np.repeat(biases.astype(np.float64), group, axis=1)


def reference_for(bits: int):
    def reference(case):
        x = case["x"].astype(np.float64)
        if bits == 16:
            w = case["w"].astype(np.float64)
        else:
            w = dequantize(case["wq"], case["scales"], case["biases"], bits, case.dims["group"])
        return {"y": x @ w.T}

    return reference


def tolerance(dims):
    # fp32 chains of K products: rounding grows about as sqrt(K), relative to the row's largest output; a bf16
    # output adds its one rounding (half a spacing, counted whole)
    bf16_out = BF16_ULP if dims.get("out", "float32") == "bfloat16" else 0.0
    return Tolerance(rtol=64 * EPS32 + 16 * EPS32 * np.sqrt(dims["k"]) + bf16_out)


def out_dtype(dims):
    return mx_dtype(dims.get("out", "float32"))


def mlx_for(bits: int, drop_tail: bool = False):
    """The kernels it replaces: matmul on the widened bf16 values, or mx.quantized_matmul, with fp32 sums rounded
    once to the output dtype."""

    def mlx_gemv(case):
        import mlx.core as mx

        x = case.array("x")
        if bits == 16:
            w = case.array("w")
            y = x[:, :-1] @ w[:, :-1].T if drop_tail else x @ w.T
        else:
            y = qmm(x, case.array("wq"), case.array("scales", mx.bfloat16), case.array("biases", mx.bfloat16),
                    case.dims["group"], bits)
        return {"y": y.astype(out_dtype(case.dims))}

    return mlx_gemv


def qmm(x, wq, scales, biases, group: int, bits: int):
    """mx.quantized_matmul, but not on zero rows: MLX 0.32.4's CPU kernel dies of SIGFPE there."""
    import mlx.core as mx

    if x.shape[0] == 0:
        return mx.zeros((0, wq.shape[0]), mx.float32)
    return mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=group, bits=bits)


def _inputs_for(bits: int):
    def inputs(case):
        import mlx.core as mx

        dims = int_array([case.rows, case.dims["n"], case.dims["k"]])
        if bits == 16:
            return [case.array("x", mx.bfloat16), case.array("w", mx.bfloat16), dims]
        return [case.array("x", mx.bfloat16), case.array("wq"), case.array("scales", mx.bfloat16),
                case.array("biases", mx.bfloat16), dims]

    return inputs


def _launch_bf16(case) -> Launch:
    warps, maxt, mt, u = geometry(case.dims["n"], case.rows)
    blocks = groups(case.dims["n"], 16 * mt) * groups(case.rows, 8 * maxt)
    out = out_dtype(case.dims)
    return Launch(grid=(blocks * warps * 32 if case.rows else 0, 1, 1), threadgroup=(warps * 32, 1, 1),
                  output_shapes=((case.rows, case.dims["n"]),), output_dtypes=(out,),
                  template=(("WARPS", warps), ("MAXT", maxt), ("MT", mt), ("U", u), ("T", out)),
                  static_shared=4 * warps * 8 * maxt * 16)  # part: each warp's sums before the fold


def _launch_affine_for(bits: int):
    def launch(case):
        maxr, cols = buckets(case.rows)
        warps = groups(case.dims["n"], cols) * groups(case.rows, maxr)
        out = out_dtype(case.dims)
        return Launch(grid=(warps * 32 if case.rows else 0, 1, 1), threadgroup=(THREADS, 1, 1),
                      output_shapes=((case.rows, case.dims["n"]),), output_dtypes=(out,),
                      template=(("MAXR", maxr), ("COLS", cols), ("BITS", bits), ("GROUP", case.dims["group"]),
                                ("T", out)))

    return launch


def source(kind: str, bits: int) -> Source:
    names = ("x", "w", "dims") if bits == 16 else ("x", "wq", "scales", "biases", "dims")
    if bits == 16:
        return Source("gemv16", names, ("y",), METAL_BF16 if kind == "metal" else CUDA_BF16, inputs=_inputs_for(16),
                      launch=_launch_bf16, header="" if kind == "metal" else CUDA_BF16_HEADER)
    return Source(f"gemv{bits}", names, ("y",), METAL_AFFINE if kind == "metal" else CUDA_AFFINE,
                  inputs=_inputs_for(bits), launch=_launch_affine_for(bits))


def fp16_chunks(case):
    """Planted: the dot products accumulated in fp16, eight partial sums at a time."""
    import mlx.core as mx

    x, w = case.array("x"), case.array("w")
    k = x.shape[1]
    acc = mx.zeros((x.shape[0], w.shape[0]), mx.float16)
    step = max(1, -(-k // 8))
    for start in range(0, k, step):
        acc = acc + (x[:, start:start + step] @ w[:, start:start + step].T).astype(mx.float16)
    return {"y": acc.astype(out_dtype(case.dims))}


def split_when_many_for(bits: int):
    def split_when_many(case):
        """Planted: when more than one row shares the call, K is summed in two halves (as split-K GEMMs do)."""
        import mlx.core as mx

        if case.rows <= 1:
            return mlx_for(bits)(case)
        x = case.array("x")
        if bits == 16:
            w, h = case.array("w"), x.shape[1] // 2
            return {"y": (x[:, :h] @ w[:, :h].T + x[:, h:] @ w[:, h:].T).astype(out_dtype(case.dims))}
        group = case.dims["group"]
        g = case.dims["k"] // group // 2
        cut, h = g * group * bits // 32, g * group

        def half(name, cols, dtype=None):
            # each half its own row-contiguous array: on CUDA MLX 0.32.4 has no quantized_matmul for strided
            # slices, and a control red only because MLX refused the call would prove nothing
            a = mx.array(np.ascontiguousarray(case[name][:, cols]))
            return a.astype(dtype) if dtype is not None else a

        def part(cols_x, cols_w, cols_g):
            return qmm(half("x", cols_x), half("wq", cols_w), half("scales", cols_g, mx.bfloat16),
                       half("biases", cols_g, mx.bfloat16), group, bits)

        y = part(slice(0, h), slice(0, cut), slice(0, g)) + part(slice(h, None), slice(cut, None), slice(g, None))
        return {"y": y.astype(out_dtype(case.dims))}

    return split_when_many


def neighbour_scales_for(bits: int):
    def neighbour_scales(case):
        """Planted: each group dequantized with the next group's scale (off by one group)."""
        import mlx.core as mx

        s = case.array("scales", mx.bfloat16)
        s = mx.concatenate([s[:, 1:], s[:, :1]], axis=1)
        y = qmm(case.array("x"), case.array("wq"), s, case.array("biases", mx.bfloat16), case.dims["group"], bits)
        return {"y": y.astype(out_dtype(case.dims))}

    return neighbour_scales


def _one_group_short(launch: Launch) -> Launch:
    # a whole group: MLX rounds the grid up to whole groups, so one warp short would still launch every warp
    return dataclasses.replace(launch, grid=(max(0, launch.grid[0] - launch.threadgroup[0]), *launch.grid[1:]))


REORDER = swap("for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);",
               "if (rows > 1) { for (int o = 1; o < 32; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o); }\n"
               "      else { for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o); }")
assert CUDA_FOLD.count("v += __shfl_xor_sync") == 1

# The bf16 kernel's planted defects: edits of one line each (the warps' fold, the tail loads)
_WARP_FOLD = "for (int p = 1; p < WARPS; ++p) v += part[p][o / 16][o % 16];"
WARPS_REVERSED_WHEN_MANY = swap(_WARP_FOLD, "if (rows > 1) { v = part[WARPS - 1][o / 16][o % 16];\n"
                                "        for (int p = WARPS - 2; p >= 0; --p) v += part[p][o / 16][o % 16]; }\n"
                                "      else { " + _WARP_FOLD + " }")
FP16_FOLD = swap(_WARP_FOLD,
                 "for (int p = 1; p < WARPS; ++p) v = __half2float(__float2half(v + part[p][o / 16][o % 16]));")
TAIL_DROPPED = swap("const unsigned int lo = (k + 2 * e < K) ? h[k + 2 * e] : 0u;",
                    "const unsigned int lo = (k + 2 * e < K - 1) ? h[k + 2 * e] : 0u;", where="header")

def edges(bits: int) -> tuple[Shape, ...]:
    if bits == 16:
        # K=203 is the one size off the 16-byte chunks: the cuda kernel's element-wise loads and its planted
        # "dropped tail element" run on no other shape; fp32 outputs keep the fp32 bound, where an fp16 fold shows
        sizes = [("1 row", 256, 256, 1, "float32"), ("K=203, not a multiple of 8", 40, 203, 5, "float32"),
                 ("K=264, a part sweep of the lanes", 33, 264, 16, "float32"), ("N=1, K=8", 1, 8, 3, "float32"),
                 ("N=33, off the columns per warp", 33, 256, 7, "float32"),
                 ("fp32 out, K=4096, 9 rows", 64, 4096, 9, "float32"),
                 ("a prompt chunk beside 8 windows: 300 rows", 48, 256, 300, OUT), ("empty", 256, 256, 0, OUT)]
        return tuple(Shape(label, {"n": n, "k": k, "out": out}, rows) for label, n, k, rows, out in sizes)
    sizes = [("1 row", 256, 256, 64, 1), ("K=64, one group", 40, 64, 64, 5),
             ("K=192, N=33", 33, 192, 64, 16), ("group 32", 48, 160, 32, 3), ("group 128", 17, 384, 128, 9),
             ("a prompt chunk beside 8 windows: 300 rows", 48, 256, 64, 300), ("empty", 256, 256, 64, 0)]
    return tuple(Shape(label, {"n": n, "k": k, "group": g, "out": "float32" if rows < 300 else OUT}, rows)
                 for label, n, k, g, rows in sizes)


NOT_INVARIANT_ON_CUDA = Finding("MLX's matmul and quantized_matmul are not row-invariant on CUDA (DESIGN §10): "
                                "the cuda implementation is the exact one there", kind="mlx", gate=4, backend="cuda")
# Seen on the H200 (contract/receipts/h200-2026-11-30, c_q4 and c_q8): y off by about its own size (1.85 in 4-bit,
# 1.98 in 8-bit) on the one edge whose rows hold a single group, while the cuda implementation and the float64
# reference agree on the same packed arrays, MLX agrees on the 13 served shapes (K = 128 and up) and MLX's CPU
# backend agrees at K=64 too. Not yet checked against mx.dequantize on the GPU: docs/kernel-contract.md says how.
ONE_GROUP_ON_CUDA = Finding("MLX 0.32.4's CUDA quantized_matmul is wrong when a row holds one quantization group "
                            "(K=64, group 64): an MLX bug, not ours; the cuda implementation is right there",
                            kind="mlx", gate=3, backend="cuda", case="K=64, one group", symptom=" off by ",
                            mlx="0.32.4")
# The same edge on the H200 on 2026-12-01 (h200-2026-12-01-evening, lfm2 gemv q4): NaN where a value was due
ONE_GROUP_NAN_ON_CUDA = dataclasses.replace(ONE_GROUP_ON_CUDA, symptom="= nan")


def record(family: str, bits: int, shapes: tuple[Shape, ...]) -> KernelRecord:
    """`family`'s GEMV record for bf16 (bits 16) or affine 4/8-bit weights, proven at the shapes it serves."""
    label = "bf16" if bits == 16 else f"q{bits}"
    findings = (NOT_INVARIANT_ON_CUDA,)
    if bits != 16:  # MLX's one-group bug, on the edge and on any served shape of one group (a group rank's)
        one_group = [shape.label for shape in shapes if shape.dims["k"] == shape.dims["group"]]
        findings += tuple(dataclasses.replace(finding, gate=gate, case=case)
                          for finding in (ONE_GROUP_ON_CUDA, ONE_GROUP_NAN_ON_CUDA)
                          for gate, case in ((3, ONE_GROUP_ON_CUDA.case), *((2, c) for c in one_group)))
    common = dict(family=family, make=make_for(bits), reference=reference_for(bits), shapes=shapes,
                  edges=edges(bits), tolerance=tolerance, row_inputs=("x",), max_rows=WIDEST_CALL,
                  findings=findings)
    cuda = [Control("row-count-dependent reduction order", "cuda", 4, REORDER),
            Control("over-sized threadgroup", "cuda", 5, oversize_threadgroup())]
    if bits == 16:
        controls = [
            Control("fp16 accumulator", "mlx", 3, variant(fp16_chunks)),
            Control("row-count-dependent reduction order", "mlx", 4, variant(split_when_many_for(16))),
            Control("dropped tail element", "mlx", 2, variant(mlx_for(16, drop_tail=True))),
            Control("dropped tail element", "cuda", 3, TAIL_DROPPED),
            Control("fp16 accumulator (the warps' fold)", "cuda", 3, FP16_FOLD),
            Control("unwritten last columns (grid one group short)", "cuda", 2, relaunch(_one_group_short)),
            Control("warp sums folded in reverse when many rows", "cuda", 4, WARPS_REVERSED_WHEN_MANY),
            Control("over-sized threadgroup", "cuda", 5, oversize_threadgroup()),
            Control("warp sums folded in reverse when many rows", "metal", 4, WARPS_REVERSED_WHEN_MANY),
            Control("over-sized threadgroup", "metal", 5, oversize_threadgroup()),
        ]
        impls = {"mlx": mlx_for(16), "cuda": source("cuda", 16), "metal": source("metal", 16)}
    else:
        nibble = ("(q >> (4 * j)) & 15u", "(q >> (4 * (7 - j))) & 15u") if bits == 4 else \
            ("(q.x >> (8 * j)) & 255u", "(q.x >> (8 * (3 - j))) & 255u")
        controls = [
            Control("scale of the neighbouring group", "mlx", 2, variant(neighbour_scales_for(bits))),
            Control("row-count-dependent reduction order", "mlx", 4, variant(split_when_many_for(bits))),
            Control("packed values read in the wrong order", "cuda", 2, swap(*nibble)),
            *cuda,
            Control("over-sized threadgroup", "metal", 5, oversize_threadgroup()),
        ]
        impls = {"mlx": mlx_for(bits), "cuda": source("cuda", bits), "metal": source("metal", bits)}
    return KernelRecord(name=f"{family} gemv {label}", implementations=impls, controls=tuple(controls),
                        description=f"y = x w^T for any number of rows, {label} weights, fp32 sums rounded once to the "
                                    "output dtype (bf16 served, fp32 at edges); each row's result independent of the "
                                    "row count", **common)

