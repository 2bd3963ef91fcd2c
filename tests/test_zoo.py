"""The shipped zoo: every model loads by name, agrees with transformers (or mlx-lm for MLX 4-bit dirs), and a
pair shares one tokenizer byte for byte."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from tensorfold_core.checkpoint import Checkpoint
from tensorfold_core.errors import DrafterError
from tensorfold_core.loading import drafter_only, load_model, load_target
from tensorfold_core.options import ServeOptions
from tensorfold_core.plugins import registry
from tensorfold_core.specs import LoadOptions

TEXT = "import os\nimport sys\n\n\ndef main(argv):\n    for arg in argv:\n        print(arg)\n"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def shipped_models():
    return {m.name: m for m in registry().models()}


def every_row(model, tokens):
    cache = model.new_cache(len(tokens))
    logits = model.forward([cache], [tokens], [len(tokens)])
    model.keep(cache, len(tokens))
    return np.array(logits)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-llama-drafter", "tiny-lfm2", "tiny-lfm2-moe"])
def test_a_shipped_float_model_matches_transformers_on_every_row(name):
    import torch
    from transformers import AutoModelForCausalLM

    model, tokenizer, ckpt = load_model(name, LoadOptions(dtype="float32"))
    tokens = tokenizer.encode(TEXT)
    ours = every_row(model, tokens)
    reference = AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = reference(torch.tensor([tokens])).logits[0].numpy()
    assert np.abs(ours - theirs).max() < 1e-4


@pytest.mark.parametrize("name", ["tiny-llama-drafter-4bit", "tiny-lfm2-moe-4bit"])
def test_a_shipped_4bit_model_matches_mlx_lm_bit_for_bit(name):
    import mlx_lm

    model, tokenizer, ckpt = load_model(name)
    tokens = tokenizer.encode(TEXT)[:12]
    reference, _ = mlx_lm.load(str(ckpt.path))
    theirs = reference(mx.array([tokens]))[0].astype(mx.float32)
    assert np.array_equal(every_row(model, tokens), np.array(theirs))


def test_every_shipped_model_shares_one_tokenizer_byte_for_byte():
    models = shipped_models()
    assert {"tiny-llama", "tiny-llama-drafter", "tiny-llama-drafter-4bit", "tiny-lfm2", "tiny-lfm2-moe",
            "tiny-lfm2-moe-4bit"} <= set(models)
    first = models["tiny-llama"].path
    for model in models.values():
        for name in TOKENIZER_FILES:
            assert (model.path / name).read_bytes() == (first / name).read_bytes(), f"{model.name}/{name}"


def test_the_default_model_is_tiny_llama_drafted_by_its_drafter_which_is_drafter_only():
    models = shipped_models()
    assert registry().default_model().name == "tiny-llama"
    assert models["tiny-llama"].drafter == "tiny-llama-drafter"
    assert models["tiny-llama-drafter"].role == "drafter"
    config = json.loads((models["tiny-llama-drafter"].path / "config.json").read_text())
    assert config["vocab_size"] != json.loads((models["tiny-llama"].path / "config.json").read_text())["vocab_size"]


def test_serving_a_drafter_only_model_alone_is_refused_by_name():
    result = subprocess.run([sys.executable, "-m", "tensorfold_core", "run", "tiny-llama-drafter", "x"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "tiny-llama-drafter is admitted only as a drafter" in result.stderr


def test_a_local_copy_of_the_drafter_is_known_as_drafter_only_by_its_own_config(tmp_path):
    models = shipped_models()
    copy = shutil.copytree(models["tiny-llama-drafter"].path, tmp_path / "my-drafter")
    assert drafter_only(Checkpoint.open(copy)) and not drafter_only(Checkpoint.open(models["tiny-llama"].path))
    with pytest.raises(DrafterError, match=f"{copy} is admitted only as a drafter; serve a target with --drafter"):
        load_target(str(copy), ServeOptions())


def test_run_by_name_continues_python_and_drafted_equals_plain():
    result = subprocess.run([sys.executable, "-m", "tensorfold_core", "run", "tiny-llama", "import os\nimport",
                             "--max-tokens", "24", "--json", "--draft", "tiny-llama-drafter,4"],
                            capture_output=True, text=True, timeout=300, check=True)
    report = json.loads(result.stdout)
    assert report["equal_to_plain"] is True
    assert sum(r["kept"] for r in report["rounds"]) > 0  # the trained pair agrees: drafts land
