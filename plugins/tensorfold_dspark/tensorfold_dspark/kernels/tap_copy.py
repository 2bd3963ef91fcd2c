"""The target's tap copy under contract: the tapped layers' rows side by side, every bit as the layer wrote it."""

from __future__ import annotations

import numpy as np

from tensorfold_contract import Control, KernelRecord, Launch, Shape, Source, oversize_threadgroup, swap, variant
from tensorfold_contract.helpers import groups, int_array, mx_dtype, rounded, row_scales

from .tap_copy_sources import CUDA, METAL

THREADS = 256
# MLX builds a custom kernel for a fixed list of input names, so the sources take MAX_TAPS named taps and the call's
# count as a template constant. Separate inputs are the layers' outputs as the forward holds them: one stacked input
# would need the very copy this kernel makes. The drafters served here tap 3 or 5 layers.
MAX_TAPS = 8
NAMES = (*(f"tap{j}" for j in range(MAX_TAPS)), "dims")
TINY = dict(taps=3, hidden=256)  # the shipped tiny-lfm2-moe target and its drafter
LFM2_24B = dict(taps=5, hidden=2048)  # LiquidAI's LFM2.5-24B-A2B and its DSpark drafter
# planted in every row of every tap: -0 (a copy through float arithmetic may lose its sign), a subnormal in bf16 and
# fp32 alike (flushed by fast math), values past fp16's range, and inf
SPECIAL = (-0.0, 2.0 ** -133, 1e5, -3e38, np.inf)


def make(dims, rows, rng):
    """Each tap's rows like a residual stream's (N(0, 1) at row scales of 10^-2..10^2), with SPECIAL planted."""
    host = {}
    for j in range(dims["taps"]):
        x = rng.standard_normal((rows, dims["hidden"]), np.float32) * row_scales(rng, rows)
        spread = dims["hidden"] // len(SPECIAL)  # distinct columns, so no planted value covers another
        at = (rng.integers(0, dims["hidden"], (rows, 1)) + spread * np.arange(len(SPECIAL))) % dims["hidden"]
        x[np.arange(rows)[:, None], at] = SPECIAL
        host[f"tap{j}"] = rounded(x, dims["dtype"])
    return host


def _bits(a: np.ndarray, dtype: str) -> np.ndarray:
    """The bit patterns of host values exact in `dtype` (float32 or bfloat16, the high half of a float32)."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    return (u >> np.uint32(16) if dtype == "bfloat16" else u).astype(np.int64)


def reference(case):
    taps = [case[f"tap{j}"] for j in range(case.dims["taps"])]
    return {"out": np.concatenate([t.astype(np.float64) for t in taps], axis=-1),
            "bits": np.concatenate([_bits(t, case.dims["dtype"]) for t in taps], axis=-1)}


def _outputs(out, dtype: str) -> dict:
    """The copy's values, and its bits: equal values may still differ in the sign of a zero."""
    import mlx.core as mx

    return {"out": out, "bits": out.view(mx.uint16 if dtype == "bfloat16" else mx.uint32)}


# --- mlx: the forward's own tap copy, lfm2.tapped_rows ----------------------------------------------------------------


def _tapped(case, layers=None):
    """lfm2.tapped_rows over the case's taps, as the forward calls it on the layers' outputs (keyed by layer)."""
    from tensorfold_lfm2.lfm2 import tapped_rows

    dt = mx_dtype(case.dims["dtype"])
    outputs = {j: case.array(f"tap{j}", dt) for j in range(case.dims["taps"])}
    return tapped_rows(outputs, range(case.dims["taps"]) if layers is None else layers)


def mlx_tap_copy(case):
    return _outputs(_tapped(case), case.dims["dtype"])


def taps_swapped(case):
    """Planted: the first two taps' columns swapped."""
    taps = case.dims["taps"]
    return _outputs(_tapped(case, (1, 0, *range(2, taps)) if taps > 1 else None), case.dims["dtype"])


def last_row_dropped(case):
    """Planted: the call's last row left zero."""
    import mlx.core as mx

    out = _tapped(case)
    if case.rows:
        out = mx.concatenate([out[:-1], mx.zeros_like(out[-1:])])
    return _outputs(out, case.dims["dtype"])


def through_fp16(case):
    """Planted: the rows rounded through fp16 on their way (a copy kernel instantiated for half)."""
    import mlx.core as mx

    return _outputs(_tapped(case).astype(mx.float16).astype(mx_dtype(case.dims["dtype"])), case.dims["dtype"])


