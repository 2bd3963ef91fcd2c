"""The DSpark drafter's own ops under the kernel contract: one record a module."""

from __future__ import annotations

import importlib

MODULES = ("markov",)  # each defines RECORD


def records() -> list:
    """Every record this plugin ships (mlx and the contract load only when the contract runs)."""
    return [importlib.import_module(f"{__name__}.{name}").RECORD for name in MODULES]
