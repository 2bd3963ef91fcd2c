"""The drafter's 8-bit linears: calls of many rows may unpack the codes (on CUDA), and give the packed result."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from tensorfold_core.loading import open_checkpoint
from tensorfold_dspark.load import UNPACK_FROM_ROWS_ON_CUDA, PackedLinear, load


def packed(bias: bool) -> PackedLinear:
    mx.random.seed(3)
    linear = nn.Linear(128, 96, bias=bias)
    return PackedLinear.from_linear(linear, 64, 8)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [UNPACK_FROM_ROWS_ON_CUDA, 13, 32])
def test_a_call_of_many_rows_unpacks_to_the_packed_result_within_float32_rounding(bias, rows):
    layer = packed(bias)
    x = mx.random.normal((rows, 128))
    in_place = layer(x)
    layer.unpack_from = UNPACK_FROM_ROWS_ON_CUDA
    unpacked = layer(x)
    assert unpacked.shape == in_place.shape == (rows, 96)
    assert mx.allclose(unpacked, in_place, rtol=1e-5, atol=1e-5).item()


def test_a_call_of_fewer_rows_reads_the_codes_in_place():
    layer = packed(True)
    x = mx.random.normal((1, UNPACK_FROM_ROWS_ON_CUDA - 1, 128))
    in_place = layer(x)
    layer.unpack_from = UNPACK_FROM_ROWS_ON_CUDA
    assert mx.array_equal(layer(x), in_place).item()


def test_the_shipped_drafters_linears_unpack_only_on_cuda():
    model = load(open_checkpoint("tiny-lfm2-moe-dspark"), mx.bfloat16)
    linears = [m for _, m in model.named_modules() if isinstance(m, PackedLinear)]
    assert linears, "the drafter packs its linears"
    assert all(m.unpack_from is None for m in linears)  # this machine computes on the CPU
