"""The llama plugin registers its family and the shipped checkpoints that are present, and nothing else does."""

from __future__ import annotations

import pytest

from tensorfold_core.errors import PluginError
from tensorfold_core.plugins import Registry, new_plugin_manager
from tensorfold_llama import plugin


def test_a_manager_with_the_llama_plugin_lists_the_llama_family_for_llama_and_mistral():
    pm = new_plugin_manager(entry_points=False)
    pm.register(plugin)
    registry = Registry(pm)
    assert [f.name for f in registry.families()] == ["llama"]
    assert registry.family_for("llama").name == registry.family_for("mistral").name == "llama"


def test_without_the_plugin_no_family_reads_llama():
    with pytest.raises(PluginError, match="model_type 'llama'"):
        Registry(new_plugin_manager(entry_points=False)).family_for("llama")


def test_the_plugin_is_found_through_its_entry_point():
    assert "llama" in [f.name for f in Registry(new_plugin_manager()).families()]


def test_only_the_shipped_checkpoints_present_are_listed(tmp_path, monkeypatch):
    monkeypatch.setattr(plugin, "MODELS", tmp_path)
    assert plugin.tensorfold_models() == []
    (tmp_path / "tiny-llama").mkdir()
    (tmp_path / "tiny-llama-drafter-4bit").mkdir()
    models = {m.name: m for m in plugin.tensorfold_models()}
    assert sorted(models) == ["tiny-llama", "tiny-llama-drafter-4bit"]
    target, drafter = models["tiny-llama"], models["tiny-llama-drafter-4bit"]
    assert target.default and target.drafter == "tiny-llama-drafter" and target.role == "target"
    assert drafter.role == "drafter" and not drafter.default and drafter.path == tmp_path / "tiny-llama-drafter-4bit"
