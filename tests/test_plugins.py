"""Plugins register only through entry points: installing one adds it, removing it takes it away."""

import os
import subprocess
import sys
import textwrap

import pytest

from tensorfold_core import hookimpl
from tensorfold_core.errors import PluginError
from tensorfold_core.plugins import Registry, new_plugin_manager
from tensorfold_core.specs import Family

PLUGIN = textwrap.dedent('''
    """A throwaway tensorfold plugin for tests."""
    from tensorfold_core import hookimpl
    from tensorfold_core.specs import Family

    def _load(ckpt, options):
        raise NotImplementedError

    @hookimpl
    def tensorfold_families():
        return [Family(name="toy", model_types=("toy_lm",), load=_load)]
''')


def install_throwaway_plugin(site, version="0.3.1"):
    """An installed distribution on a path entry: a module plus its dist-info with the entry point."""
    (site / "toy_tensorfold.py").write_text(PLUGIN)
    info = site / f"toy_tensorfold-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: toy-tensorfold\nVersion: {version}\n")
    (info / "entry_points.txt").write_text("[tensorfold]\ntoy = toy_tensorfold\n")
    return info


def families_output(site):
    env = dict(os.environ, PYTHONPATH=str(site))
    return subprocess.run([sys.executable, "-m", "tensorfold_core", "families"], env=env,
                          capture_output=True, text=True, check=True).stdout


def test_an_installed_plugin_is_listed_with_its_distribution_and_version_and_gone_once_removed(tmp_path):
    info = install_throwaway_plugin(tmp_path)
    listed = families_output(tmp_path)
    assert "toy-tensorfold 0.3.1: families [toy]" in listed
    for path in info.iterdir():
        path.unlink()
    info.rmdir()
    assert "toy-tensorfold" not in families_output(tmp_path)


class ToyPlugin:
    @hookimpl
    def tensorfold_families(self):
        return [Family(name="toy", model_types=("toy_lm", "toy_lm2"), load=lambda ckpt, options: None)]


def test_a_family_is_found_by_model_type_only_while_its_plugin_is_registered():
    pm = new_plugin_manager(entry_points=False)
    plugin = ToyPlugin()
    pm.register(plugin, name="toy")
    assert Registry(pm).family_for("toy_lm2").name == "toy"
    pm.unregister(plugin)
    with pytest.raises(PluginError, match="toy_lm2"):
        Registry(pm).family_for("toy_lm2")


def test_the_installed_llama_plugin_registers_the_llama_family():
    pm = new_plugin_manager()
    names = [f.name for f in Registry(pm).families()]
    assert "llama" in names


def test_a_table_naming_a_record_its_plugin_lacks_or_a_backend_it_cannot_run_is_reported():
    from tensorfold_core.kernels import missing_records
    from tensorfold_llama.kernels import records

    table = {"projection bf16": {"cpu": "mlx", "cuda": "llama gemv bf16", "metal": "llama keyed draw"},
             "norm": {"cpu": "mlx", "cuda": "llama layernorm"}}
    assert missing_records(table, records()) == [
        "projection bf16 on metal: 'llama keyed draw' has no metal implementation", "norm: no metal column",
        "norm on cuda: no record 'llama layernorm'"]
