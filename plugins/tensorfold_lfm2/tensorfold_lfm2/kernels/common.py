"""What the lfm2 kernel records share: the served model sizes, dtype rounding on the host, small launch helpers."""

from __future__ import annotations

import numpy as np

# The sizes the lfm2 families serve: the shipped tiny models (models/*/config.json: tiny-lfm2 and tiny-lfm2-moe share
# hidden 256 and conv_L_cache 3; the MoE routes 8 experts, top 2, normalised, scale 1) and the public checkpoints
# the GPU machines serve (LFM2-1.2B: hidden 2048, conv_L_cache 3; LFM2-8B-A1B: 32 experts, top 4).
TINY_LFM2 = dict(hidden=256, conv_L=3)
LFM2_1B = dict(hidden=2048, conv_L=3)
TINY_MOE = dict(experts=8, top_k=2, norm=True, scale=1.0)
MOE_32 = dict(experts=32, top_k=4, norm=True, scale=1.0)

WIDEST = 16  # the widest verify window (rows of one forward) the lane core asks for
EPS32 = 2.0 ** -24  # fp32 unit roundoff
BF16_ULP = 2.0 ** -7  # bf16 spacing relative to a value at the bottom of its binade (8 significant bits)
DTYPES = ("float32", "bfloat16")  # the activation dtypes served: float32 (--dtype float32) and the checkpoints' bf16


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
