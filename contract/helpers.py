"""Helpers kernel records share: the verify window's width, dtype rounding on the host, launch sizes."""

from __future__ import annotations

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


def int_array(values):
    """A small int32 mx.array of sizes a kernel reads (rows, columns, …)."""
    import mlx.core as mx

    return mx.array(np.asarray(values, dtype=np.int32))


def groups(count: int, per_group: int) -> int:
    return -(-count // per_group)


def row_scales(rng: np.random.Generator, rows: int, spread: float = 2.0) -> np.ndarray:
    """Per-row magnitudes across 10^-spread..10^spread, so a kernel meets small and large rows alike."""
    return (10.0 ** rng.uniform(-spread, spread, size=(rows, 1))).astype(np.float32)
