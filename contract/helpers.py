"""Helpers kernel records share: the verify window's width, dtype rounding on the host, launch sizes."""

from __future__ import annotations

import os

import numpy as np

WIDEST = 16  # the widest verify window (rows of one forward) the lane core asks for
EPS32 = 2.0 ** -24  # fp32 unit roundoff
BF16_ULP = 2.0 ** -7  # bf16 spacing relative to a value at the bottom of its binade (8 significant bits)
DTYPES = ("float32", "bfloat16")  # the activation dtypes families serve: --dtype float32 and checkpoints' bf16


def bf16(a: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest bfloat16 (ties to even), kept as float32: exact on either side."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return rounded.view(np.float32)


def rounded(a: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values exactly representable in `dtype` ("float32" or "bfloat16")."""
    a = np.asarray(a, dtype=np.float32)
    return bf16(a) if dtype == "bfloat16" else a


def spacing(dtype: str) -> float:
    """The dtype's spacing at 1.0 (an upper bound of one ulp of any value below 2 in magnitude)."""
    return 2.0 ** -7 if dtype == "bfloat16" else 2.0 ** -23


def mx_dtype(name: str):
    import mlx.core as mx

    return {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}[name]


PAD_ENV = "TENSORFOLD_PAD_INPUTS"  # =0 keeps a kernel's small inputs at their own size (a measurement)
SMALLEST_BUFFER = 16  # bytes: MLX's CUDA allocator serves 8 or fewer from one shared managed-memory pool


def kernel_array(values, dtype) -> "mx.array":
    """A small constant a kernel reads (sizes, a scale, an eps), `values` as they are, in a buffer of at least
    SMALLEST_BUFFER bytes. MLX's CUDA allocator puts arrays of 8 bytes or less in one managed-memory pool that every
    new scalar the host makes shares, and a kernel reading one there paid for it at every launch on the H200
    (docs/gpu.md has the figures); a constant in a buffer of its own did not."""
    import mlx.core as mx

    host = np.asarray(values, dtype=dtype)
    if os.environ.get(PAD_ENV, "1") == "0" or host.nbytes >= SMALLEST_BUFFER:
        return mx.array(host)
    padded = np.zeros(-(-SMALLEST_BUFFER // host.itemsize), host.dtype)
    padded[:host.size] = host.reshape(-1)
    flat = mx.array(padded)[:host.size]  # a view: the kernel reads the padded buffer
    return flat if host.ndim == 1 else flat.reshape(host.shape)


def kept_array(values, dtype) -> "mx.array":
    """kernel_array, evaluated now: for a constant a cache keeps past the call that made it."""
    import mlx.core as mx

    # MLX's streams are per thread: an unevaluated view made on the loading thread fails when the server's engine
    # thread evaluates it ("There is no Stream(gpu, 0) in current thread")
    array = kernel_array(values, dtype)
    mx.eval(array)
    return array


def int_array(values):
    """A small int32 mx.array of sizes a kernel reads (rows, columns, …), in a buffer of its own (kernel_array)."""
    return kernel_array(values, np.int32)


def groups(count: int, per_group: int) -> int:
    return -(-count // per_group)


def row_scales(rng: np.random.Generator, rows: int, spread: float = 2.0) -> np.ndarray:
    """Per-row magnitudes across 10^-spread..10^spread, so a kernel meets small and large rows alike."""
    return (10.0 ** rng.uniform(-spread, spread, size=(rows, 1))).astype(np.float32)
