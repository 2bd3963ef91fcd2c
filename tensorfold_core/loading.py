"""The one place that resolves names, dirs and hub ids, and loads targets, drafters and the serving host."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from .checkpoint import Checkpoint
from .errors import CheckpointError, DrafterError, PluginError
from .kernels import backend
from .options import DEFAULT_CONTEXT_CAP, ServeOptions
from .plugins import Registry, registry as default_registry
from .protocols import Drafter, Model
from .specs import DRAFTER_ROLE_KEY, DrafterOptions, LoadOptions
from .tokenizer import Tokenizer, tokenizer_difference

if TYPE_CHECKING:
    from .group import Joined

log = logging.getLogger("tensorfold")
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
Progress = Callable[[str], None]
DRAFTER_MEMBERS = ("name", "facts", "propose", "release", "catch_up", "slot_bytes_for", "kept_bytes", "shed_kept",
                   "close")
CONTEXT_MEMBERS = ("keep_context", "resume_context", "return_context")  # a ContextKeepingDrafter's


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError

    offline = _offline()
    elsewhere = f"or download it where the hub is reachable (`hf download {repo_id}`) and pass the local dir"
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS, local_files_only=offline))
    except GatedRepoError as exc:
        raise CheckpointError(f"model {repo_id!r}: the hub repo is gated; accept its terms and log in "
                              "(`hf auth login`) or set HF_TOKEN") from exc
    except RepositoryNotFoundError as exc:
        raise CheckpointError(f"model {repo_id!r}: not a local dir, not a shipped model, and no such repo on the "
                              "hub (or it is private: set HF_TOKEN)") from exc
    except HFValidationError as exc:
        raise CheckpointError(f"model {repo_id!r}: not a local dir, not a shipped model, and not a valid hub id "
                              f"({exc})") from exc
    except Exception as exc:  # offline mode, no cache entry, DNS or connection failure
        if offline:
            why, fix = "HF_HUB_OFFLINE=1 is set", f"unset HF_HUB_OFFLINE to download it, {elsewhere}"
        else:
            cause = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            why = f"the Hugging Face hub is unreachable ({cause})"
            fix = f"check the network or HF_ENDPOINT, {elsewhere}"
        raise CheckpointError(f"model {repo_id!r} is not local (no such dir, no shipped model, not in the hub "
                              f"cache) and {why}: {fix}") from exc


def resolve_model(name: str, registry: Registry | None = None) -> Path:
    """A model name to a checkpoint dir: an existing local dir, a plugin's shipped model, else a hub id."""
    local = Path(name).expanduser()
    if local.is_dir():
        return local
    registry = registry or default_registry()
    shipped = registry.shipped(name)
    if shipped is not None:
        if not Path(shipped.path).is_dir():
            raise CheckpointError(f"shipped model {name!r}: {shipped.path} is missing (reinstall its plugin)")
        return Path(shipped.path)
    if local.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        shipped_names = ", ".join(m.name for m in registry.models()) or "none installed"
        raise CheckpointError(f"model {name!r}: no such checkpoint dir, not a shipped model ({shipped_names}), "
                              "and not a hub id of the form org/name")
    return _from_hub(name)


def open_checkpoint(name: str | Path, registry: Registry | None = None) -> Checkpoint:
    """The checkpoint a model name resolves to."""
    return Checkpoint.open(resolve_model(str(name), registry))


def drafter_only(ckpt: Checkpoint, registry: Registry | None = None) -> bool:
    """Whether the checkpoint says it drafts only: the zoo's marker, its family's rule, or a drafter-only layout."""
    registry = registry or default_registry()
    if ckpt.config.get(DRAFTER_ROLE_KEY) == "drafter":
        return True
    try:
        family = registry.family_for(ckpt.model_type)
    except PluginError:  # no family serves it, but a drafter kind reads it: a drafter-only layout
        return any(kind.matches(ckpt) for kind in registry.drafters())
    return family.drafter_only(ckpt.config)


def load_model(name_or_path: str | Path, options: LoadOptions = LoadOptions(), *,
               registry: Registry | None = None) -> tuple[Model, Tokenizer, Checkpoint]:
    """Resolve, open, find the family by model_type, and load: (model, tokenizer, checkpoint)."""
    registry = registry or default_registry()
    ckpt = open_checkpoint(name_or_path, registry)
    model = registry.family_for(ckpt.model_type).load(ckpt, options)
    return model, ckpt.tokenizer(), ckpt


