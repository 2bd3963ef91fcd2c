"""The llama family's RMSNorm record: the shared row-invariant norm at the widths llama serves."""

from __future__ import annotations

from tensorfold_core.row_kernels.rmsnorm import record, shape

from .common import LLAMA_1B, LLAMA_8B, TINY, TINY_DRAFTER

RECORD = record("llama", (
    shape("tiny fp32", TINY["hidden"]),
    shape("tiny bf16", TINY["hidden"], "bfloat16"),
    shape("tiny drafter bf16", TINY_DRAFTER["hidden"], "bfloat16"),
    shape("1B bf16", LLAMA_1B["hidden"], "bfloat16"),
    shape("8B bf16", LLAMA_8B["hidden"], "bfloat16", eps=1e-6),
    shape("8B fp32", LLAMA_8B["hidden"], eps=1e-6),
))
