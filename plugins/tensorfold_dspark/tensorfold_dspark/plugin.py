"""The dspark plugin's hooks: the DSpark drafter kind (drafting for the lfm2 families' targets through their taps)."""

from __future__ import annotations

from tensorfold_core import hookimpl
from tensorfold_core.specs import DrafterKind


@hookimpl
def tensorfold_drafters():
    return [DrafterKind.of_module("dspark", "tensorfold_dspark.drafter", description="DSpark: block drafts from the "
                                  "target's layer taps, Markov and confidence heads")]


@hookimpl
def tensorfold_kernels():
    from .kernels import RECORD  # mlx and the contract load only when the contract runs

    return [RECORD]
