"""The hooks a tensorfold plugin implements: the only contract between core and plugins."""

import pluggy

hookspec = pluggy.HookspecMarker("tensorfold")


@hookspec
def tensorfold_families():
    """Called once at start-up; return a list of `specs.Family` this plugin serves."""


@hookspec
def tensorfold_drafters():
    """Called once at start-up; return a list of `specs.DrafterKind` this plugin provides."""


@hookspec
def tensorfold_kernels():
    """Called by the contract runner; return a list of `tensorfold_contract.KernelRecord`."""


@hookspec
def tensorfold_models():
    """Called when a model name is resolved; return a list of `specs.ShippedModel` shipped as package data."""


@hookspec
def tensorfold_serve_options():
    """Called for `capabilities --json`; return a list of `specs.ServeOption` this plugin adds."""
