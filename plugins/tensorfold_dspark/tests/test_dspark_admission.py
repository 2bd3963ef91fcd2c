"""Which checkpoints the dspark kind reads, for which targets, at which width; layout errors name what is wrong."""

from __future__ import annotations

import json

import mlx.nn as nn
import pytest

from dspark_helpers import dspark_config, dspark_weights, write_dspark
from tensorfold_core.checkpoint import Checkpoint
from tensorfold_core.errors import CheckpointError, DrafterError
from tensorfold_core.loading import load_target, start_drafter
from tensorfold_core.options import ServeOptions
from tensorfold_core.plugins import Registry, new_plugin_manager
from tensorfold_core.specs import DrafterOptions
from tensorfold_core.testing import tiny_llama_checkpoint
from tensorfold_dspark import plugin
from tensorfold_lfm2.load import load


@pytest.fixture(scope="module")
def target(target_dir):
    return load(Checkpoint.open(target_dir))


@pytest.fixture(scope="module")
def tokenizer(target_dir):
    return Checkpoint.open(target_dir).tokenizer()


def test_the_dspark_plugin_registers_a_kind_that_reads_checkpoints_with_a_dflash_config_only(dspark_dir, target_dir):
    pm = new_plugin_manager(entry_points=False)
    pm.register(plugin)
    (kind,) = Registry(pm).drafters()
    assert kind.name == "dspark" and kind.matches(Checkpoint.open(dspark_dir))
    assert not kind.matches(Checkpoint.open(target_dir))
    assert "dspark" in [d.name for d in Registry(new_plugin_manager()).drafters()]


def test_a_dspark_checkpoint_served_alone_is_refused_by_name(dspark_dir):
    with pytest.raises(DrafterError, match=f"{dspark_dir} is admitted only as a drafter; serve a target with "
                                           f"--drafter {dspark_dir}"):
        load_target(str(dspark_dir), ServeOptions())


@pytest.mark.parametrize("bits", [0, 4])
def test_drafter_bits_other_than_8_are_refused_naming_the_width_the_drafter_serves(target, tokenizer, dspark_dir,
                                                                                    bits):
    with pytest.raises(DrafterError, match=f"--drafter-bits {bits}: the dspark drafter serves tiny-dspark's linears "
                                           "as 8-bit MLX affine codes.*pass --drafter-bits 8 or leave the flag out"):
        start_drafter(str(dspark_dir), target, tokenizer, DrafterOptions(bits=bits))


def test_the_drafter_packs_its_linears_to_8_bit_codes_at_load_and_keeps_the_confidence_head_dense(target, tokenizer,
                                                                                               dspark_dir):
    drafter = start_drafter(str(dspark_dir), target, tokenizer, DrafterOptions(bits=8))
    try:
        model = drafter.model
        packed = [model.fc, model.markov_head.markov_w1, model.markov_head.markov_w2,
                  *(getattr(layer.self_attn, p) for layer in model.layers for p in ("q_proj", "k_proj", "o_proj")),
                  *(getattr(layer.mlp, p) for layer in model.layers for p in ("gate_proj", "up_proj", "down_proj"))]
        assert all(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and m.bits == 8 for m in packed)
        assert type(model.confidence_head.proj) is nn.Linear
        assert drafter.slot_bytes_for(100) == 2 * 2 * 2 * 256 * 16 * 4  # layers, k and v, kv heads, rows, dim
    finally:
        drafter.close()


def test_a_target_without_taps_is_refused_by_the_dspark_kind(tmp_path, dspark_dir):
    from tensorfold_llama.load import load as load_llama

    llama = load_llama(Checkpoint.open(tiny_llama_checkpoint(tmp_path / "llama")))
    (kind,) = [k for k in Registry(new_plugin_manager()).drafters() if k.name == "dspark"]
    with pytest.raises(DrafterError, match="reads the target's layer taps, and the llama family has none"):
        kind.admit(llama, Checkpoint.open(dspark_dir), None)


