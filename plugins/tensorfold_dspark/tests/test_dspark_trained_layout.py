"""The zoo's torch DSpark trainer and the MLX drafter agree: its export loads, and a hold's logits are the torch ones."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from tensorfold_core.checkpoint import Checkpoint
from tensorfold_core.loading import start_drafter
from tensorfold_core.protocols import DraftAsk
from tensorfold_core.testing import PROMPT
from tensorfold_dspark.model import Block
from tensorfold_lfm2.load import load

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools" / "zoo"))

from dspark_torch import DSparkDrafter, DSparkSpec, hold, write_checkpoint  # noqa: E402

DEPTH = 8
PENDING = 9


def torch_drafter(target_dir: Path) -> DSparkDrafter:
    """A random torch drafter for the test target, its weights wide enough that drafts are clear choices."""
    t = json.loads((target_dir / "config.json").read_text())
    spec = DSparkSpec(hidden_size=t["hidden_size"], vocab_size=t["vocab_size"], num_target_layers=t["num_hidden_layers"],
                      target_layer_ids=[0, 2, 3], num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      intermediate_size=128, markov_rank=64, block_size=DEPTH, eos_token_id=t["eos_token_id"])
    torch.manual_seed(0)
    drafter = DSparkDrafter(spec)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else torch.randn_like(p) * 0.3)
    return drafter


def served_weights(model: nn.Module) -> dict[str, np.ndarray]:
    """The MLX drafter's parameters by name, its 8-bit codes unpacked to the float values it really serves."""
    packed = {path for path, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    out = {}
    for path in packed:
        m = model[path] if "." not in path else None
        m = m or _module(model, path)
        out[f"{path}.weight"] = np.array(mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits))
    for name, value in tree_flatten(model.parameters()):
        if name.rpartition(".")[0] not in packed:
            out[name] = np.array(value.astype(mx.float32))
    return out


def _module(model: nn.Module, path: str) -> nn.Module:
    for part in path.split("."):
        model = model[int(part)] if part.isdigit() else model[part]
    return model


def committed(target):
    cache = target.new_cache(64)
    target.forward([cache], [PROMPT], [0])
    target.keep(cache, len(PROMPT))
    return cache


@pytest.fixture(scope="module")
def pair(target_dir, tmp_path_factory):
    drafter = torch_drafter(target_dir)
    path = write_checkpoint(drafter, tmp_path_factory.mktemp("trained") / "dspark", target_dir, dtype=torch.float32)
    target = load(Checkpoint.open(target_dir))
    served = start_drafter(str(path), target, Checkpoint.open(target_dir).tokenizer())
    served.eos_ids = frozenset()  # the torch hold does not stop at an eos
    # the torch drafter takes the served values by the same names: the layout and the 8-bit rounding both pinned
    drafter.load_state_dict({k: torch.from_numpy(v) for k, v in served_weights(served.model).items()}, strict=True)
    yield target, served, drafter
    served.close()


def test_an_exported_checkpoint_is_the_published_layout_the_dspark_kind_reads(pair):
    target, served, drafter = pair
    assert served.block_size == DEPTH and served.mask_id == drafter.spec.mask_token_id
    assert served.model.args.target_layer_ids == drafter.spec.target_layer_ids
    assert served.facts.chances  # the confidence head was read


def test_a_served_holds_logits_drafts_and_chances_are_the_torch_drafters_on_the_same_taps(pair):
    target, served, drafter = pair
    tapped = np.array(target.take_features(committed(target)).rows.astype(mx.float32))
    drafts = served.propose([DraftAsk(0, PROMPT + [PENDING], DEPTH, cache=committed(target))])[0]
    embedding = torch.from_numpy(np.array(target.model.embed_tokens.weight.astype(mx.float32)))
    logits, want, chances = hold(drafter, embedding, torch.from_numpy(tapped), PENDING, DEPTH)
    assert drafts == want
    assert np.allclose(served.chances(0), chances, rtol=1e-4, atol=1e-6)
    lane = served.lanes[0]
    ids = mx.array([PENDING] + [served.mask_id] * (DEPTH - 1), dtype=mx.uint32)
    final = served.model.blocks(target.embed(ids), [Block(0, DEPTH, len(PROMPT), lane)])
    previous = mx.array([PENDING] + drafts[:-1], dtype=mx.uint32)
    got = np.array(target.head(final) + served.model.markov_head(previous))
    assert np.allclose(got, logits.numpy(), rtol=1e-4, atol=1e-4 * float(np.abs(got).max()))
