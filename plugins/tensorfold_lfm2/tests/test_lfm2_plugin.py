"""The lfm2 plugin registers its two families and the shipped checkpoints that are present, and nothing else does."""

from __future__ import annotations

import pytest

from tensorfold_core.errors import PluginError
from tensorfold_core.plugins import Registry, new_plugin_manager
from tensorfold_lfm2 import plugin


def lfm2_registry() -> Registry:
    pm = new_plugin_manager(entry_points=False)
    pm.register(plugin)
    return Registry(pm)


def test_a_manager_with_the_lfm2_plugin_lists_one_family_per_model_type():
    registry = lfm2_registry()
    assert [f.name for f in registry.families()] == ["lfm2", "lfm2_moe"]
    assert registry.family_for("lfm2").name == "lfm2" and registry.family_for("lfm2_moe").name == "lfm2_moe"


def test_without_the_plugin_no_family_reads_lfm2():
    with pytest.raises(PluginError, match="model_type 'lfm2_moe'"):
        Registry(new_plugin_manager(entry_points=False)).family_for("lfm2_moe")


def test_the_plugin_is_found_through_its_entry_point():
    assert {"lfm2", "lfm2_moe"} <= {f.name for f in Registry(new_plugin_manager()).families()}


def test_only_the_shipped_checkpoints_present_are_listed_as_targets(tmp_path, monkeypatch):
    monkeypatch.setattr(plugin, "MODELS", tmp_path)
    assert plugin.tensorfold_models() == []
    (tmp_path / "tiny-lfm2-moe-4bit").mkdir()
    (models,) = plugin.tensorfold_models()
    assert models.name == "tiny-lfm2-moe-4bit" and models.role == "target" and not models.default
    assert models.path == tmp_path / "tiny-lfm2-moe-4bit"
    for name in ("tiny-lfm2", "tiny-lfm2-moe"):
        (tmp_path / name).mkdir()
    assert [m.name for m in plugin.tensorfold_models()] == ["tiny-lfm2", "tiny-lfm2-moe", "tiny-lfm2-moe-4bit"]
