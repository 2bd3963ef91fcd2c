"""Drafters' packed linears: calls of many rows may unpack the codes (on CUDA), or the codes are unpacked once (on the
CPU), and either gives the packed result."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

import tensorfold_core.quantized as quantized
from tensorfold_core.loading import load_model, start_drafter
from mlx.utils import tree_flatten

from tensorfold_core.quantized import (UNPACK_FROM_ROWS_ON_CUDA, UNPACK_ONCE_ENV, PackedEmbedding, PackedLinear,
                                       serve_codes, unpack_many_rows, unpack_once)


def packed(bias: bool) -> nn.Module:
    mx.random.seed(3)
    model = nn.Sequential(nn.Linear(128, 96, bias=bias))
    nn.quantize(model, group_size=64, bits=8)
    return model


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [UNPACK_FROM_ROWS_ON_CUDA, 13, 32])
def test_a_call_of_many_rows_unpacks_to_the_packed_result_within_float32_rounding(bias, rows):
    model = packed(bias)
    x = mx.random.normal((rows, 128))
    in_place = model(x)
    assert unpack_many_rows(model, UNPACK_FROM_ROWS_ON_CUDA) == 1
    assert isinstance(model.layers[0], PackedLinear)
    unpacked = model(x)
    assert unpacked.shape == in_place.shape == (rows, 96)
    assert mx.allclose(unpacked, in_place, rtol=1e-5, atol=1e-5).item()


def test_a_call_of_fewer_rows_reads_the_codes_in_place():
    model = packed(True)
    x = mx.random.normal((1, UNPACK_FROM_ROWS_ON_CUDA - 1, 128))
    in_place = model(x)
    unpack_many_rows(model, UNPACK_FROM_ROWS_ON_CUDA)
    assert mx.array_equal(model(x), in_place).item()


def test_a_tied_head_of_many_rows_unpacks_to_the_packed_result():
    mx.random.seed(4)
    embedding = nn.QuantizedEmbedding.from_embedding(nn.Embedding(300, 128), 64, 4)
    x = mx.random.normal((UNPACK_FROM_ROWS_ON_CUDA + 3, 128))
    in_place = embedding.as_linear(x)
    holder = nn.Sequential(embedding)
    unpack_many_rows(holder, UNPACK_FROM_ROWS_ON_CUDA)
    assert isinstance(holder.layers[0], PackedEmbedding)
    assert mx.allclose(holder.layers[0].as_linear(x), in_place, rtol=1e-5, atol=1e-5).item()
    assert mx.array_equal(holder.layers[0](mx.array([1, 7])), embedding(mx.array([1, 7]))).item()  # lookups as before


@pytest.mark.parametrize("rows", [1, 3, 32])
def test_codes_unpacked_once_give_the_packed_result_and_stay_out_of_the_parameters(rows):
    model = packed(True)
    x = mx.random.normal((rows, 128))
    in_place = model(x)
    names = [name for name, _ in tree_flatten(model.parameters())]
    assert unpack_once(model) == 1
    layer = model.layers[0]
    assert layer.unpacked is not None and layer.unpacked.shape == (96, 128)
    assert mx.allclose(model(x), in_place, rtol=1e-5, atol=1e-5).item()
    assert [name for name, _ in tree_flatten(model.parameters())] == names  # the codes stay the weights


@pytest.mark.parametrize("bits", [4, 8])
def test_a_lookup_through_codes_unpacked_once_is_the_packed_lookup_bit_for_bit(bits):
    mx.random.seed(5)
    embedding = nn.QuantizedEmbedding.from_embedding(nn.Embedding(300, 128), 32, bits)
    ids = mx.array([[0, 7, 7], [299, 31, 150]], dtype=mx.uint32)
    in_place = embedding(ids)
    holder = nn.Sequential(embedding)
    assert unpack_once(holder) == 1
    looked_up = holder.layers[0]
    assert looked_up.unpacked is not None
    assert looked_up(ids).shape == in_place.shape == (2, 3, 128)
    assert mx.array_equal(looked_up(ids), in_place).item()
    object.__setattr__(looked_up, "unpacked", mx.zeros_like(looked_up.unpacked))
    assert not mx.any(looked_up(ids)).item()  # the lookup read the unpacked copy, not the codes


def test_codes_whose_unpacked_copy_would_pass_the_limit_are_read_in_place():
    model = packed(False)
    x = mx.random.normal((4, 128))
    assert unpack_once(model, limit_bytes=96 * 128 * 4 - 1) == 0
    assert model.layers[0].unpacked is None and mx.array_equal(model(x), nn.QuantizedLinear.__call__(
        model.layers[0], x)).item()
    assert unpack_once(model, limit_bytes=96 * 128 * 4) == 1


@pytest.mark.parametrize("drafter", ["tiny-lfm2-moe-dspark", "tiny-llama-drafter-4bit"])
def test_the_shipped_quantized_drafters_unpack_once_on_the_cpu_and_for_many_rows_on_cuda(drafter, monkeypatch):
    target_name = "tiny-lfm2-moe" if "dspark" in drafter else "tiny-llama"
    target, tokenizer = load_model(target_name)[:2]
    for backend, knob, once, unpack_from in (("cpu", None, True, None), ("cpu", "0", False, None),
                                             ("cuda", None, False, UNPACK_FROM_ROWS_ON_CUDA)):
        monkeypatch.setattr(quantized, "backend", lambda b=backend: b)
        if knob is None:
            monkeypatch.delenv(UNPACK_ONCE_ENV, raising=False)
        else:
            monkeypatch.setenv(UNPACK_ONCE_ENV, knob)
        started = start_drafter(drafter, target, tokenizer)
        packs = [m for _, m in started.model.named_modules() if isinstance(m, (PackedLinear, PackedEmbedding))]
        assert packs and all((m.unpacked is not None) == once and m.unpack_from == unpack_from for m in packs)
        started.close()
        mx.clear_cache()


def test_serve_codes_says_how_the_codes_are_read(monkeypatch):
    monkeypatch.delenv(UNPACK_ONCE_ENV, raising=False)
    monkeypatch.setattr(quantized, "backend", lambda: "cpu")
    assert serve_codes(packed(False)) == "unpacked once"
    monkeypatch.setattr(quantized, "backend", lambda: "cuda")
    assert serve_codes(packed(False)) == f"unpacked from {UNPACK_FROM_ROWS_ON_CUDA} rows"
    monkeypatch.setattr(quantized, "backend", lambda: "metal")
    assert serve_codes(packed(False)) == "in place"
