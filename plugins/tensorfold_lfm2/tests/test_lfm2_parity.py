"""Both families give transformers' logits on float checkpoints and mlx-lm's, bit for bit, on mlx-lm's own ones."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tensorfold_core.checkpoint import Checkpoint
from tensorfold_core.errors import CheckpointError
from tensorfold_core.protocols import Model
from tensorfold_core.specs import LoadOptions
from tensorfold_core.testing import PROMPT, copy_checkpoint, edit_config, mlx_lm_logits, transformers_logits
from tensorfold_core.testing import window_logits as run
from tensorfold_lfm2.lfm2_moe import QuantizedSwitchLinear
from tensorfold_lfm2.load import load

ATTENTION_FIRST = ["full_attention", "conv", "conv", "conv"]
DENSE = {
    "lfm2": {},
    "lfm2-conv-bias-mha": dict(conv_bias=True, num_key_value_heads=4),
    "lfm2-attention-first-wide-conv": dict(layer_types=ATTENTION_FIRST, conv_L_cache=4, seed=1),
    "lfm2-unadjusted-ff": dict(block_auto_adjust_ff_dim=False, intermediate_size=96, seed=2),
}
MOE = {
    "moe": {},
    "moe-16-top4-unnormed-scaled": dict(num_experts=16, num_experts_per_tok=4, norm_topk_prob=False,
                                        routed_scaling_factor=2.5, num_dense_layers=0, seed=3),
    "moe-4-top1-unbiased-conv-bias": dict(num_experts=4, num_experts_per_tok=1, use_expert_bias=False,
                                          conv_bias=True, layer_types=ATTENTION_FIRST, seed=4),
    "moe-12-top3-two-dense": dict(num_experts=12, num_experts_per_tok=3, num_dense_layers=2,
                                  routed_scaling_factor=0.5, seed=5),
}
CONFIGS = {**{k: (False, v) for k, v in DENSE.items()}, **{k: (True, v) for k, v in MOE.items()}}
LONG = (PROMPT * 4)[:70]  # 70 rows x top-4 routes: mlx-lm sorts rows by expert past 64 pairs; we never do


def loaded(path, dtype="auto"):
    return load(Checkpoint.open(path), LoadOptions(dtype=dtype))


def make(checkpoints, name):
    moe, overrides = CONFIGS[name]
    return checkpoints(name, moe=moe, **overrides)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_row_matches_transformers_and_mlx_lm_for_each_config(checkpoints, name):
    path = make(checkpoints, name)
    model = loaded(path)
    assert isinstance(model, Model) and model.dtype == mx.float32
    rows = run(model, PROMPT)
    assert rows.dtype == mx.float32 and rows.shape == (len(PROMPT), model.vocab_size)
    assert np.abs(np.array(rows) - transformers_logits(path, PROMPT)).max() < 1e-4
    assert mx.array_equal(rows, mlx_lm_logits(path, PROMPT))


def test_a_long_window_of_top_4_routes_matches_mlx_lm_which_sorts_its_rows_by_expert(checkpoints):
    path = make(checkpoints, "moe-16-top4-unnormed-scaled")
    rows = run(loaded(path), LONG, capacity=80)
    assert mx.array_equal(rows, mlx_lm_logits(path, LONG))
    assert np.abs(np.array(rows) - transformers_logits(path, LONG)).max() < 1e-4


def test_an_untied_head_is_read_from_lm_head(checkpoints):
    path = checkpoints("lfm2-untied", tie_word_embeddings=False)
    model = loaded(path)
    assert not model.args.tie_word_embeddings and "lm_head" in model
    assert np.abs(np.array(run(model, PROMPT)) - transformers_logits(path, PROMPT)).max() < 1e-4


def test_older_config_keys_give_the_same_model(checkpoints, tmp_path):
    path = make(checkpoints, "lfm2-attention-first-wide-conv")
    legacy = copy_checkpoint(path, tmp_path / "legacy")
    edit_config(legacy, block_dim=..., layer_types=..., full_attn_idxs=[0], intermediate_size=...,
                block_ff_dim=192, tie_word_embeddings=..., tie_embedding=True)
    assert mx.array_equal(run(loaded(legacy), PROMPT), run(loaded(path), PROMPT))


@pytest.mark.parametrize("name", ["lfm2-conv-bias-mha", "moe"])
def test_mlx_lm_layouts_load_conv_weights_as_c_l_1_and_experts_stacked(converted, checkpoints, name):
    path = converted(name, bits=0, moe=CONFIGS[name][0], **CONFIGS[name][1])
    weights = Checkpoint.open(path).tensors()
    assert weights["model.layers.0.conv.conv.weight"].shape == (64, 3, 1)
    assert mx.array_equal(run(loaded(path), PROMPT), run(loaded(make(checkpoints, name)), PROMPT))


def test_transformers_packed_expert_tensors_load_like_one_tensor_per_expert(checkpoints, tmp_path):
    path = make(checkpoints, "moe")
    packed = copy_checkpoint(path, tmp_path / "packed")
    weights = load_file(str(path / "model.safetensors"))
    for layer in (1, 2, 3):
        prefix = f"model.layers.{layer}.feed_forward.experts"
        take = lambda w: np.stack([weights.pop(f"{prefix}.{e}.{w}.weight") for e in range(8)])
        weights[f"{prefix}.gate_up_proj"] = np.concatenate([take("w1"), take("w3")], axis=1)
        weights[f"{prefix}.down_proj"] = take("w2")
    save_file(weights, str(packed / "model.safetensors"), metadata={"format": "pt"})
    assert mx.array_equal(run(loaded(packed), PROMPT), run(loaded(path), PROMPT))


@pytest.mark.parametrize("name", ["lfm2-conv-bias-mha", "moe", "moe-16-top4-unnormed-scaled"])
def test_mlx_lm_4_bit_conversions_are_read_packed_and_match_mlx_lm_bit_for_bit(converted, name):
    moe, overrides = CONFIGS[name]
    path = converted(name, moe=moe, **overrides)
    model = loaded(path)
    layer = model.model.layers[2]
    assert isinstance(layer.conv.in_proj, nn.QuantizedLinear) and layer.conv.in_proj.bits == 4
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    if moe:
        assert layer.feed_forward.gate.bits == 8  # mlx-lm's per-module override for routers
        assert isinstance(layer.feed_forward.switch_mlp.down_proj, QuantizedSwitchLinear)
        assert layer.feed_forward.expert_bias.dtype == mx.float32
    tokens = LONG if overrides.get("num_experts_per_tok") == 4 else PROMPT
    assert mx.array_equal(run(model, tokens, capacity=80), mlx_lm_logits(path, tokens))


def test_a_quantized_checkpoint_loaded_in_bfloat16_keeps_its_packed_weights_and_float32_expert_bias(converted):
    model = loaded(converted("moe", moe=True), dtype="bfloat16")
    moe = model.model.layers[3].feed_forward
    assert model.dtype == mx.bfloat16 and moe.switch_mlp.up_proj.weight.dtype == mx.uint32
    assert moe.switch_mlp.up_proj.scales.dtype == mx.bfloat16 and moe.expert_bias.dtype == mx.float32
    assert run(model, PROMPT).shape == (len(PROMPT), model.vocab_size)


@pytest.mark.parametrize("change,message", [
    (dict(layer_types=["conv", "sliding_attention", "conv", "full_attention"]), "layer_types must name 4 layers"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6}), "rope type 'yarn'"),
    (dict(block_dim=32), "block_dim 32 differs from hidden_size 64"),
    (dict(conv_bias=True), "tensor 'model.layers.0.conv.in_proj.bias' is missing"),
    (dict(layer_types=["conv"] * 4), "tensor 'model.layers.1.conv.in_proj.weight' is missing"),
    (dict(num_experts=6), r"'model.layers.1.feed_forward.gate.weight' has shape \(8, 64\), expected \(6, 64\)"),
    (dict(num_experts_per_tok=9), "9 experts per token of 8"),
])
def test_a_config_that_does_not_fit_the_checkpoint_is_refused_by_name(checkpoints, tmp_path, change, message):
    path = copy_checkpoint(make(checkpoints, "moe"), tmp_path / "ckpt")
    edit_config(path, **change)
    with pytest.raises(CheckpointError, match=message):
        loaded(path)


def test_a_missing_expert_or_an_unread_tensor_is_named(checkpoints, tmp_path):
    path = copy_checkpoint(make(checkpoints, "moe"), tmp_path / "ckpt")
    weights = load_file(str(path / "model.safetensors"))
    del weights["model.layers.2.feed_forward.experts.5.w3.weight"]
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="'model.layers.2.feed_forward.switch_mlp.up_proj.weight' is missing"):
        loaded(path)
    fresh = copy_checkpoint(make(checkpoints, "moe"), tmp_path / "fresh")
    edit_config(fresh, use_expert_bias=False)
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.1.feed_forward.expert_bias' is not read by the "
                                              r"lfm2_moe .* \(3 such; check"):
        loaded(fresh)
