"""The DSpark drafter's own ops under the kernel contract: every module here that defines RECORD is one record."""

from __future__ import annotations

import importlib
import pkgutil


def records() -> list:
    """Every record this plugin ships, by module name (mlx and the contract load only when the contract runs)."""
    modules = (importlib.import_module(f"{__name__}.{m.name}") for m in sorted(pkgutil.iter_modules(__path__),
                                                                                 key=lambda m: m.name))
    return [module.RECORD for module in modules if hasattr(module, "RECORD")]
