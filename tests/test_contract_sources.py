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


def test_a_bf16_gemv_launch_takes_its_k_split_from_its_shape_never_from_its_rows(monkeypatch):
    from tensorfold_core.row_kernels import gemv

    monkeypatch.delenv(gemv.NARROW_ENV, raising=False)
    records = [reg.record for reg in discover() if reg.record is not None and "gemv bf16" in reg.record.name]
    assert records
    for record in records:
        source = record.implementations["cuda"]
        for shape in (*record.shapes, *record.edges):
            n = shape.dims["n"]
            templates = [dict(source.launch(gates.Case(shape, rows, {}, record.row_inputs)).template)
                         for rows in (1, 2, 5, 8, 9, 16, 17, 64, 128)]
            wanted = gemv.NARROW_WARPS if n < gemv.NARROW_COLUMNS else gemv.WARPS
            assert {t["WARPS"] for t in templates} == {wanted}, (record.name, shape.label, templates)
            paired = "swiglu" in record.name or "rope" in record.name  # these folds pair two tiles a warp
            if n < gemv.NARROW_COLUMNS and not paired:
                assert {t["MT"] for t in templates} == {gemv.NARROW_TILES}, (record.name, shape.label, templates)


def test_past_16_rows_a_wide_bf16_gemv_block_takes_32_rows_and_a_narrow_one_keeps_its_16_row_blocks(monkeypatch):
    from tensorfold_core.row_kernels import gemv

    for name in (gemv.NARROW_ENV, gemv.MAXT_ENV, gemv.STEPS_ENV):
        monkeypatch.delenv(name, raising=False)
    wide, narrow = gemv.NARROW_COLUMNS, gemv.NARROW_COLUMNS - 1
    for rows in (17, 40, 64, 300):
        assert gemv.geometry(wide, rows)[1:] == (4, 2, 1)
        assert gemv.geometry(narrow, rows) == gemv.geometry(narrow, 16)
    monkeypatch.setenv(gemv.MAXT_ENV, "2")
    assert gemv.geometry(wide, 40) == gemv.geometry(wide, 16)


def test_up_to_16_rows_a_wide_bf16_gemv_warp_loads_one_step_at_a_time_and_a_narrow_one_two(monkeypatch):
    from tensorfold_core.row_kernels import gemv

    for name in (gemv.NARROW_ENV, gemv.MAXT_ENV, gemv.STEPS_ENV):
        monkeypatch.delenv(name, raising=False)
    wide, narrow = gemv.NARROW_COLUMNS, gemv.NARROW_COLUMNS - 1
    for rows in (1, 8, 9, 16):
        assert gemv.geometry(wide, rows)[3] == 1
        assert gemv.geometry(narrow, rows)[3] == 2
    monkeypatch.setenv(gemv.NARROW_ENV, "8")  # a narrow call on the 8-warp split loads as the wide ones do
    assert gemv.geometry(narrow, 4)[3] == 1
    monkeypatch.setenv(gemv.STEPS_ENV, "2")  # the measurement knob still sets every split's
    assert gemv.geometry(wide, 4)[3] == gemv.geometry(narrow, 4)[3] == 2


def test_every_bf16_gemv_launch_fits_its_backend_s_static_shared_memory_at_any_row_count(monkeypatch):
    # a static ask past 48 KB is refused at launch on CUDA, past 32 KB on Apple's GPUs; deep row tiles and the
    # fusions' own buffers add up
    from tensorfold_core.row_kernels import gemv

    for name in (gemv.NARROW_ENV, gemv.MAXT_ENV):
        monkeypatch.delenv(name, raising=False)
    records = [reg.record for reg in discover() if reg.record is not None and "gemv bf16" in reg.record.name]
    for record in records:
        for kind in ("cuda", "metal"):
            source = record.implementations[kind]
            for shape in (*record.shapes, *record.edges):
                for rows in (1, 8, 9, 16, 17, 32, 33, 64, 128):
                    launch = source.launch(gates.Case(shape, rows, {}, record.row_inputs))
                    limit = 48 * 1024 if kind == "cuda" else 32 * 1024
                    assert launch.static_shared <= limit, (record.name, kind, shape.label, rows, launch.static_shared)


@pytest.mark.skipif(not (shutil.which("nvcc") and os.environ.get("TENSORFOLD_MLX_CUDA_INCLUDE")),
                    reason="needs nvcc and TENSORFOLD_MLX_CUDA_INCLUDE (MLX's CUDA device headers)")
def test_every_bf16_gemv_build_fits_the_registers_an_sm90_block_may_hold():
    # a launch asking more fails on the device ("too many resources"), as a 32-warp split did on the H200
    assert nvcc.main(["--include", os.environ["TENSORFOLD_MLX_CUDA_INCLUDE"], "--only", "*gemv bf16*"]) == 0


def test_the_normed_gemv_sums_its_norm_over_the_rmsnorm_record_s_threads_whatever_its_k_split():
    # so the fold equals the rmsnorm record then the GEMV bit for bit (bench_normed_gemv checks it on CUDA)
    from tensorfold_core.row_kernels import gemv, gemv_normed, rmsnorm

    record = _llama("llama gemv bf16 rmsnorm").record
    shape = next(s for s in record.shapes if s.dims["n"] < gemv.NARROW_COLUMNS)
    for kind, norm in (("cuda", gemv_normed._CUDA_INV), ("metal", gemv_normed._METAL_INV)):
        source = record.implementations[kind]
        assert dict(source.launch(gates.Case(shape, 4, {}, record.row_inputs)).template)["WARPS"] == 16
        assert norm in source.body and "NW" in norm and "WARPS" not in norm, kind
        assert f"constexpr int NW = {rmsnorm.THREADS // 32};" in source.body


def test_a_gemv_load_flavour_changes_the_bf16_header_s_16_byte_load_and_nothing_else():
    from tensorfold_core.row_kernels.gemv_sources import LOAD_ENV, LOADS, bf16_header

    plain = bf16_header("plain").splitlines()
    for load in set(LOADS) - {"plain"}:
        hinted = bf16_header(load).splitlines()
        changed = [(a, b) for a, b in zip(plain, hinted) if a != b]
        assert len(hinted) == len(plain) and len(changed) == 1, load
        assert LOADS[load] in changed[0][1] and "reinterpret_cast<const uint4*>" in changed[0][0]
    with pytest.raises(ValueError, match=LOAD_ENV):
        bf16_header("l2-512")
