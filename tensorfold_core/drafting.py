"""Putting a plugin's drafter in front of a target: resolve, match a drafter kind, admit, start."""

from __future__ import annotations

from .checkpoint import Checkpoint, resolve_model
from .errors import DrafterError
from .plugins import registry
from .protocols import Proposer


def drafter_name(model_name: str, requested: str | None) -> str | None:
    """The drafter to start: the flag's, else the shipped model's own; 'none' turns drafting by a model off."""
    if requested is not None:
        return None if requested.lower() == "none" else requested
    shipped = registry().shipped(model_name)
    return shipped.drafter if shipped is not None else None


def start_drafter(name: str, bits: int | None, target_model, target_tokenizer, *, dtype: str = "auto",
                  max_depth: int = 15) -> Proposer:
    """A started drafter admitted for this target, or a DrafterError saying why not."""
    ckpt = Checkpoint.open(resolve_model(name))
    kinds = [kind for kind in registry().drafters() if kind.matches(ckpt)]
    if not kinds:
        known = ", ".join(k.name for k in registry().drafters()) or "none installed"
        raise DrafterError(f"--drafter {name}: no installed drafter kind reads model_type {ckpt.model_type!r} "
                           f"(drafter kinds: {known})")
    kind = kinds[0]
    kind.admit(target_tokenizer, target_model, ckpt, bits)
    options = {"dtype": dtype, "max_depth": max_depth, "eos_ids": frozenset(target_tokenizer.eos_ids)}
    return kind.start(target_model, ckpt, options)
