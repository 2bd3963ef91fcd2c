"""The small typed objects plugins hand to core through the hooks."""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

from .errors import OptionError
from .protocols import MAX_DRAFT_DEPTH

if TYPE_CHECKING:
    from .checkpoint import Checkpoint
    from .shard import ShardPlan
    from .protocols import Drafter, Model

DRAFTER_ROLE_KEY = "tensorfold_role"  # config.json key; "drafter": served only as a drafter (the zoo writes it)


@dataclass(frozen=True)
class LoadOptions:
    """How a family should materialise a checkpoint."""

    dtype: str = "auto"  # auto keeps the checkpoint's float dtype; else bfloat16, float16 or float32
    shard: tuple[int, int] | None = None  # (rank, size) in a group: keep that rank's part (the family's shard_plan)
    # MLX's own op for every row-path op, whatever the family's table says: a drafter's forward, whose drafts the
    # target verifies, needs no row invariance, and MLX's ops build and run faster than the records on CUDA
    builtin_kernels: bool = False


@dataclass(frozen=True)
class Family:
    """A model architecture: which config.json model_types it reads and how it loads them."""

    name: str
    model_types: tuple[str, ...]
    load: Callable[["Checkpoint", LoadOptions], "Model"]
    description: str = ""
    # which configs of this family draft only (refused when served alone), beyond the config's own marker
    drafter_only: Callable[[dict], bool] = lambda config: False
    # which implementation backs each row-path op on each backend (tensorfold_core.kernels): op -> backend -> impl
    kernels: dict = field(default_factory=dict)
    # what a group splits over its ranks (tensorfold_core.shard.ShardPlan) for a loaded model; None: served whole only
    shard_plan: Callable[["Model"], "ShardPlan"] | None = None


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
class DrafterOptions:
    """How core starts a drafter: width asked for, weights dtype, deepest chain, kept slots, eos ids, plugin flags."""

    bits: int | None = None  # --drafter-bits; None: serve what the checkpoint holds
    dtype: str = "auto"
    max_depth: int = MAX_DRAFT_DEPTH
    max_kept: int = 4  # slots kept for later requests: the serve default of --parallel
    eos_ids: frozenset[int] | None = None  # None until admitted: then the target tokenizer's
    plugin_options: dict = field(default_factory=dict)  # values of the plugins' own serve flags, by name

    def __post_init__(self):
        if not 1 <= self.max_depth <= MAX_DRAFT_DEPTH:
            raise OptionError(f"drafter max_depth {self.max_depth}: expected 1..{MAX_DRAFT_DEPTH}")
        if self.max_kept < 0:
            raise OptionError(f"drafter max_kept {self.max_kept}: expected 0 or more")
        if self.eos_ids is not None:
            object.__setattr__(self, "eos_ids", frozenset(int(t) for t in self.eos_ids))

    def replace(self, **changes) -> "DrafterOptions":
        return dataclasses.replace(self, **changes)

    @classmethod
    def serving(cls, options) -> "DrafterOptions":
        """The drafter's options under a server's `ServeOptions`."""
        return cls(bits=options.drafter_bits, dtype=options.dtype, max_kept=options.parallel,
                   plugin_options=dict(options.plugin_options))


class AdmitDrafter(Protocol):
    def __call__(self, target: "Model", drafter_ckpt: "Checkpoint", bits: int | None) -> None:
        """Refuse (DrafterError) a drafter this kind cannot run for the target: wrong family, refused bits."""


class StartDrafter(Protocol):
    def __call__(self, target: "Model", drafter_ckpt: "Checkpoint", options: DrafterOptions) -> "Drafter":
        """Load, warm up and return the drafter; a drafter that cannot run raises DrafterError, freed."""


@dataclass(frozen=True)
class DrafterKind:
    """A kind of drafter: which checkpoints it drives and how it starts in front of a target (core has already
    checked that the drafter's tokenizer is the target's)."""

    name: str
    matches: Callable[["Checkpoint"], bool]
    admit: AdmitDrafter
    start: StartDrafter
    description: str = ""
    # which implementation backs each of the drafter's own ops on each backend, as a family's `kernels` (empty: the
    # drafter runs a family's model, whose table says it, or MLX's ops alone)
    kernels: dict = field(default_factory=dict)

    @classmethod
    def of_module(cls, name: str, module: str, description: str = "", kernels: dict | None = None) -> "DrafterKind":
        """A kind whose `matches`, `admit` and `start` live in `module`, imported (and mlx with it) only when a
        drafter is asked for."""

        def lazy(function: str):
            def call(*args, **kwargs):
                return getattr(importlib.import_module(module), function)(*args, **kwargs)

            return call

        return cls(name=name, matches=lazy("matches"), admit=lazy("admit"), start=lazy("start"),
                   description=description, kernels=kernels or {})


@dataclass(frozen=True)
class ServeOption:
    """A plugin's serve flag (`--NAME`): listed by `serve --help` and `capabilities --json`, its value handed to
    the plugin's drafter in `DrafterOptions.plugin_options[name]`."""

    name: str  # dashes, as typed: "dspark-threshold"
    help: str
    default: int | float | str | None = None
    choices: tuple = field(default_factory=tuple)
    type: type = str  # int, float or str: how the flag's text is read
