"""What the lfm2 kernel records share: the served model sizes (the rest comes from tensorfold_contract.helpers)."""

from __future__ import annotations

from tensorfold_contract.helpers import (BF16_ULP, DTYPES, EPS32, WIDEST, bf16, groups, int_array,  # noqa: F401
                                         kept_array, mx_dtype, rounded, row_scales, spacing)

# The sizes the lfm2 families serve: the shipped tiny models (models/*/config.json: tiny-lfm2 and tiny-lfm2-moe share
# hidden 256 and conv_L_cache 3; the MoE routes 8 experts, top 2, normalised, scale 1) and the public checkpoints
# the GPU machines serve (LFM2-1.2B: hidden 2048, conv_L_cache 3; LFM2-8B-A1B: 32 experts, top 4).
TINY_LFM2 = dict(hidden=256, conv_L=3, heads=8, kv_heads=2, head_dim=32, ff=512, vocab=8192)
LFM2_1B = dict(hidden=2048, conv_L=3, heads=32, kv_heads=8, head_dim=64, ff=8192, vocab=65536)
TINY_MOE_MLP = dict(dense_ff=512, expert_ff=192)  # tiny-lfm2-moe: its two dense layers' width, each expert's
TINY_MOE = dict(experts=8, top_k=2, norm=True, scale=1.0)
MOE_32 = dict(experts=32, top_k=4, norm=True, scale=1.0)
