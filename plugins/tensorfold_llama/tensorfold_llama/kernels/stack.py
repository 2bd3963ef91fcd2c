"""The llama family's stack of its layers' new keys and values (tensorfold_core.row_kernels.stack) at its sizes."""

from __future__ import annotations

from tensorfold_contract import Shape
from tensorfold_core.row_kernels import stack
from tensorfold_core.row_kernels.gemv import WIDEST_CALL

from .common import LLAMA_1B, LLAMA_8B, TINY, TINY_DRAFTER


def _shape(label: str, model: dict, layers: int, dtype: str = "bfloat16", heavy: bool = False) -> Shape:
    dims = {"layers": layers, "kv_heads": model["kv_heads"], "head_dim": model["head_dim"], "dtype": dtype}
    return Shape(label, dims, WIDEST_CALL, heavy)


RECORD = stack.record("llama", (
    _shape("tiny, 8 layers", TINY, 8), _shape("tiny fp32, 8 layers", TINY, 8, "float32"),
    _shape("tiny drafter, 4 layers", TINY_DRAFTER, 4), _shape("1B, 16 layers", LLAMA_1B, 16),
    _shape("8B, 32 layers", LLAMA_8B, 32, heavy=True),
))
