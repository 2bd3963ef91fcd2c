"""The confidence head record on the CPU: its shape is the shipped head's, its mlx implementation the served one."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tensorfold_contract import Case
from tensorfold_core.checkpoint import Checkpoint
from tensorfold_dspark.kernels.confidence import RECORD, mlx_confidence
from tensorfold_dspark.load import load
from tensorfold_dspark.plugin import MODELS

SHIPPED = MODELS / "tiny-lfm2-moe-dspark"


def test_the_records_tiny_shape_is_the_shipped_drafters_confidence_width():
    config = Checkpoint.open(SHIPPED).config
    dflash = config["dflash_config"]
    assert dflash["enable_confidence_head"] and dflash["confidence_head_with_markov"]
    assert RECORD.shapes[0].dims["width"] == config["hidden_size"] + dflash["markov_rank"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_mlx_implementation_is_bit_equal_to_the_shipped_drafters_confidence(dtype):
    model = load(Checkpoint.open(SHIPPED), getattr(mx, dtype))
    rng = np.random.default_rng(7)
    rows = mx.array(rng.standard_normal((5, model.args.hidden_size)).astype(np.float32)).astype(getattr(mx, dtype))
    previous = mx.array(rng.integers(0, model.args.vocab_size, 5).astype(np.uint32))
    served = model.confidence(rows, previous)

    features = mx.concatenate([rows, model.markov_head.markov_w1(previous).astype(rows.dtype)], axis=-1)
    proj = model.confidence_head.proj
    host = {"features": np.array(features.astype(mx.float32)), "w": np.array(proj.weight[0].astype(mx.float32)),
            "bias": np.array(proj.bias.astype(mx.float32))}
    shape = RECORD.shapes[0 if dtype == "float32" else 1]
    got = mlx_confidence(Case(shape, 5, host, RECORD.row_inputs))["out"]
    assert served.dtype == got.dtype == mx.float32
    assert np.array_equal(np.array(served).view(np.uint32), np.array(got).view(np.uint32))