@dataclass
class Target:
    """A loaded target: the name it was asked by, its model, tokenizer, checkpoint and row-invariance verdict."""

    name: str
    model: Model
    tokenizer: Tokenizer
    checkpoint: Checkpoint
    probe: dict

    @property
    def row_invariant(self) -> bool:
        return bool(self.probe.get("row_invariant", False))

    def context(self, requested: int | None = None) -> int:
        """Most tokens a stream may hold: the flag's, else the model's positions up to the default cap."""
        positions = int(self.checkpoint.config.get("max_position_embeddings") or DEFAULT_CONTEXT_CAP)
        return requested or min(positions, DEFAULT_CONTEXT_CAP)


def load_shard(model: str | None, options: ServeOptions, joined: "Joined | None",
               progress: Progress = lambda stage: None, *,
               registry: Registry | None = None) -> tuple[str, Model, Checkpoint]:
    """Resolve, refuse drafter-only checkpoints by name, load, and keep this rank's shard where a group serves it."""
    registry = registry or default_registry()
    progress("resolving")
    name = model or registry.default_model().name
    ckpt = open_checkpoint(name, registry)
    if drafter_only(ckpt, registry):
        raise DrafterError(f"{name} is admitted only as a drafter; serve a target with --drafter {name}")
    progress("loading weights")
    family = registry.family_for(ckpt.model_type)
    size = joined.group.size() if joined is not None else 1
    if size > 1 and family.shard_plan is None:
        raise CheckpointError(f"{name}: the {family.name} family declares no shard plan, so a group of {size} "
                              "cannot serve it")
    loaded = family.load(ckpt, LoadOptions(dtype=options.dtype, shard=(joined.rank, size) if size > 1 else None))
    if size > 1:
        from .shard import reduce

        if getattr(loaded, "shards", None) != size:
            raise CheckpointError(f"{name}: the {family.name} family's load kept no shard of {size} "
                                  "(LoadOptions.shard)")
        progress(f"keeping shard {joined.rank} of {size}")
        loaded = reduce(loaded, family.shard_plan(loaded), joined.group)
    return name, loaded, ckpt


def load_target(model: str | None, options: ServeOptions, progress: Progress = lambda stage: None, *,
                registry: Registry | None = None, joined: "Joined | None" = None) -> Target:
    """Resolve, refuse drafter-only checkpoints by name, load (rank 0's shard in a group), probe row invariance."""
    from .probe import row_invariance

    name, loaded, ckpt = load_shard(model, options, joined, progress, registry=registry)
    if joined is not None:
        from .group import GroupModel

        loaded = GroupModel(loaded, joined.group, joined.backend)
    progress("probing row invariance")  # in a group every rank runs the probe's forwards
    return Target(name, loaded, ckpt.tokenizer(), ckpt, row_invariance(loaded))


def follow_group(model: str | None, options: ServeOptions, joined: "Joined", *,
                 registry: Registry | None = None) -> int:
    """A rank past 0: load the same target, keep this rank's shard, and run rank 0's forwards until it stops."""
    from .group import follow

    _, loaded, _ = load_shard(model, options, joined, registry=registry)
    return follow(loaded, joined.group)


def drafter_name(model_name: str, requested: str | None, registry: Registry | None = None) -> str | None:
    """The drafter to start: the flag's, else the shipped model's own; 'none' turns drafting by a model off."""
    if requested is not None:
        return None if requested.lower() == "none" else requested
    shipped = (registry or default_registry()).shipped(model_name)
    return shipped.drafter if shipped is not None else None


def check_same_tokenizer(target: Tokenizer, drafter_ckpt: Checkpoint) -> None:
    """Every drafter kind shares the target's tokenizer exactly; the error names the first difference."""
    name = drafter_ckpt.path.name
    try:
        drafter_tokenizer = drafter_ckpt.tokenizer()
    except CheckpointError as exc:
        raise DrafterError(f"drafter {name}: its tokenizer cannot be compared with the target's ({exc})") from exc
    why = tokenizer_difference(target.fingerprint(), drafter_tokenizer.fingerprint())
    if why:
        raise DrafterError(f"drafter {name} does not share the target's tokenizer: {why}")