def offset_by_row_count(case):
    """Planted: a call of k rows reads its rows from row k // 8 on, wrapping (right only below 8 rows)."""
    import mlx.core as mx

    out, k = _tapped(case), case.rows
    return _outputs(out[(mx.arange(k) + k // 8) % k] if k else out, case.dims["dtype"])


# --- cuda, metal: tap_copy_sources ------------------------------------------------------------------------------------


def _inputs(case):
    dt = mx_dtype(case.dims["dtype"])
    taps = [case.array(f"tap{j}", dt) for j in range(case.dims["taps"])]
    return [*taps, *taps[:1] * (MAX_TAPS - len(taps)), int_array([case.rows, case.dims["hidden"]])]


def _launch(case):
    taps, hidden, dt = case.dims["taps"], case.dims["hidden"], mx_dtype(case.dims["dtype"])
    if not 1 <= taps <= MAX_TAPS:
        raise ValueError(f"{taps} taps: the sources take 1 to {MAX_TAPS}")
    return Launch(grid=(groups(case.rows * taps * hidden, THREADS) * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
                  output_shapes=((case.rows, taps * hidden),), output_dtypes=(dt,),
                  template=(("T", dt), ("TAPS", taps)))


def source(kind: str) -> Source:
    return Source("dspark_tap_copy", NAMES, ("out",), CUDA if kind == "cuda" else METAL, inputs=_inputs,
                  launch=_launch, finish=lambda outs, case: _outputs(outs[0], case.dims["dtype"]))


# The sources' planted defects (both sources choose the tap by the same text)
TAPS_SWAPPED = swap("j == 0 ? tap0 : j == 1 ? tap1", "j == 0 ? tap1 : j == 1 ? tap0")
CUDA_FP16 = swap("out[i] = tap[r * hidden + (c - j * hidden)];",
                 "out[i] = static_cast<T>(__half2float(__float2half(static_cast<float>(tap[r * hidden + "
                 "(c - j * hidden)]))));")


def _shape(label, model, rows, dtype="bfloat16"):
    return Shape(label, {**model, "dtype": dtype}, rows)


SERVED = tuple(_shape(f"{name} {dtype}, {rows} row{'s' * (rows > 1)}", model, rows, dtype)
               for name, model, dtypes in (("LFM2.5-24B-A2B five taps", LFM2_24B, ("bfloat16",)),
                                           ("tiny pair three taps", TINY, ("bfloat16", "float32")))
               for dtype in dtypes for rows in (1, 10, 32, 2048))

RECORD = KernelRecord(
    name="dspark tap copy",
    family="dspark",
    description="the target's tapped layers' rows side by side for the drafter: out[r, j hidden:(j + 1) hidden] = "
                "tap j's row r, bit for bit (the forward's lfm2.tapped_rows)",
    make=make,
    reference=reference,
    implementations={"mlx": mlx_tap_copy, "cuda": source("cuda"), "metal": source("metal")},
    shapes=SERVED,
    edges=(_shape("1 row", TINY, 1, "float32"), _shape("one tap", {**TINY, "taps": 1}, 5),
           _shape("hidden 257, off the group", {**TINY, "hidden": 257}, 7, "float32"),
           _shape("eight taps of 96", {"taps": MAX_TAPS, "hidden": 96}, 3), _shape("empty", LFM2_24B, 0)),
    row_inputs=NAMES[:-1],
    controls=(
        Control("columns of two taps swapped", "mlx", 2, variant(taps_swapped)),
        Control("last row dropped", "mlx", 2, variant(last_row_dropped)),
        Control("values rounded through fp16", "mlx", 2, variant(through_fp16)),
        Control("row offset that follows the row count", "mlx", 4, variant(offset_by_row_count)),
        Control("columns of two taps swapped", "cuda", 2, TAPS_SWAPPED),
        Control("last row dropped", "cuda", 2, swap("if (i >= (size_t)rows * width) return;",
                                                    "if (i >= (size_t)(rows - 1) * width) return;")),
        Control("values rounded through fp16", "cuda", 2, CUDA_FP16),
        Control("row offset that follows the row count", "cuda", 4,
                swap("const size_t r = i / width;", "const size_t r = (i / width + rows / 8) % rows;")),
        Control("over-sized threadgroup", "cuda", 5, oversize_threadgroup()),
        Control("columns of two taps swapped", "metal", 2, TAPS_SWAPPED),
        Control("last row dropped", "metal", 2, swap("if (i >= (ulong)rows * width) return;",
                                                     "if (i >= (ulong)(rows - 1) * width) return;")),
        Control("over-sized threadgroup", "metal", 5, oversize_threadgroup()),
    ),
)
