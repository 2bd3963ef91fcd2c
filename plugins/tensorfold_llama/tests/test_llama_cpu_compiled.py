"""On the CPU the llama layers' cache-free parts run compiled, q and k roped there a row at a time, and the logits are
the op-by-op layers' bit for bit; a machine where MLX cannot build kernels runs them op by op."""

from __future__ import annotations

import mlx.core as mx
import pytest

from tensorfold_core.kernels import KERNELS_ENV
from tensorfold_core.loading import load_model
from tensorfold_core.row_kernels.modules import COMPILE_ENV, ROPE_ROWS_ENV, ShapeCompiled, cpu_compiles
from tensorfold_core.specs import LoadOptions
from tensorfold_core.testing import logits_alike

PROMPTS = ["import os\nimport", "def main(argv):\n", "class Point:\n    def __init__(self"]


@pytest.fixture
def as_shipped(monkeypatch):
    for env in (COMPILE_ENV, KERNELS_ENV, ROPE_ROWS_ENV):
        monkeypatch.delenv(env, raising=False)


def test_on_the_cpu_the_table_compiles_each_layer_s_parts_once_a_row_count(as_shipped, monkeypatch):
    for table in ("table", "records"):  # the CPU serves MLX's ops or the records' mlx implementations
        monkeypatch.setenv(KERNELS_ENV, table)
        model, _, _ = load_model("tiny-llama", LoadOptions(dtype="bfloat16"))
        assert all(isinstance(half, ShapeCompiled) for half in model.model.layers[0].halves)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_the_cpu_q_and_k_are_roped_a_row_at_a_time_in_the_compiled_part_with_the_logits_of_a_rope_a_stream(
        as_shipped, monkeypatch, dtype):
    served, tokenizer, _ = load_model("tiny-llama", LoadOptions(dtype=dtype))
    monkeypatch.setenv(ROPE_ROWS_ENV, "0")
    per_stream, _, _ = load_model("tiny-llama", LoadOptions(dtype=dtype))
    monkeypatch.setenv(COMPILE_ENV, "0")
    op_by_op, _, _ = load_model("tiny-llama", LoadOptions(dtype=dtype))
    assert served.model.layers[0].self_attn.roped and not per_stream.model.layers[0].self_attn.roped
    assert op_by_op.model.layers[0].halves is None and not op_by_op.model.layers[0].self_attn.roped
    assert logits_alike([served, per_stream, op_by_op], [tokenizer.encode(text) for text in PROMPTS])


def test_a_cpu_where_mlx_cannot_build_kernels_serves_its_layers_op_by_op_and_says_why(as_shipped, monkeypatch,
                                                                                      caplog):
    def no_compiler(fn):
        raise RuntimeError("[Compile::eval_cpu] Failed to compile function")

    monkeypatch.setattr(mx, "compile", no_compiler)
    cpu_compiles.cache_clear()
    try:
        model, _, _ = load_model("tiny-llama", LoadOptions(dtype="bfloat16"))
    finally:
        cpu_compiles.cache_clear()  # the next test asks MLX again, as a fresh process would
    assert model.model.layers[0].halves is None and not model.model.layers[0].self_attn.roped  # op by op
    assert "Failed to compile function" in caplog.text
