"""The llama records' kernel sources: the text MLX would compile, and (where nvcc is here) that it compiles."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from tensorfold_contract import gates, nvcc
from tensorfold_contract.registry import discover


def _llama(name):
    return next(r for r in discover() if r.record is not None and r.record.name == name)


def test_the_generated_cuda_text_wraps_the_body_in_mlx_s_signature_and_template_constants():
    record = _llama("llama gemv q4").record
    source = record.implementations["cuda"]
    case = gates.make_case(record, record.shapes[0], 5, np.random.default_rng(0))
    text = nvcc.generated(source, "k", source.inputs(case), source.launch(case))
    assert "__global__ void k(\n    const __nv_bfloat16* x,\n    const uint32_t* wq," in text
    assert "    const int32_t* dims,\n    __nv_bfloat16* y) {" in text  # served projections give bf16 back
    assert "constexpr int MAXR = 8;" in text and "constexpr int BITS = 4;" in text
    assert text.rstrip().endswith("} // namespace mlx::core::cu")


def test_every_llama_source_launch_declares_the_shared_memory_its_body_uses():
    for reg in discover():
        record = reg.record
        for kind, impl in (record.implementations.items() if record else ()):
            if isinstance(impl, gates.Source):
                launch = impl.launch(gates.Case(record.shapes[0], 16, {}, record.row_inputs))
                uses = "__shared__" in impl.body or "threadgroup float" in impl.body or "threadgroup int" in impl.body
                assert (launch.static_shared > 0) == uses, (record.name, kind)


@pytest.mark.skipif(not (shutil.which("nvcc") and os.environ.get("TENSORFOLD_MLX_CUDA_INCLUDE")),
                    reason="needs nvcc and TENSORFOLD_MLX_CUDA_INCLUDE (MLX's CUDA device headers)")
def test_the_argmax_cuda_source_and_its_planted_controls_compile_for_sm90():
    include = os.environ["TENSORFOLD_MLX_CUDA_INCLUDE"]
    assert nvcc.main(["--include", include, "--quick", "--only", "llama greedy argmax"]) == 0
