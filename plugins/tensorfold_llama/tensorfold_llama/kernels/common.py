"""What the llama kernel records share: the served model sizes (the rest comes from tensorfold_contract.helpers)."""

from __future__ import annotations

from tensorfold_contract.helpers import (BF16_ULP, DTYPES, EPS32, WIDEST, bf16, groups, int_array,  # noqa: F401
                                         mx_dtype, rounded, row_scales, spacing)

# The sizes the llama family serves: the shipped tiny pair (what CPU runs and CI serve) and the real models the
# GPU machines serve. Real sizes are heavy: composed ops on the CPU backend take seconds on them.
TINY = dict(hidden=256, inter=640, heads=8, kv_heads=2, head_dim=32, vocab=8192)
TINY_DRAFTER = dict(hidden=128, inter=384, heads=4, kv_heads=2, head_dim=32, vocab=8256)
LLAMA_1B = dict(hidden=2048, inter=8192, heads=32, kv_heads=8, head_dim=64, vocab=128256)
LLAMA_8B = dict(hidden=4096, inter=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256)

