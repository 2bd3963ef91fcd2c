"""Checkpoint dirs: sharded ones load, broken ones fail with the file or tensor named, names resolve to dirs."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from tensorfold_core.checkpoint import Checkpoint
from tensorfold_core.loading import load_model, resolve_model
from tensorfold_core.errors import CheckpointError
from tensorfold_core.plugins import Registry, new_plugin_manager
from tensorfold_core.specs import ShippedModel
from tensorfold_core import hookimpl
from tensorfold_core.testing import PROMPT, copy_checkpoint, edit_config, window_logits as run
from tensorfold_llama import plugin


@pytest.fixture
def llama_registry():
    pm = new_plugin_manager(entry_points=False)
    pm.register(plugin)
    return Registry(pm)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """The gqa-tied llama saved in several shards with an index."""
    import torch
    from transformers import LlamaForCausalLM

    from tensorfold_core.testing import llama_config, write_tokenizer

    torch.manual_seed(3)
    path = tmp_path_factory.mktemp("sharded") / "llama"
    LlamaForCausalLM(llama_config()).save_pretrained(path, max_shard_size="60KB")
    write_tokenizer(path)
    return path


def test_a_sharded_checkpoint_loads_and_gives_the_same_logits_as_one_file(sharded, tmp_path, llama_registry):
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model, tokenizer, ckpt = load_model(sharded, registry=llama_registry)
    single = tmp_path / "single"
    copy_checkpoint(sharded, single)
    tensors = ckpt.tensors()
    for file in single.glob("model-*.safetensors"):
        file.unlink()
    (single / "model.safetensors.index.json").unlink()
    mx.save_safetensors(str(single / "model.safetensors"), tensors)
    one_file, _, _ = load_model(single, registry=llama_registry)
    assert mx.array_equal(run(model, PROMPT), run(one_file, PROMPT))
    assert tokenizer.backend.get_vocab_size() > 0 and ckpt.model_type == "llama"


def test_a_dir_without_config_json_is_refused_naming_the_file(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints("gqa-tied"), tmp_path / "ckpt")
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json: missing"):
        Checkpoint.open(path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: not valid JSON"):
        Checkpoint.open(path)


def test_a_missing_shard_is_named(sharded, tmp_path):
    path = copy_checkpoint(sharded, tmp_path / "ckpt")
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard.name}: missing shard"):
        Checkpoint.open(path).tensors()


def test_a_tensor_named_in_the_index_but_absent_from_its_shard_is_named(sharded, tmp_path):
    path = copy_checkpoint(sharded, tmp_path / "ckpt")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name, file = sorted(index["weight_map"].items())[0]
    tensors = mx.load(str(path / file))
    mx.save_safetensors(str(path / file), {k: v for k, v in tensors.items() if k != name})
    with pytest.raises(CheckpointError, match=f"{file}: tensor '{name}' named in"):
        Checkpoint.open(path).tensors()


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_corrupt_safetensors_file_is_named(checkpoints, tmp_path, damage):
    path = copy_checkpoint(checkpoints("gqa-tied"), tmp_path / "ckpt")
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x07" * 64)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        Checkpoint.open(path).tensors()


def test_a_missing_tensor_is_named_with_the_file(checkpoints, tmp_path, llama_registry):
    path = copy_checkpoint(checkpoints("gqa-tied"), tmp_path / "ckpt")
    tensors = mx.load(str(path / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    mx.save_safetensors(str(path / "model.safetensors"), tensors)
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'model.layers.1.mlp.up_proj.weight' is "
                                              r"missing"):
        load_model(path, registry=llama_registry)


def test_a_tensor_of_the_wrong_shape_is_named_with_the_file(checkpoints, tmp_path, llama_registry):
    path = copy_checkpoint(checkpoints("gqa-tied"), tmp_path / "ckpt")
    edit_config(path, intermediate_size=96)
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'model.layers.0.mlp.gate_proj.weight' "
                                              r"has shape \(128, 64\), expected \(96, 64\)"):
        load_model(path, registry=llama_registry)


def test_a_tensor_no_module_reads_is_named(checkpoints, tmp_path, llama_registry):
    path = copy_checkpoint(checkpoints("attention-and-mlp-bias", attention_bias=True, mlp_bias=True,
                                       tie_word_embeddings=False), tmp_path / "ckpt")
    edit_config(path, mlp_bias=False)
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.0.mlp.down_proj.bias' is not read"):
        load_model(path, registry=llama_registry)


def test_an_unsupported_quantization_or_rope_is_refused_by_name(quantized, checkpoints, tmp_path, llama_registry):
    path = copy_checkpoint(quantized("gqa-tied", 4, 64), tmp_path / "q")
    edit_config(path, quantization={"group_size": 64, "bits": 4, "mode": "mxfp4"}, quantization_config=...)
    with pytest.raises(CheckpointError, match="quantization 'mxfp4' is not read"):
        load_model(path, registry=llama_registry)
    edit_config(path, quantization=...)
    with pytest.raises(CheckpointError, match="packed tensor .* no quantization block"):
        load_model(path, registry=llama_registry)
    dense = copy_checkpoint(checkpoints("gqa-tied"), tmp_path / "dense")
    edit_config(dense, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0})
    with pytest.raises(CheckpointError, match="rope type 'yarn'"):
        load_model(dense, registry=llama_registry)


def test_an_uncached_hub_id_offline_says_it_is_not_local_and_how_to_fix_it(tmp_path, monkeypatch, llama_registry):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(CheckpointError, match="'someorg/no-such-model' is not local .* HF_HUB_OFFLINE=1 is set"):
        resolve_model("someorg/no-such-model", llama_registry)
    with pytest.raises(CheckpointError, match="no such checkpoint dir, not a shipped model"):
        resolve_model(str(tmp_path / "nowhere"), llama_registry)


class ShipsOne:
    """A third-party plugin that ships one checkpoint by name."""

    def __init__(self, path):
        self.path = path

    @hookimpl
    def tensorfold_models(self):
        return [ShippedModel(name="shipped-llama", path=self.path)]


def test_a_shipped_model_name_resolves_to_its_dir_and_loads(checkpoints, llama_registry):
    llama_registry.pm.register(ShipsOne(checkpoints("gqa-tied")))
    assert resolve_model("shipped-llama", llama_registry) == checkpoints("gqa-tied")
    model, tokenizer, ckpt = load_model("shipped-llama", registry=llama_registry)
    assert ckpt.path == checkpoints("gqa-tied") and model.model_type == "llama"
