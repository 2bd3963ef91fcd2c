"""tools/zoo/inflate.py: an inflated zoo model keeps the tiny model's greedy tokens and loads in every loader."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from tensorfold_core.testing import mlx_lm_logits, transformers_logits

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools" / "zoo"))

import inflate  # noqa: E402
from inflate import InflateError, Shape, make_plan  # noqa: E402

TINY = inflate.resolve("tiny-llama")
DRAFTER = inflate.resolve("tiny-llama-drafter")
TEXT = "import sys\n\n\ndef main(argv):\n    for arg in argv:\n"
# hidden x2 (two copies of the hidden vector), two identity layers, wider MLP, head_dim x4, query groups 4 -> 2
TARGET_SHAPE = Shape(hidden=512, layers=10, intermediate=768, heads=8, kv_heads=4, head_dim=128)
DRAFTER_SHAPE = Shape(hidden=512, layers=5, intermediate=384, heads=4, kv_heads=2, head_dim=32)  # hidden x4: norms / 2


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """tiny-llama inflated in float32, sharded into several files so every loader reads the index."""
    out = tmp_path_factory.mktemp("inflated") / "target"
    inflate.inflate(TINY, out, TARGET_SHAPE, "float32", shard_bytes=40_000_000, name="tiny-llama")
    return out


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    out = tmp_path_factory.mktemp("inflated") / "drafter"
    inflate.inflate(DRAFTER, out, DRAFTER_SHAPE, "bfloat16", shard_bytes=10 ** 9, name="tiny-llama-drafter")
    return out


def test_an_inflated_target_keeps_the_tiny_models_greedy_tokens_over_24_tokens_on_3_prompts(target):
    agreements = inflate.compare(TINY, target, 24, "float32", "tensorfold")
    assert [a.equal for a in agreements] == [24, 24, 24]
    assert all(a.max_logit_diff < 1e-3 for a in agreements)


def test_an_inflated_bf16_drafter_with_halved_norm_weights_keeps_its_greedy_tokens(drafter):
    agreements = inflate.compare(DRAFTER, drafter, 24, "float32", "tensorfold")
    assert [a.equal for a in agreements] == [24, 24, 24]


def test_transformers_loads_the_sharded_inflated_checkpoint_with_the_tiny_models_logits(target):
    ids = inflate.tokenizer_ids(TINY, TEXT)
    assert np.abs(transformers_logits(target, ids) - transformers_logits(TINY, ids)).max() < 1e-3


def test_mlx_lm_loads_the_inflated_checkpoints_with_transformers_logits(target, drafter):
    import mlx.core as mx

    ids = inflate.tokenizer_ids(TINY, TEXT)
    for path in (target, drafter):
        ours = np.array(mlx_lm_logits(path, ids, mx.float32))
        assert np.abs(ours - transformers_logits(path, ids)).max() < 1e-3


def test_the_inflated_dir_names_its_source_and_ships_the_same_tokenizer_bytes(target, drafter):
    config = json.loads((target / "config.json").read_text())
    assert config["hidden_size"] == 512 and config["head_dim"] == 128 and config["num_hidden_layers"] == 10
    assert config[inflate.SYNTHETIC_KEY]["source"] == "tiny-llama"
    assert config[inflate.SYNTHETIC_KEY]["identity_layers"] == [8, 9]
    assert (target / "model.safetensors.index.json").exists() and not (target / "model.safetensors").exists()
    drafter_config = json.loads((drafter / "config.json").read_text())
    assert drafter_config["rms_norm_eps"] == 1e-5 / 4 and drafter_config["vocab_size"] == 8256
    for file in inflate.COPIED:
        assert (target / file).read_bytes() == (TINY / file).read_bytes() == (drafter / file).read_bytes()


def test_identity_layers_write_zeros_into_the_residual_stream_and_padding_stays_zero(target):
    weights = inflate.read_weights(target)
    assert not weights["model.layers.9.self_attn.o_proj.weight"].any()
    assert not weights["model.layers.9.mlp.down_proj.weight"].any()
    assert weights["model.layers.9.self_attn.q_proj.weight"].any()  # reads are real, so is their traffic
    embed = weights["model.embed_tokens.weight"]
    assert np.array_equal(embed[:, :256], embed[:, 256:])  # two copies of the hidden vector, nothing else


def test_the_plan_copies_the_hidden_vector_only_where_a_power_of_four_cannot_cover_the_ratio():
    tiny = Shape(256, 8, 640, 8, 2, 32)
    for hidden, copies, shift in [(512, 2, 0), (1024, 1, 1), (2048, 2, 1), (3072, 3, 1), (4096, 1, 2)]:
        plan = make_plan(tiny, Shape(hidden, 8, 640, 8, 2, 32))
        assert (plan.copies, plan.norm_shift) == (copies, shift)
        assert plan.copies * 4 ** plan.norm_shift * 256 == hidden


@pytest.mark.parametrize("name", sorted(inflate.PRESETS))
def test_every_preset_is_a_shape_the_exact_rule_reaches_from_its_zoo_model(name):
    preset = inflate.PRESETS[name]
    source = Shape.of(json.loads((inflate.resolve(preset.model) / "config.json").read_text()))
    plan = make_plan(source, preset.shape)
    assert plan.copies * 4 ** plan.norm_shift * source.hidden == preset.shape.hidden
    assert preset.shape.layers >= source.layers  # the trained layers all kept; extra ones are identity


def test_query_heads_keep_their_kv_head_when_groups_get_narrower():
    plan = make_plan(Shape(256, 8, 640, 8, 2, 32), Shape(256, 8, 640, 12, 4, 32))
    kv_of = plan.query_heads() // (12 // 4)
    assert plan.kv_copies == 2
    assert list(kv_of // plan.kv_copies) == [0, 0, 0, 0, 1, 1, 1, 1]  # each slot copies source kv head c


@pytest.mark.parametrize("shape, named", [
    (Shape(300, 8, 640, 8, 2, 32), "hidden_size"),
    (Shape(512, 8, 640, 8, 2, 64), "head_dim"),
    (Shape(512, 6, 640, 8, 2, 32), "num_hidden_layers"),
    (Shape(512, 8, 640, 6, 2, 32), "num_key_value_heads"),
])
def test_a_width_the_exact_rule_cannot_reach_is_refused_naming_the_key(shape, named):
    with pytest.raises(InflateError, match=named):
        make_plan(Shape(256, 8, 640, 8, 2, 32), shape)


def test_the_check_exits_1_naming_the_first_differing_position(capsys):
    code = inflate.main(["--model", "tiny-llama", "--out", str(DRAFTER), "--check-only", "--tokens", "8"])
    assert code == 1
    assert "first at position" in capsys.readouterr().err


def test_no_check_says_the_tokens_were_not_verified(tmp_path, capsys):
    code = inflate.main(["--model", "tiny-llama-drafter", "--out", str(tmp_path / "d"), "--layers", "5", "--no-check"])
    assert code == 0
    assert "NOT verified" in capsys.readouterr().out


def test_an_out_dir_holding_something_else_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    assert inflate.main(["--model", "tiny-llama-drafter", "--out", str(tmp_path), "--no-check"]) == 2
    assert (tmp_path / "notes.txt").read_text() == "mine"
