"""A malformed checkpoint is one line naming the file and the tensor or key, never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import mlx.core as mx
import pytest

from tensorfold_core.errors import CheckpointError
from tensorfold_core.options import ServeOptions


def _truncated(path):
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])


def _without(name):
    def damage(path):
        tensors = mx.load(str(path / "model.safetensors"))
        del tensors[name]
        mx.save_safetensors(str(path / "model.safetensors"), tensors)
    return damage


def _config(**changes):
    def damage(path):
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, **changes}))
    return damage


def _write(name, text):
    return lambda path: (path / name).write_text(text)


CASES = {
    "truncated safetensors": (_truncated, ["model.safetensors", "runs past the end"]),
    "missing tensor": (_without("model.layers.1.mlp.up_proj.weight"),
                       ["model.safetensors", "'model.layers.1.mlp.up_proj.weight' is missing"]),
    "misshaped tensor": (_config(intermediate_size=96),
                         ["model.safetensors", "'model.layers.0.mlp.gate_proj.weight' has shape"]),
    "config key of the wrong type": (_config(hidden_size="64"), ["config.json", "hidden_size is '64'", "integer"]),
    "config list for a number": (_config(rms_norm_eps=[1]), ["config.json", "rms_norm_eps", "a number"]),
    "config that is not JSON": (_write("config.json", "{not json"), ["config.json", "not valid JSON"]),
    "tokenizer.json that does not parse": (_write("tokenizer.json", '{"model": {"type": "BPE", "vocab": 5}}'),
                                           ["tokenizer.json", "cannot be read"]),
}


@pytest.fixture
def damaged(tiny_llama_path, tmp_path):
    def make(damage):
        path = tmp_path / "ckpt"
        shutil.copytree(tiny_llama_path, path)
        damage(path)
        return path
    return make


@pytest.mark.parametrize("case", CASES)
def test_a_malformed_checkpoint_is_one_line_naming_the_file_and_the_tensor_or_key(damaged, case):
    from tensorfold_core.loading import load_target

    damage, needles = CASES[case]
    path = damaged(damage)
    with pytest.raises(CheckpointError) as refused:
        load_target(str(path), ServeOptions()).model  # noqa: B018 - loading is the test
    message = str(refused.value)
    assert "\n" not in message and all(n in message for n in needles), message


def test_the_cli_says_it_in_one_line_and_exits_2(damaged):
    path = damaged(_config(hidden_size="64"))
    result = subprocess.run([sys.executable, "-m", "tensorfold_core", "run", str(path), "x"], capture_output=True,
                            text=True, timeout=300, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "config.json: hidden_size" in lines[0]
