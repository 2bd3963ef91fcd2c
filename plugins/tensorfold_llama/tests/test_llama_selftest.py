"""A kernel record that misses its reference on this machine at load serves nothing: MLX's own op does, with a warning."""

from __future__ import annotations

import dataclasses

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