@pytest.mark.parametrize("key, value, named", [
    ("hidden_size", 128, "its hidden_size is 128, the lfm2_moe target's is 64"),
    ("vocab_size", 512, "its vocab_size is 512, the lfm2_moe target's is 384"),
    ("num_target_layers", 6, "its dflash_config.num_target_layers is 6, the lfm2_moe target's is 4"),
])
def test_a_target_other_than_the_one_trained_on_is_refused_naming_the_key(tmp_path, target, target_dir, key, value,
                                                                         named):
    config = dspark_config(target_dir)
    if key == "num_target_layers":
        config["dflash_config"][key] = value
    else:
        config[key] = value
    path = write_dspark(tmp_path / "other", target_dir, config, {})
    (kind,) = [k for k in Registry(new_plugin_manager()).drafters() if k.name == "dspark"]
    with pytest.raises(DrafterError, match=named):
        kind.admit(target, Checkpoint.open(path), None)


def without(config: dict, key: str) -> dict:
    dflash = dict(config["dflash_config"])
    dflash.pop(key)
    return {**config, "dflash_config": dflash}


@pytest.mark.parametrize("edit, named", [
    (lambda c: without(c, "mask_token_id"), "missing dflash_config.mask_token_id"),
    (lambda c: without(c, "target_layer_ids"), "missing dflash_config.target_layer_ids"),
    (lambda c: {**c, "dflash_config": {**c["dflash_config"], "target_layer_ids": [2, 0]}},
     r"dflash_config.target_layer_ids \[2, 0\] must be increasing layer ids in 0..3"),
    (lambda c: {**c, "dflash_config": {**c["dflash_config"], "mask_token_id": 999}},
     "dflash_config.mask_token_id 999 is not a token id below vocab_size 384"),
    (lambda c: {**c, "dflash_config": {**c["dflash_config"], "causal": True}}, "dflash_config.causal is true"),
    (lambda c: {**without(c, "block_size")}, "missing block_size"),
])
def test_a_config_layout_error_names_the_key(tmp_path, target, tokenizer, target_dir, edit, named):
    config = dspark_config(target_dir)
    path = write_dspark(tmp_path / "bad", target_dir, edit(config), dspark_weights(config))
    with pytest.raises(CheckpointError, match=named):
        start_drafter(str(path), target, tokenizer)


@pytest.mark.parametrize("edit, named", [
    (lambda w: w.pop("hidden_norm.weight"), r"tensor 'hidden_norm.weight' is missing \(expected shape \(64,\)"),
    (lambda w: w.update({"fc.weight": w["fc.weight"][:, :128]}),
     r"tensor 'fc.weight' has shape \(64, 128\), expected \(64, 192\)"),
    (lambda w: w.update({"lm_head.weight": w["fc.weight"]}), "tensor 'lm_head.weight' is not read by the dspark"),
    (lambda w: w.pop("markov_head.markov_w2.weight"), "tensor 'markov_head.markov_w2.weight' is missing"),
])
def test_a_tensor_layout_error_names_the_tensor(tmp_path, target, tokenizer, target_dir, edit, named):
    config = dspark_config(target_dir)
    weights = dspark_weights(config)
    edit(weights)
    path = write_dspark(tmp_path / "bad", target_dir, config, weights)
    with pytest.raises(CheckpointError, match=named):
        start_drafter(str(path), target, tokenizer)


def test_published_names_under_a_model_prefix_load_as_the_same_drafter(tmp_path, target, tokenizer, target_dir):
    config = dspark_config(target_dir)
    weights = dspark_weights(config)
    path = write_dspark(tmp_path / "prefixed", target_dir, config, {f"model.{k}": v for k, v in weights.items()})
    drafter = start_drafter(str(path), target, tokenizer)
    drafter.close()
    assert json.loads((path / "config.json").read_text())["dflash_config"]["markov_rank"] == 64
