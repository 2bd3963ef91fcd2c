"""The plugin manager: entry points of group "tensorfold", and lookups by name and model_type."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import pluggy

from . import hookspecs
from .errors import PluginError
from .specs import DrafterKind, Family, ServeOption, ShippedModel


def new_plugin_manager(entry_points: bool = True) -> pluggy.PluginManager:
    """A fresh manager with the hookspecs added and, unless told otherwise, every installed plugin loaded."""
    pm = pluggy.PluginManager("tensorfold")
    pm.add_hookspecs(hookspecs)
    if entry_points:
        pm.load_setuptools_entrypoints("tensorfold")
    return pm


@functools.cache
def plugin_manager() -> pluggy.PluginManager:
    """The process-wide manager over the installed plugin distributions."""
    return new_plugin_manager()


def _flatten(results) -> list:
    return [item for batch in results for item in (batch or [])]


@dataclass
class Registry:
    """What a plugin manager's plugins register, looked up by name."""

    pm: pluggy.PluginManager = field(default_factory=plugin_manager)

    def families(self) -> list[Family]:
        return _flatten(self.pm.hook.tensorfold_families())

    def drafters(self) -> list[DrafterKind]:
        return _flatten(self.pm.hook.tensorfold_drafters())

    def kernels(self) -> list:
        return _flatten(self.pm.hook.tensorfold_kernels())

    def models(self) -> list[ShippedModel]:
        return _flatten(self.pm.hook.tensorfold_models())

    def serve_options(self) -> list[ServeOption]:
        return [option for option, _ in self.serve_options_by_plugin()]

    def serve_options_by_plugin(self) -> list[tuple[ServeOption, str]]:
        """Every plugin flag with the plugin that adds it; two plugins may not add the same flag."""
        out, seen = [], {}
        for impl in reversed(self.pm.hook.tensorfold_serve_options.get_hookimpls()):  # registration order
            for option in impl.function() or []:
                if option.name in seen:
                    raise PluginError(f"serve flag --{option.name} is added by both {seen[option.name]} and "
                                      f"{impl.plugin_name}")
                seen[option.name] = impl.plugin_name
                out.append((option, impl.plugin_name))
        return out

    def family_for(self, model_type: str) -> Family:
        for family in self.families():
            if model_type in family.model_types:
                return family
        known = sorted({t for f in self.families() for t in f.model_types})
        raise PluginError(
            f"no installed family reads model_type {model_type!r} (installed: {', '.join(known) or 'none'}); "
            "install the plugin that serves it, e.g. `pip install tensorfold-llama`")

    def shipped(self, name: str) -> ShippedModel | None:
        return next((m for m in self.models() if m.name == name), None)

    def default_model(self) -> ShippedModel:
        defaults = [m for m in self.models() if m.default]
        if not defaults:
            raise PluginError("no installed plugin ships a default model; give MODEL "
                              "(or `pip install tensorfold-llama`, which ships tiny-llama)")
        return defaults[0]

    def roll_call(self) -> list[dict]:
        """One row per plugin: its distribution, version and what it registers."""
        dists = {id(plugin): dist for plugin, dist in self.pm.list_plugin_distinfo()}
        rows = []
        for name, plugin in self.pm.list_name_plugin():
            if plugin is None:
                continue
            dist = dists.get(id(plugin))
            call = lambda hook: _flatten([getattr(plugin, hook)()]) if hasattr(plugin, hook) else []
            rows.append({
                "plugin": name,
                "distribution": dist.metadata["name"] if dist else None,
                "version": dist.version if dist else None,
                "families": [f.name for f in call("tensorfold_families")],
                "drafters": [d.name for d in call("tensorfold_drafters")],
                "kernels": len(call("tensorfold_kernels")),
                "models": [m.name for m in call("tensorfold_models")],
            })
        return rows


@functools.cache
def registry() -> Registry:
    """The process-wide registry over the installed plugins."""
    return Registry()
