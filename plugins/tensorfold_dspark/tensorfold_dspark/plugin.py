"""The dspark plugin's hooks: the DSpark drafter kind (drafting for the lfm2 families' targets through their taps)."""

from __future__ import annotations

from tensorfold_core import hookimpl
from tensorfold_core.specs import DrafterKind


def _drafter_call(name: str):
    """A DrafterKind callable that imports the drafter (and mlx) only when a drafter is asked for."""

    def call(*args, **kwargs):
        from . import drafter

        return getattr(drafter, name)(*args, **kwargs)

    return call


@hookimpl
def tensorfold_drafters():
    return [DrafterKind(name="dspark", matches=_drafter_call("matches"), admit=_drafter_call("admit"),
                        start=_drafter_call("start"),
                        description="DSpark: block drafts from the target's layer taps, Markov and confidence heads")]


@hookimpl
def tensorfold_kernels():
    from .kernels import RECORD  # mlx and the contract load only when the contract runs

    return [RECORD]
