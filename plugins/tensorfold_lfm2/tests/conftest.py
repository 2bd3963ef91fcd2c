"""Fixtures of the lfm2 family's tests: tiny checkpoints made once per session (mlx-lm conversions too)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lfm2_helpers import tiny_lfm2_checkpoint


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """make(name, moe=False, **overrides) -> a tiny lfm2 (or lfm2_moe) checkpoint dir, written once per name."""
    root, made = tmp_path_factory.mktemp("ckpts"), {}

    def make(name: str, moe: bool = False, **overrides) -> Path:
        if name not in made:
            made[name] = tiny_lfm2_checkpoint(root / name, moe=moe, **overrides)
        return made[name]

    return make


@pytest.fixture(scope="session")
def converted(tmp_path_factory, checkpoints):
    """convert(name, bits=4, group_size=64, moe=False, **overrides) -> mlx-lm's own conversion (bits 0: unquantized)."""
    from mlx_lm.convert import convert

    root, made = tmp_path_factory.mktemp("mlx"), {}

    def make(name: str, bits: int = 4, group_size: int = 64, moe: bool = False, **overrides) -> Path:
        key = f"{name}-q{bits}g{group_size}" if bits else f"{name}-mlx"
        if key not in made:
            convert(str(checkpoints(name, moe=moe, **overrides)), str(root / key), quantize=bool(bits),
                    q_bits=bits or 4, q_group_size=group_size)
            made[key] = root / key
        return made[key]

    return make