def start_drafter(name: str, target: Model, tokenizer: Tokenizer, options: DrafterOptions = DrafterOptions(), *,
                  registry: Registry | None = None) -> Drafter:
    """A started drafter admitted for this target, or a DrafterError saying why not."""
    registry = registry or default_registry()
    ckpt = open_checkpoint(name, registry)
    kinds = [kind for kind in registry.drafters() if kind.matches(ckpt)]
    if not kinds:
        known = ", ".join(k.name for k in registry.drafters()) or "none installed"
        raise DrafterError(f"--drafter {name}: no installed drafter kind reads model_type "
                           f"{ckpt.config.get('model_type')!r} (drafter kinds: {known})")
    kind = kinds[0]
    check_same_tokenizer(tokenizer, ckpt)
    kind.admit(target, ckpt, options.bits)
    if options.eos_ids is None:
        options = options.replace(eos_ids=frozenset(tokenizer.eos_ids))
    drafter = kind.start(target, ckpt, options)
    missing = [name for name in DRAFTER_MEMBERS if not hasattr(drafter, name)]
    if missing:
        raise DrafterError(f"drafter kind {kind.name}: start() gave a {type(drafter).__name__} without "
                           f"{', '.join(missing)} (the Drafter protocol in tensorfold_core.protocols)")
    if drafter.facts.chances and not hasattr(drafter, "chances"):
        raise DrafterError(f"drafter kind {kind.name}: its facts say it gives chances, but its "
                           f"{type(drafter).__name__} has no chances() (ChanceDrafter in tensorfold_core.protocols)")
    if drafter.facts.hold_costs and not hasattr(drafter, "hold_ms"):
        raise DrafterError(f"drafter kind {kind.name}: its facts say its hold is priced, but its "
                           f"{type(drafter).__name__} has no hold_ms() (HoldPricedDrafter in "
                           "tensorfold_core.protocols)")
    lacking = [name for name in CONTEXT_MEMBERS if not hasattr(drafter, name)]
    if drafter.facts.kept_context and lacking:
        raise DrafterError(f"drafter kind {kind.name}: its facts say its context is kept with prompt states, but its "
                           f"{type(drafter).__name__} has no {', '.join(lacking)} (ContextKeepingDrafter in "
                           "tensorfold_core.protocols)")
    return drafter


def _blas_hint() -> str:
    """Where a preloaded OpenBLAS broke row invariance, the kernels known to keep it (docs/performance.md)."""
    preloaded = "openblas" in os.environ.get("LD_PRELOAD", "").lower()
    return "; with OpenBLAS preloaded, OPENBLAS_CORETYPE=Nehalem keeps rows invariant" if preloaded else ""


def load_host(model: str | None, options: ServeOptions, progress: Progress = lambda stage: None,
              timed: bool = True, joined: "Joined | None" = None):
    """Load the target and its drafter, and start the engine thread over them (untimed: depths never read the
    clock, so tests see the same drafts however busy the machine is); in a group, rank 0's host."""
    from .capabilities import capabilities
    from .host import Host
    from .lanes.warm_up import warms_up
    from .memory.ledger import GIB, default_budget

    if joined is not None and joined.local > 1 and not options.memory_gib:
        # ranks on one machine share its memory; rank 0 holds what any rank holds (and its drafter), so its
        # ledger at the machine's share keeps every rank within its own
        options = options.model_copy(update={"memory_gib": default_budget() / joined.local / GIB})
    target = load_target(model, options, progress, joined=joined)
    drafter, draft_name = None, drafter_name(target.name, options.drafter)
    if not target.row_invariant:
        log.warning("backend is not row-invariant (%s): each stream runs its own forward, undrafted%s",
                    target.probe.get("detail"), _blas_hint())
    elif draft_name is not None:
        progress(f"starting drafter {draft_name}")
        drafter = start_drafter(draft_name, target.model, target.tokenizer, DrafterOptions.serving(options))
    model_id = options.model_name or target.name
    if joined is None and warms_up():  # the host warms up before it returns (a group does not)
        progress("warming up")
    info = {"model": model_id, "row_invariance": target.probe, "checkpoint": str(target.checkpoint.path),
            "model_type": target.checkpoint.model_type, "drafter": draft_name if drafter is not None else None,
            "kernels": {"backend": backend(), "serving": target.model.kernels,
                        **({"drafter": drafter.kernels} if getattr(drafter, "kernels", None) else {})}}
    return Host(target.model, target.tokenizer, options, model_id=model_id, context=target.context(options.context),
                capabilities=capabilities(options, extra=info), drafter=drafter, timed=timed,
                group=target.model if joined is not None else None)
