"""The tap copy record on the CPU: its mlx implementation is the forward's own copy, checked bit for bit."""

from __future__ import annotations

import os
import shutil

import mlx.core as mx
import numpy as np
import pytest

from tensorfold_contract import Case, Shape, gates
from tensorfold_core.checkpoint import Checkpoint
from tensorfold_core.specs import LoadOptions
from tensorfold_core.testing import PROMPT
from tensorfold_dspark.kernels import tap_copy
from tensorfold_dspark.kernels.tap_copy import RECORD, mlx_tap_copy
from tensorfold_dspark.plugin import MODELS
from tensorfold_lfm2 import lfm2
from tensorfold_lfm2.load import load
from tensorfold_lfm2.plugin import MODELS as TARGETS

DRAFTER, TARGET = MODELS / "tiny-lfm2-moe-dspark", TARGETS / "tiny-lfm2-moe"


def test_the_records_tiny_shape_is_the_shipped_pairs_taps_and_width():
    drafter, target = Checkpoint.open(DRAFTER).config, Checkpoint.open(TARGET).config
    assert len(drafter["dflash_config"]["target_layer_ids"]) == tap_copy.TINY["taps"]
    assert drafter["hidden_size"] == target["hidden_size"] == tap_copy.TINY["hidden"]


def test_the_tap_copy_the_forward_serves_is_the_records_mlx_implementation(monkeypatch):
    calls = []

    def spy(outputs, layers):
        calls.append(({i: outputs[i] for i in layers}, tuple(layers)))
        return served(outputs, layers)

    served = lfm2.tapped_rows
    monkeypatch.setattr(lfm2, "tapped_rows", spy)
    # float32: mlx's CPU backend has no bf16 gather_mm for the target's experts
    model = load(Checkpoint.open(TARGET), LoadOptions(dtype="float32"))
    model.features(Checkpoint.open(DRAFTER).config["dflash_config"]["target_layer_ids"])
    cache = model.new_cache(64)
    model.forward([cache], [PROMPT[:9]], [1])
    (outputs, layers), = calls
    forward = cache.tapped

    host = {f"tap{j}": np.array(outputs[layer]) for j, layer in enumerate(layers)}
    shape = Shape("the forward's", {"taps": len(layers), "hidden": model.hidden_size, "dtype": "float32"}, 9)
    got = mlx_tap_copy(Case(shape, 9, host, RECORD.row_inputs))
    assert len(calls) == 2  # the record's implementation went through the forward's function too
    assert forward.dtype == got["out"].dtype == mx.float32 and forward.shape == (9, 3 * model.hidden_size)
    assert np.array_equal(np.array(forward).view(np.uint32), np.array(got["bits"]))
    model.features([])


def _case(label: str, rows: int, seed: int = 3) -> Case:
    shape = next(s for s in (*RECORD.shapes, *RECORD.edges) if s.label == label)
    return gates.make_case(RECORD, shape, rows, np.random.default_rng(seed))


def test_a_copy_that_loses_the_sign_of_a_zero_fails_on_its_bits_though_its_values_match():
    case = _case("tiny pair three taps bfloat16, 10 rows", 10)
    want = RECORD.reference(case)
    assert (np.signbit(want["out"]) & (want["out"] == 0)).sum(axis=-1).min() >= 3  # -0 planted in every tap's row
    ok, _, _ = gates.compare(RECORD, case, mlx_tap_copy(case), want)
    assert ok
    out = mlx_tap_copy(case)["out"] + 0  # -0 + 0 is +0
    ok, why, _ = gates.compare(RECORD, case, tap_copy._outputs(out, "bfloat16"), want)
    assert not ok and why.startswith(f"{case.shape.label}: bits")


def test_every_row_of_every_tap_carries_the_values_a_careless_copy_changes():
    case = _case("LFM2.5-24B-A2B five taps bfloat16, 32 rows", 32)
    for j in range(case.dims["taps"]):
        tap = case[f"tap{j}"]
        assert (np.signbit(tap) & (tap == 0)).any(axis=1).all()
        assert ((tap != 0) & (np.abs(tap) < 2.0 ** -126)).any(axis=1).all()  # subnormal
        assert (np.isfinite(tap) & (np.abs(tap) > 65504)).any(axis=1).all()  # past fp16's range
        assert np.isinf(tap).any(axis=1).all()


def test_the_sources_take_up_to_eight_taps_each_call_binding_its_own_first():
    launch = RECORD.implementations["cuda"].launch(_case("tiny pair three taps float32, 10 rows", 10))
    assert dict(launch.template)["TAPS"] == 3 and launch.output_shapes == ((10, 3 * 256),)
    case = _case("tiny pair three taps float32, 10 rows", 10)
    inputs = tap_copy._inputs(case)
    assert len(inputs) == len(RECORD.implementations["cuda"].input_names) == tap_copy.MAX_TAPS + 1
    assert all(a is inputs[0] for a in inputs[3:-1])  # never read: the kernel takes TAPS of them
    for taps in (0, tap_copy.MAX_TAPS + 1):
        shape = Shape("too many", {"taps": taps, "hidden": 64, "dtype": "float32"}, 2)
        with pytest.raises(ValueError, match="the sources take 1 to 8"):
            RECORD.implementations["metal"].launch(Case(shape, 2, {}, RECORD.row_inputs))


@pytest.mark.skipif(not (shutil.which("nvcc") and os.environ.get("TENSORFOLD_MLX_CUDA_INCLUDE")),
                    reason="needs nvcc and TENSORFOLD_MLX_CUDA_INCLUDE (MLX's CUDA device headers)")
def test_the_cuda_source_and_its_planted_controls_compile_for_sm90():
    from tensorfold_contract import nvcc

    include = os.environ["TENSORFOLD_MLX_CUDA_INCLUDE"]
    assert nvcc.main(["--include", include, "--quick", "--only", "dspark tap copy"]) == 0
