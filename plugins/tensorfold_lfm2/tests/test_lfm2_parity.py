"""Both lfm2 families give transformers' logits on float checkpoints, and mlx-lm's bit for bit up to a router tie."""

from __future__ import annotations

import warnings

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tensorfold_core.checkpoint import Checkpoint
from tensorfold_core.errors import CheckpointError
from tensorfold_core.protocols import Model, missing_members
from tensorfold_core.specs import LoadOptions
from tensorfold_core.testing import PROMPT, copy_checkpoint, edit_config, mlx_lm_logits, transformers_logits
from tensorfold_core.testing import window_logits as run
from tensorfold_lfm2 import lfm2_moe
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
EPS32 = float(np.finfo(np.float32).eps)


def loaded(path, dtype="auto"):
    return load(Checkpoint.open(path), LoadOptions(dtype=dtype))


def make(checkpoints, name):
    moe, overrides = CONFIGS[name]
    return checkpoints(name, moe=moe, **overrides)


def mlx_lm_pick(choice, k):
    """mlx-lm's pick: argpartition's top k, in no set order, a tie at the boundary to the higher id on the CPU."""
    return mx.argpartition(choice, kth=-k, axis=-1)[..., -k:]


def routed(monkeypatch, model, tokens, capacity=64, pick=lfm2_moe.top_k):
    """Rows of `tokens` in one window, routed by `pick`; and the rows where a router's k-th and (k+1)-th choices tie."""
    tied = set()

    def recording(choice, k):
        if k < choice.shape[-1]:
            ranked = mx.sort(choice, axis=-1)
            tied.update(np.flatnonzero(np.array(ranked[..., -k] == ranked[..., -k - 1])).tolist())
        return pick(choice, k)

    with monkeypatch.context() as patch:
        patch.setattr(lfm2_moe, "top_k", recording)
        return run(model, tokens, capacity=capacity), sorted(tied)


def assert_mlx_lm_rows(monkeypatch, model, path, tokens, capacity=64):
    """Bit for bit with mlx-lm up to the first row whose router ties at the pick boundary, a row it names."""
    # mlx-lm gives a boundary tie to the higher id, so from that row on only the transformers comparison holds
    ref = mlx_lm_logits(path, tokens)
    rows, tied = routed(monkeypatch, model, tokens, capacity)
    first = tied[0] if tied else len(tokens)
    if tied:
        warnings.warn(f"{path.name}: rows {tied} hold an exact router tie at the pick boundary; rows {first}.. "
                      "are not compared with mlx-lm, which gives a tie to the higher id")
    picks = [layer.feed_forward.top_k for layer in model.model.layers
             if isinstance(layer.feed_forward, lfm2_moe.SparseMoeBlock)]
    if max(picks, default=0) <= 2:  # a sum of two is one rounding in either order
        assert mx.array_equal(rows[:first], ref[:first])
        return
    # past two picks we sum best first, mlx-lm in argpartition's order: the float32 sums round apart by a few ulps,
    # and in mlx-lm's order nothing else differs
    error = np.abs(np.array(rows[:first]) - np.array(ref[:first])).max(initial=0.0)
    assert error <= 16 * EPS32 * np.abs(np.array(ref)).max()
    assert mx.array_equal(routed(monkeypatch, model, tokens, capacity, mlx_lm_pick)[0][:first], ref[:first])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_row_matches_transformers_and_mlx_lm_for_each_config(checkpoints, monkeypatch, name):
    path = make(checkpoints, name)
    model = loaded(path)
    assert not missing_members(model, Model) and model.dtype == mx.float32
    rows = run(model, PROMPT)
    assert rows.dtype == mx.float32 and rows.shape == (len(PROMPT), model.vocab_size)
    assert np.abs(np.array(rows) - transformers_logits(path, PROMPT)).max() < 1e-4
    assert_mlx_lm_rows(monkeypatch, model, path, PROMPT)


def test_a_long_window_of_top_4_routes_matches_mlx_lm_which_sorts_its_rows_by_expert(checkpoints, monkeypatch):
    path = make(checkpoints, "moe-16-top4-unnormed-scaled")
    model = loaded(path)
    assert_mlx_lm_rows(monkeypatch, model, path, LONG, capacity=80)
    assert np.abs(np.array(run(model, LONG, capacity=80)) - transformers_logits(path, LONG)).max() < 1e-4


def test_an_exact_router_tie_is_named_and_parts_the_rows_from_mlx_lm_only_by_the_tie_rule(checkpoints, tmp_path,
                                                                                          monkeypatch):
    path = copy_checkpoint(checkpoints("moe-4-top2", moe=True, num_experts=4, seed=1), tmp_path / "tied")
    weights = load_file(str(path / "model.safetensors"))
    prefix = "model.layers.3.feed_forward"  # experts 0 and 1 get one router row and bias: on every row they tie
    weights[f"{prefix}.gate.weight"][1] = weights[f"{prefix}.gate.weight"][0]
    weights[f"{prefix}.expert_bias"][1] = weights[f"{prefix}.expert_bias"][0]
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    model = loaded(path)
    ref = mlx_lm_logits(path, PROMPT)
    rows, tied = routed(monkeypatch, model, PROMPT)
    assert 0 < tied[0] < len(PROMPT)
    with pytest.warns(UserWarning, match=rf"rows \[{tied[0]}, .*\] hold an exact router tie"):
        assert_mlx_lm_rows(monkeypatch, model, path, PROMPT)
    assert not mx.array_equal(rows[tied[0]], ref[tied[0]])  # the tied row itself: we take expert 0, mlx-lm 1
    assert mx.array_equal(routed(monkeypatch, model, PROMPT, pick=mlx_lm_pick)[0], ref)


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
def test_mlx_lm_4_bit_conversions_are_read_packed_and_match_mlx_lm_bit_for_bit(converted, monkeypatch, name):
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
    assert_mlx_lm_rows(monkeypatch, model, path, tokens, capacity=80)


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
