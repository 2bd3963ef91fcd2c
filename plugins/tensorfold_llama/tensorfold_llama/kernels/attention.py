"""The llama family's window attention records: the shared fixed-split attention at the heads llama serves, one stream a
call and every stream of a forward in one call."""

from __future__ import annotations

from tensorfold_core.row_kernels import attention_streams as streams
from tensorfold_core.row_kernels.attention_streams import STREAMS_ATTENTION  # noqa: F401
from tensorfold_core.row_kernels.attention import (SPLIT, WINDOW_ATTENTION, mlx_window_attention,  # noqa: F401
                                                   record, reference, shape)

from .common import LLAMA_1B, LLAMA_8B, TINY, TINY_DRAFTER

RECORD = record("llama", (
    shape("tiny fp32, 40 keys", TINY, 40, "float32"),
    shape("tiny bf16, 700 keys", TINY, 700),
    shape("tiny bf16, 2048 keys", TINY, 2048),
    shape("tiny drafter bf16, 300 keys", TINY_DRAFTER, 300),
    shape("tiny bf16, sliding window 300, 700 keys", TINY, 700, window=300),
    shape("1B bf16, 600 keys", LLAMA_1B, 600),
    shape("1B bf16, 4096 keys", LLAMA_1B, 4096, heavy=True),
    shape("1B fp32, 1500 keys", LLAMA_1B, 1500, "float32", heavy=True),
    shape("8B bf16, 4096 keys", LLAMA_8B, 4096, heavy=True),
    shape("mistral bf16, sliding window 4096, 4500 keys", LLAMA_8B, 4500, window=4096, heavy=True),
))

# the same sums for every stream of a forward in one launch (tensorfold_core.row_kernels.attention_streams)
STREAMS = streams.record("llama", (
    # fp32 (--dtype float32): its output keeps every fp32 bit, where a reordered sum shows at gate 4
    streams.shape("tiny fp32, 3 streams, 500 keys", TINY, 500, 3, "float32"),
    streams.shape("tiny bf16, 3 streams, 700 keys", TINY, 700, 3),
    streams.shape("tiny bf16, 8 streams, 300 keys", TINY, 300, 8),
    streams.shape("tiny drafter bf16, 4 streams, 300 keys", TINY_DRAFTER, 300, 4),
    streams.shape("tiny bf16, sliding window 300, 2 streams, 700 keys", TINY, 700, 2, window=300),
    streams.shape("1B bf16, 8 streams, 600 keys", LLAMA_1B, 600, 8),
    streams.shape("1B bf16, 4 streams, 4096 keys", LLAMA_1B, 4096, 4, heavy=True),
    streams.shape("8B bf16, 8 streams, 4096 keys", LLAMA_8B, 4096, 8, heavy=True),
))
