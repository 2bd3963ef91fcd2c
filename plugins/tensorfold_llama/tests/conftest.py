"""Fixtures of the llama family's tests: tiny checkpoints made once per session (mlx-lm conversions too)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tensorfold_core.testing import tiny_llama_checkpoint


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """make(name, **overrides) -> a tiny llama checkpoint dir, written once per name."""
    root, made = tmp_path_factory.mktemp("ckpts"), {}

    def make(name: str, **overrides) -> Path:
        if name not in made:
            made[name] = tiny_llama_checkpoint(root / name, **overrides)
        return made[name]

    return make


@pytest.fixture(scope="session")
def quantized(tmp_path_factory, checkpoints):
    """quant(source_name, bits, group_size, predicate=None, **overrides) -> mlx-lm's own conversion of a tiny llama."""
    from mlx_lm.convert import convert

    root, made = tmp_path_factory.mktemp("quant"), {}

    def quant(name: str, bits: int, group_size: int, predicate=None, tag: str = "", **overrides) -> Path:
        key = f"{name}-q{bits}g{group_size}{tag}"
        if key not in made:
            convert(str(checkpoints(name, **overrides)), str(root / key), quantize=True, q_bits=bits,
                    q_group_size=group_size, quant_predicate=predicate)
            made[key] = root / key
        return made[key]

    return quant

