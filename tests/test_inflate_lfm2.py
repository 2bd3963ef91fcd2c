"""tools/zoo/inflate_lfm2.py: the inflated lfm2 target keeps its tokens and the inflated DSpark pair its drafts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools" / "zoo"))

import inflate  # noqa: E402
import inflate_lfm2  # noqa: E402
from inflate import InflateError, Shape  # noqa: E402

TINY = inflate.resolve("tiny-lfm2")
DSPARK = inflate.resolve("tiny-lfm2-dspark")
# hidden x4 (norms / 2, eps / 4) with head_dim x4 (k norms / 2), two identity layers of either kind
TARGET_SHAPE = Shape(hidden=1024, layers=8, intermediate=1024, heads=8, kv_heads=2, head_dim=128)
LAYER_TYPES = ("conv", "conv", "full_attention", "conv", "conv", "full_attention", "conv", "full_attention")
DRAFTER_SHAPE = Shape(hidden=1024, layers=2, intermediate=768, heads=8, kv_heads=2, head_dim=128)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    out = tmp_path_factory.mktemp("inflated")
    inflate_lfm2.inflate_target(TINY, out / "target", TARGET_SHAPE, LAYER_TYPES, "float32")
    inflate_lfm2.inflate_drafter(DSPARK, out / "drafter", DRAFTER_SHAPE, len(LAYER_TYPES), "bfloat16")
    return out / "target", out / "drafter"


def test_the_inflated_target_keeps_the_tiny_lfm2_greedy_tokens(pair):
    agreements = inflate.compare(TINY, pair[0], 16, "float32", "tensorfold")
    assert [a.equal for a in agreements] == [16] * len(inflate.PROMPTS)


def test_the_inflated_dspark_pair_keeps_the_tiny_pairs_drafts_round_for_round(pair, capsys):
    assert inflate_lfm2.check_pair((TINY, DSPARK), pair, tokens=24) == 0
    assert "round for round" in capsys.readouterr().out


def test_a_broken_k_norm_scale_changes_the_tokens(tmp_path, monkeypatch):
    """The check can fail: k norms left unscaled at head_dim x4 double every attention score."""
    attention = inflate_lfm2.attention

    def unscaled(plan, take, src, dst, names, real):
        tensors = attention(plan, take, src, dst, names, real)
        for t in tensors:
            if t.name.endswith(names["k_norm"]):
                t.blocks = [(rows, cols, values * np.float32(2.0)) for rows, cols, values in t.blocks]
        return tensors

    monkeypatch.setattr(inflate_lfm2, "attention", unscaled)
    inflate_lfm2.inflate_target(TINY, tmp_path / "broken", TARGET_SHAPE, (), "float32")
    assert any(a.first for a in inflate.compare(TINY, tmp_path / "broken", 16, "float32", "tensorfold"))


def test_identity_layers_write_zeros_and_each_conv_chunk_holds_the_source_channels(pair):
    weights = inflate.read_weights(pair[0])
    tiny = inflate.read_weights(TINY)
    assert not weights["model.layers.6.conv.out_proj.weight"].any()
    assert not weights["model.layers.7.self_attn.out_proj.weight"].any()
    assert not weights["model.layers.7.feed_forward.w2.weight"].any()
    assert weights["model.layers.7.self_attn.q_proj.weight"].any()  # reads are real, so is their traffic
    in_proj, source = weights["model.layers.0.conv.in_proj.weight"], tiny["model.layers.0.conv.in_proj.weight"]
    for chunk in range(3):
        assert np.array_equal(in_proj[chunk * 1024:chunk * 1024 + 256, :256], source[chunk * 256:(chunk + 1) * 256])
    config = json.loads((pair[0] / "config.json").read_text())
    assert config["layer_types"] == list(LAYER_TYPES) and config["norm_eps"] == pytest.approx(1e-5 / 4)
    assert config["block_auto_adjust_ff_dim"] is False and config["intermediate_size"] == 1024


def test_the_drafter_reads_every_tap_and_keeps_its_heads_and_the_targets_layer_count(pair):
    weights = inflate.read_weights(pair[1])
    tiny = inflate.read_weights(DSPARK)
    fc = weights["fc.weight"]
    for tap in range(3):
        assert np.array_equal(fc[:256, tap * 1024:tap * 1024 + 256], tiny["fc.weight"][:, tap * 256:(tap + 1) * 256])
    assert np.array_equal(weights["markov_head.markov_w1.weight"], tiny["markov_head.markov_w1.weight"])
    confidence = weights["confidence_head.proj.weight"]
    assert confidence.shape == (1, 1024 + 32)
    assert np.array_equal(confidence[:, 1024:], tiny["confidence_head.proj.weight"][:, 256:])
    config = json.loads((pair[1] / "config.json").read_text())
    assert config["dflash_config"]["num_target_layers"] == 8 and config["head_dim"] == 128


def test_widths_whose_norm_shifts_disagree_are_refused():
    with pytest.raises(InflateError, match="one eps"):
        inflate_lfm2.lfm2_plan(Shape(256, 6, 512, 8, 2, 32), Shape(512, 6, 512, 8, 2, 128))


def test_layer_kinds_must_start_with_the_sources_and_name_a_kind_it_has():
    with pytest.raises(InflateError, match="must start with"):
        inflate_lfm2.layer_sources(["conv", "full_attention"], ("full_attention", "conv"))
    with pytest.raises(InflateError, match="no layer of that kind"):
        inflate_lfm2.layer_sources(["conv"], ("conv", "full_attention"))


def test_a_drafter_preset_refuses_a_target_that_was_not_inflated_before_writing(tmp_path, capsys):
    out = tmp_path / "drafter"
    assert inflate_lfm2.main(["--preset", "lfm2-dspark-0.1b", "--out", str(out), "--target", str(TINY)]) == 2
    assert "not an inflated target" in capsys.readouterr().err and not out.exists()


def test_a_self_check_this_python_cannot_run_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorfold_core", None)  # as on a machine that has MLX but not tensorfold
    out = tmp_path / "target"
    assert inflate_lfm2.main(["--preset", "lfm2-1b", "--out", str(out)]) == 2
    assert "cannot import" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("name", sorted(inflate_lfm2.PRESETS))
def test_every_preset_is_a_shape_the_rule_reaches(name):
    preset = inflate_lfm2.PRESETS[name]
    source = inflate.resolve(preset.model)
    config = json.loads((source / "config.json").read_text())
    inner = "model.layers.0.feed_forward.w1.weight" if preset.layer_types else "layers.0.mlp.gate_proj.weight"
    shape = inflate_lfm2.source_shape(config, inflate.read_weights(source), inner)
    plan = inflate_lfm2.lfm2_plan(shape, preset.shape, interleaved=not preset.layer_types)
    assert plan.copies * 4 ** plan.norm_shift * shape.hidden == preset.shape.hidden
    if preset.layer_types:  # a target: lfm2 derives head_dim from the hidden size and the heads
        inflate_lfm2.layer_sources(config["layer_types"], preset.layer_types)
        assert preset.shape.heads * preset.shape.head_dim == preset.shape.hidden
