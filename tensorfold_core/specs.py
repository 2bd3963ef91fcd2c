"""The small typed objects plugins hand to core through the hooks."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .checkpoint import Checkpoint
    from .protocols import Model


@dataclass(frozen=True)
class LoadOptions:
    """How a family should materialise a checkpoint."""

    dtype: str = "auto"  # auto keeps the checkpoint's float dtype; else bfloat16, float16 or float32


@dataclass(frozen=True)
class Family:
    """A model architecture: which config.json model_types it reads and how it loads them."""

    name: str
    model_types: tuple[str, ...]
    load: Callable[["Checkpoint", LoadOptions], "Model"]
    description: str = ""


@dataclass(frozen=True)
class ShippedModel:
    """A checkpoint a plugin ships as package data, served by name."""

    name: str
    path: Path
    role: str = "target"  # "drafter": admitted only as a drafter, refused when served alone
    drafter: str | None = None  # the shipped drafter served beside it by default
    default: bool = False  # the model `tensorfold serve` serves when no MODEL is given
    description: str = ""


@dataclass(frozen=True)
class DrafterKind:
    """A kind of drafter: which checkpoints it drives and how it starts in front of a target."""

    name: str
    matches: Callable[["Checkpoint"], bool]
    admit: Callable[..., None]
    start: Callable[..., object]
    description: str = ""


@dataclass(frozen=True)
class ServeOption:
    """A plugin's serve flag, shown in `capabilities --json`."""

    name: str
    help: str
    default: object = None
    choices: tuple = field(default_factory=tuple)
