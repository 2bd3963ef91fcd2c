"""Every metal source, wrapped as MLX's metal_kernel wraps it, checks as C++ over a stand-in for Metal's language."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tensorfold_contract.gates import make_case
from tensorfold_contract.metal import check, check_one, generated
from tensorfold_contract.metal_shim import compiler
from tensorfold_contract.registry import discover

needs_compiler = pytest.mark.skipif(compiler() is None, reason="no C++ compiler on this machine")


def _record(name: str):
    return next(r.record for r in discover() if r.record is not None and r.record.name == name)


def _text(record, source, rows: int = 3) -> str:
    case = make_case(record, record.shapes[0], rows, np.random.default_rng(0))
    served = source.at(case)
    return generated(served, "k", served.inputs(case), served.launch(case))


@needs_compiler
def test_every_metal_source_and_planted_metal_control_checks_as_cpp():
    results = check()
    failed = [(label, log) for label, ok, log in results if not ok]
    assert not failed, failed[0]
    assert len(results) > 100 and any("rmsnorm [metal]" in label for label, _, _ in results)
    assert any("[control " in label for label, _, _ in results)


@needs_compiler
def test_a_body_naming_a_thread_attribute_mlx_never_declares_fails_the_check():
    record = _record("llama rmsnorm")
    metal = record.implementations["metal"]
    ok, _ = check_one(_text(record, metal), compiler())
    assert ok
    # simd_lane_id is MSL's usual name for the lane, but MLX adds no such argument: on an Apple GPU this is an error
    slipped = dataclasses.replace(metal, body=metal.body.replace("thread_index_in_simdgroup", "simd_lane_id"))
    ok, log = check_one(_text(record, slipped), compiler())
    assert not ok and "simd_lane_id" in log


@needs_compiler
@pytest.mark.parametrize("edit, found", [(("metal::fma(v, v, ss)", "metal::fma(v, v)"), "fma"),
                                         (("float ss = 0.0f;", "double ss = 0.0;"), "metal_has_no_double"),
                                         (("threadgroup float part[32];", "threadgroup float part[d];"), "variable")])
def test_what_metal_refuses_fails_the_check(edit, found):
    record = _record("llama rmsnorm")
    metal = record.implementations["metal"]
    slipped = dataclasses.replace(metal, body=metal.body.replace(*edit))
    assert slipped.body != metal.body
    ok, log = check_one(_text(record, slipped), compiler())
    assert not ok and found in log


def test_the_wrapper_passes_small_inputs_as_constant_and_declares_only_the_attributes_a_body_names():
    record = _record("llama rmsnorm")
    text = _text(record, record.implementations["metal"])
    signature = text[text.index("void k("):text.index(") {", text.index("void k("))]
    # fewer than 8 elements go in MLX's constant address space; the rows in device memory
    assert "const constant float* eps" in signature and "const constant int32_t* dims" in signature
    assert "const device float* x" in signature and "device float* out" in signature
    assert "uint thread_index_in_simdgroup" in signature and "uint3 threadgroup_position_in_grid" in signature
    assert "thread_position_in_grid" not in signature.replace("threadgroup_position_in_grid", "")  # not named
