"""The llama family gives transformers' logits on float checkpoints and mlx-lm's, bit for bit, on its own ones."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from llama_helpers import mistral_checkpoint
from tensorfold_core.checkpoint import Checkpoint
from tensorfold_core.errors import OptionError
from tensorfold_core.protocols import Model, missing_members
from tensorfold_core.specs import LoadOptions
from tensorfold_core.testing import PROMPT, copy_checkpoint, edit_config, mlx_lm_logits, transformers_logits
from tensorfold_core.testing import window_logits as run
from tensorfold_llama.load import load

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 50000.0}

CONFIGS = {
    "gqa-tied": {},
    "mha-untied": dict(num_key_value_heads=4, tie_word_embeddings=False),
    "attention-and-mlp-bias": dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
    "head-dim-override": dict(head_dim=32, num_key_value_heads=1),
    "bf16-saved": dict(dtype="bfloat16", seed=1),
    "fp16-saved": dict(dtype="float16", seed=2),
}


def loaded(path, dtype="auto"):
    return load(Checkpoint.open(path), LoadOptions(dtype=dtype))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_row_and_the_last_row_match_transformers_and_mlx_lm(checkpoints, name):
    path = checkpoints(name, **CONFIGS[name])
    model = loaded(path, dtype="float32")
    assert not missing_members(model, Model) and model.dtype == mx.float32
    rows = run(model, PROMPT)
    assert rows.dtype == mx.float32 and rows.shape == (len(PROMPT), model.vocab_size)
    reference = transformers_logits(path, PROMPT)
    assert np.abs(np.array(rows) - reference).max() < 1e-4
    cache = model.new_cache(32)
    last = model.forward([cache], [PROMPT], [1])
    assert np.abs(np.array(last[0]) - reference[-1]).max() < 1e-4
    assert mx.array_equal(rows, mlx_lm_logits(path, PROMPT, dtype=mx.float32))


def test_logits_match_transformers_on_a_gqa_checkpoint_with_llama3_rope_scaling(checkpoints, tmp_path):
    path = checkpoints("llama3-rope", rope_scaling=LLAMA3, max_position_embeddings=128)
    reference = transformers_logits(path, PROMPT)
    assert np.abs(np.array(run(loaded(path), PROMPT)) - reference).max() < 1e-4
    # mlx-lm reads only the older form of the same config (rope_theta and rope_scaling as separate keys)
    legacy = copy_checkpoint(path, tmp_path / "legacy")
    scaling = {k: v for k, v in LLAMA3.items() if k != "rope_theta"}
    edit_config(legacy, rope_parameters=..., rope_theta=LLAMA3["rope_theta"], rope_scaling=scaling)
    rows = run(loaded(legacy), PROMPT)
    assert np.abs(np.array(rows) - reference).max() < 1e-4
    assert mx.array_equal(rows, mlx_lm_logits(legacy, PROMPT))


def test_a_mistral_checkpoint_with_a_sliding_window_matches_transformers(tmp_path):
    path = mistral_checkpoint(tmp_path / "mistral", sliding_window=6)
    model = loaded(path)
    assert model.model_type == "mistral"
    reference = transformers_logits(path, PROMPT)
    assert np.abs(np.array(run(model, PROMPT)) - reference).max() < 1e-4
    assert np.abs(np.array(run(model, PROMPT, [1] * len(PROMPT))) - reference).max() < 1e-4


def test_the_checkpoint_dtype_is_kept_unless_an_other_is_asked_for(checkpoints):
    path = checkpoints("bf16-saved", **CONFIGS["bf16-saved"])
    model = loaded(path)
    assert model.dtype == mx.bfloat16 and model.model.layers[0].mlp.up_proj.weight.dtype == mx.bfloat16
    assert model.new_cache(8).keys[0].dtype == mx.bfloat16
    assert run(model, PROMPT).dtype == mx.float32
    assert mx.array_equal(run(model, PROMPT), mlx_lm_logits(path, PROMPT))
    assert loaded(path, dtype="float16").dtype == mx.float16
    with pytest.raises(OptionError, match="dtype 'float64'"):
        loaded(path, dtype="float64")


@pytest.mark.parametrize("bits,group_size", [(4, 64), (8, 64), (4, 32), (4, 128), (8, 128)])
def test_an_mlx_lm_quantized_checkpoint_is_read_packed_and_matches_mlx_lm_bit_for_bit(quantized, bits, group_size):
    # group 128 needs inputs that are multiples of 128
    wide = dict(hidden_size=128, intermediate_size=256) if group_size == 128 else {}
    path = quantized("wide" if wide else "gqa-tied", bits, group_size, **wide)
    model = loaded(path)
    for layer in (model.model.layers[0].self_attn.q_proj, model.model.layers[1].mlp.down_proj):
        assert isinstance(layer, nn.QuantizedLinear) and layer.weight.dtype == mx.uint32
        assert (layer.bits, layer.group_size) == (bits, group_size)
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert mx.array_equal(run(model, PROMPT), mlx_lm_logits(path, PROMPT))


def test_per_module_overrides_in_the_quantization_block_are_honoured(quantized):
    def predicate(path, module):
        if path == "lm_head":
            return False  # kept dense
        if path in ("model.embed_tokens", "model.layers.0.mlp.down_proj"):
            return {"group_size": 32, "bits": 8}
        return True

    path = quantized("mha-untied", 4, 64, predicate, tag="-mixed", **CONFIGS["mha-untied"])
    edit_config(path, quantization={**Checkpoint.open(path).quantization, "lm_head": False})
    model = loaded(path)
    embed, down = model.model.embed_tokens, model.model.layers[0].mlp.down_proj
    assert (embed.bits, embed.group_size, down.bits, down.group_size) == (8, 32, 8, 32)
    assert model.model.layers[0].mlp.up_proj.bits == 4
    assert isinstance(model.lm_head, nn.Linear) and model.lm_head.weight.dtype == mx.float32
    assert mx.array_equal(run(model, PROMPT), mlx_lm_logits(path, PROMPT))


def test_a_quantized_checkpoint_loaded_in_bfloat16_keeps_its_packed_weights(quantized):
    model = loaded(quantized("gqa-tied", 4, 64), dtype="bfloat16")
    q_proj = model.model.layers[0].self_attn.q_proj
    assert model.dtype == mx.bfloat16 and q_proj.weight.dtype == mx.uint32 and q_proj.scales.dtype == mx.bfloat16
    assert run(model, PROMPT).shape == (len(PROMPT), model.vocab_size)
