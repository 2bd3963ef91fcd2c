"""A kernel record that misses its reference on this machine at load serves nothing: MLX's own op does, with a warning."""

from __future__ import annotations

import dataclasses
import json

import mlx.core as mx
import pytest

import tensorfold_llama.serving as serving
from tensorfold_contract.selftest import SELF_TEST_ENV
from tensorfold_core.kernels import KERNELS_ENV
from tensorfold_core.loading import load_model
from tensorfold_core.row_kernels.modules import RecordNorm
from tensorfold_core.specs import LoadOptions
from tensorfold_llama.kernels import records


def _with_wrong_rmsnorm():
    """The family's records, the rmsnorm's mlx implementation planted to scale its rows by 2."""
    out = []
    for record in records():
        if record.name == "llama rmsnorm":
            right = record.implementations["mlx"]
            wrong = {**record.implementations, "mlx": lambda case: {k: v * 2 for k, v in right(case).items()}}
            record = dataclasses.replace(record, implementations=wrong)
        out.append(record)
    return out


@pytest.fixture
def wrong_rmsnorm(monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, "records")  # the CPU serves every record through its mlx implementation
    planted = _with_wrong_rmsnorm()
    monkeypatch.setattr(serving, "records", lambda: planted)


def test_a_record_that_misses_its_reference_at_load_leaves_its_op_to_mlx_with_a_warning(wrong_rmsnorm):
    with pytest.warns(RuntimeWarning, match=r"rms_norm: the kernel record 'llama rmsnorm' \(mlx\) missed its "
                                            r"float64 reference on this machine .*MLX's own op serves it instead"):
        model, _, _ = load_model("tiny-llama", LoadOptions(dtype="bfloat16"))
    assert model.kernels["rms_norm"] == "mlx (llama rmsnorm (mlx) failed its load self-test)"
    assert model.kernels["projection bf16"] == "llama gemv bf16 (mlx)"  # the others serve as before
    assert not isinstance(model.model.norm, RecordNorm)
    logits = model.forward([model.new_cache(16)], [[1, 2, 3]], [3])
    assert bool(mx.all(mx.isfinite(logits)).item())


def test_the_self_test_can_be_turned_off_and_then_the_planted_record_serves(wrong_rmsnorm, monkeypatch):
    monkeypatch.setenv(SELF_TEST_ENV, "0")
    model, _, _ = load_model("tiny-llama", LoadOptions(dtype="bfloat16"))
    assert model.kernels["rms_norm"] == "llama rmsnorm (mlx)" and isinstance(model.model.norm, RecordNorm)


def test_every_shipped_record_passes_its_load_self_test_here(monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, "records")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        model, _, _ = load_model("tiny-llama", LoadOptions(dtype="bfloat16"))
    assert not any("self-test" in label for label in model.kernels.values())


def _gemv():
    """A fresh copy of the bf16 GEMV record (the self-test's verdicts are kept a process by record)."""
    return dataclasses.replace(next(r for r in records() if r.name == "llama gemv bf16"))


def test_a_gpu_kernel_s_remembered_pass_serves_it_without_a_run_and_only_for_the_same_text(tmp_path, monkeypatch):
    from tensorfold_contract import selftest

    remembered = tmp_path / "self-test.json"
    monkeypatch.setenv(selftest.SELF_TEST_CACHE_ENV, str(remembered))
    gemv = _gemv()
    assert selftest.failures([gemv], "cuda")  # no CUDA here: its case cannot run, so it fails, and is not remembered
    assert not remembered.exists()
    key = selftest.source_key(gemv, "cuda", *selftest.one_case(gemv))
    remembered.write_text(json.dumps({key: "llama gemv bf16 (cuda), as a GPU's load wrote it"}))
    assert selftest.failures([_gemv()], "cuda") == {}  # the pass remembered for this text, launch and device
    source = gemv.implementations["cuda"]
    edited = dataclasses.replace(gemv, implementations={
        **gemv.implementations, "cuda": dataclasses.replace(source, body=source.body.replace("+=", "-=", 1))})
    assert selftest.failures([edited], "cuda")  # another text is another key: run, and failed here
    monkeypatch.setenv(selftest.SELF_TEST_CACHE_ENV, "0")
    assert selftest.failures([_gemv()], "cuda")  # nothing remembered is read


def test_a_composed_ops_pass_is_not_remembered_and_a_broken_file_is_read_as_empty(tmp_path, monkeypatch):
    from tensorfold_contract import selftest

    remembered = tmp_path / "self-test.json"
    monkeypatch.setenv(selftest.SELF_TEST_CACHE_ENV, str(remembered))
    assert selftest.failures([_gemv()], "mlx") == {}
    assert not remembered.exists()  # MLX's ops are cheap to run and are not one text
    remembered.write_text("{not json")
    assert selftest.failures([_gemv()], "cuda") and remembered.read_text() == "{not json"
