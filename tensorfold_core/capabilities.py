"""What this install can do and how it serves: version, backend, device, plugins, serve flags."""

from __future__ import annotations

from . import __version__
from .backend import device_info
from .kernels import describe
from .options import ServeOptions
from .plugins import Registry, registry as default_registry


def serve_flags(registry: Registry | None = None) -> dict:
    """Every serve flag, core's and the plugins', with its default and what it sets."""
    flags = {name: {"default": field.default, "description": field.description}
             for name, field in ServeOptions.flag_fields().items()}
    for option, plugin in (registry or default_registry()).serve_options_by_plugin():
        flags[option.name] = {"default": option.default, "description": option.help, "plugin": plugin,
                              **({"choices": list(option.choices)} if option.choices else {})}
    return flags


def capabilities(options: ServeOptions, extra: dict | None = None, registry: Registry | None = None) -> dict:
    """The install's facts and this server's options; `extra` adds what loading found (model, probe, memory)."""
    reg = registry or default_registry()
    return {
        "version": __version__,
        **device_info(),
        "families": [{"name": f.name, "model_types": list(f.model_types),
                      **({"kernels": describe(f.kernels)} if f.kernels else {})} for f in reg.families()],
        "drafters": [d.name for d in reg.drafters()],
        "drafter_kernels": {d.name: describe(d.kernels) for d in reg.drafters() if d.kernels},
        "models": [{"name": m.name, "role": m.role, "default": m.default} for m in reg.models()],
        "plugins": reg.roll_call(),
        "serve_flags": serve_flags(reg),
        "options": {**options.model_dump(), **options.plugin_options},
        **(extra or {}),
    }
