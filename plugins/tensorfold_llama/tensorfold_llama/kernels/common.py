"""What the llama kernel records share: the served model sizes, bf16 rounding on the host, small launch helpers."""

from __future__ import annotations

import numpy as np

# The sizes the llama family serves: the shipped tiny pair (what CPU runs and CI serve) and the real models the
# GPU machines serve. Real sizes are heavy: composed ops on the CPU backend take seconds on them.
TINY = dict(hidden=256, inter=640, heads=8, kv_heads=2, head_dim=32, vocab=8192)
TINY_DRAFTER = dict(hidden=128, inter=384, heads=4, kv_heads=2, head_dim=32, vocab=8256)
LLAMA_1B = dict(hidden=2048, inter=8192, heads=32, kv_heads=8, head_dim=64, vocab=128256)
LLAMA_8B = dict(hidden=4096, inter=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256)

WIDEST = 16  # the widest verify window (rows of one forward) the lane core asks for
EPS32 = 2.0 ** -24  # fp32 unit roundoff
BF16_ULP = 2.0 ** -7  # bf16 spacing relative to a value at the bottom of its binade (8 significant bits)


def bf16(a: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest bfloat16 (ties to even), kept as float32: exact on either side."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return rounded.view(np.float32)


def rounded(a: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values exactly representable in `dtype` ("float32" or "bfloat16")."""
    a = np.asarray(a, dtype=np.float32)
    return bf16(a) if dtype == "bfloat16" else a


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
