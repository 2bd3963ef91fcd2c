"""The dspark plugin's hooks: the DSpark drafter kind (drafting for the lfm2 families' targets through their taps)."""

from __future__ import annotations

from pathlib import Path

from tensorfold_core import hookimpl
from tensorfold_core.specs import DrafterKind, ShippedModel

MODELS = Path(__file__).parent / "models"

SHIPPED = [
    dict(name="tiny-lfm2-moe-dspark", role="drafter", description="the DSpark drafter of tiny-lfm2-moe"),
    dict(name="tiny-lfm2-dspark", role="drafter", description="the DSpark drafter of tiny-lfm2"),
]


@hookimpl
def tensorfold_drafters():
    from .ops import OPS

    return [DrafterKind.of_module("dspark", "tensorfold_dspark.drafter", description="DSpark: block drafts from the "
                                  "target's layer taps, Markov and confidence heads", kernels=OPS)]


@hookimpl
def tensorfold_models():
    return [ShippedModel(path=MODELS / spec["name"], **spec) for spec in SHIPPED if (MODELS / spec["name"]).is_dir()]


@hookimpl
def tensorfold_kernels():
    from .kernels import records  # mlx and the contract load only when the contract runs

    return records()
