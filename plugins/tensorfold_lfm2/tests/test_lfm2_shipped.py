"""The shipped tiny checkpoints load by name, window exactly, match mlx-lm, and keep states inside drafted windows."""

from __future__ import annotations

import mlx.core as mx
import pytest

from lfm2_helpers import DRAFTS, Spy, solo
from tensorfold_core.loading import load_model
from tensorfold_core.lanes.types import GenerationRequest
from tensorfold_core.plugins import Registry, new_plugin_manager
from tensorfold_core.sampling import SamplingParams
from tensorfold_core.specs import LoadOptions
from tensorfold_core.testing import Run, mlx_lm_logits, window_logits as run
from tensorfold_lfm2 import plugin

CODE = ["import os\nimport sys\nimport os.path\n\n\ndef main(argv):\n    for arg in argv:\n        print(arg)\n\n\n"
        "def main(", "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
        "    def __repr__(self):\n        return"]


def shipped(name, dtype="auto"):
    if not (plugin.MODELS / name).is_dir():
        pytest.skip(f"{name} is not shipped in this checkout")
    pm = new_plugin_manager(entry_points=False)
    pm.register(plugin)
    return load_model(name, LoadOptions(dtype=dtype), registry=Registry(pm))


@pytest.mark.parametrize("name", ["tiny-lfm2", "tiny-lfm2-moe", "tiny-lfm2-moe-4bit"])
def test_a_shipped_checkpoint_loads_by_name_and_a_window_gives_the_rows_of_one_row_steps(name):
    model, tokenizer, ckpt = shipped(name)
    assert ckpt.path == plugin.MODELS / name and model.dtype == mx.bfloat16
    tokens = tokenizer.backend.encode(CODE[0]).ids[:6] + DRAFTS[:3]
    assert mx.array_equal(run(model, tokens, [6, 3])[6:], run(model, tokens, [6, 1, 1, 1])[6:])


@pytest.mark.parametrize("name", ["tiny-lfm2", "tiny-lfm2-moe-4bit"])
def test_a_shipped_checkpoint_matches_mlx_lm_bit_for_bit(name):
    model, tokenizer, ckpt = shipped(name)
    prompt = tokenizer.backend.encode(CODE[1]).ids[:8]
    assert mx.array_equal(run(model, prompt), mlx_lm_logits(ckpt.path, prompt))


@pytest.mark.parametrize("name", ["tiny-lfm2", "tiny-lfm2-moe"])
def test_on_code_a_trained_model_accepts_part_of_a_copied_window_and_replies_as_the_serial_run(name):
    model, tokenizer, _ = shipped(name, dtype="float32")  # float32 runs on the CPU's BLAS
    model = Spy(model)
    requests = []
    for text in CODE:
        ids = tokenizer.backend.encode(text).ids
        requests += [GenerationRequest(prompt_ids=ids, max_tokens=32),
                     GenerationRequest(prompt_ids=ids, max_tokens=32, sampling=SamplingParams(temperature=0.7, seed=3))]
    references = [solo(model, request) for request in requests]
    model.keeps.clear()
    engine = Run(model, parallel=4)
    for sid, request in enumerate(requests):
        engine.submit(sid, request)
    engine.finish()
    assert [engine.tokens(sid) for sid in range(len(requests))] == references
    assert any(1 < rows < window for rows, window in model.keeps)  # drafts accepted, then one cut, in one window
