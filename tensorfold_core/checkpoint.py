"""A checkpoint dir (config.json, safetensors shards, quantization block, tokenizer) and how a model name finds one."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx

from .errors import CheckpointError
from .specs import LoadOptions

if TYPE_CHECKING:
    from .plugins import Registry
    from .protocols import Model
    from .tokenizer import Tokenizer

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc


def _check_safetensors(path: Path) -> None:
    """Catch truncated or garbled files up front: mx.load reads lazily and would fail late, or not at all."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise ValueError(f"header of {header_len} bytes in a file of {size}")
            header = json.loads(f.read(header_len))
    except (OSError, struct.error, ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from exc
    data = size - 8 - header_len
    for name, info in header.items():
        if name == "__metadata__":
            continue
        end = info.get("data_offsets", [0, 0])[1] if isinstance(info, dict) else None
        if end is None or end > data:
            raise CheckpointError(f"{path}: tensor {name!r} runs past the end of the file (truncated?)")


class Checkpoint:
    """A checkpoint dir read on demand: its config, its tensors (single file or sharded) and its tokenizer."""

    def __init__(self, path: Path, config: dict):
        self.path = path
        self.config = config
        self._sources: dict[str, str] = {}

    @classmethod
    def open(cls, path: Path | str) -> "Checkpoint":
        path = Path(path).expanduser()
        if not path.is_dir():
            raise CheckpointError(f"{path}: not a checkpoint directory")
        config = _read_json(path / "config.json")
        if not isinstance(config, dict):
            raise CheckpointError(f"{path / 'config.json'}: expected a JSON object, got {type(config).__name__}")
        return cls(path, config)

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, model_type={self.config.get('model_type')!r})"

    @property
    def model_type(self) -> str:
        model_type = self.config.get("model_type")
        if not isinstance(model_type, str):
            raise CheckpointError(f"{self.path / 'config.json'}: no model_type")
        return model_type

    @property
    def quantization(self) -> dict | None:
        quant = self.config.get("quantization") or self.config.get("quantization_config")
        return quant if isinstance(quant, dict) else None

    @property
    def weights_file(self) -> Path:
        """The file that lists the weights: the shard index, else the single safetensors file."""
        return self.path / INDEX if (self.path / INDEX).exists() else self.path / SINGLE

    def source(self, name: str) -> Path:
        """The file a tensor was read from (the weights file for a tensor that was never read)."""
        return self.path / self._sources[name] if name in self._sources else self.weights_file

    def tensors(self) -> dict[str, mx.array]:
        """Every tensor of the checkpoint, by name (lazy mx arrays)."""
        index_file = self.path / INDEX
        if index_file.exists():
            index = _read_json(index_file)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index_file}: no weight_map")
            files = sorted(set(weight_map.values()))
        elif (self.path / SINGLE).exists():
            weight_map, files = None, [SINGLE]
        else:
            raise CheckpointError(f"{self.path}: no {SINGLE} and no {INDEX}")
        tensors: dict[str, mx.array] = {}
        self._sources = {}
        for file in files:
            shard = self.path / file
            if not shard.exists():
                named = next(n for n, f in weight_map.items() if f == file)
                raise CheckpointError(f"{shard}: missing shard (named by {INDEX}, e.g. for {named!r})")
            _check_safetensors(shard)
            try:
                loaded = mx.load(str(shard))
            except Exception as exc:  # mx.load raises RuntimeError/ValueError with no file name
                raise CheckpointError(f"{shard}: not a readable safetensors file ({exc})") from exc
            tensors.update(loaded)
            self._sources.update(dict.fromkeys(loaded, file))
        for name, file in (weight_map or {}).items():
            if self._sources.get(name) != file:
                raise CheckpointError(f"{self.path / file}: tensor {name!r} named in {INDEX} is not in the file")
        return tensors

    def tokenizer(self) -> "Tokenizer":
        from .tokenizer import Tokenizer

        return Tokenizer.from_dir(self.path)


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


def resolve_model(name: str, registry: "Registry | None" = None) -> Path:
    """A model name to a checkpoint dir: an existing local dir, a plugin's shipped model, else a hub id."""
    local = Path(name).expanduser()
    if local.is_dir():
        return local
    if registry is None:
        from .plugins import registry as default_registry

        registry = default_registry()
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


def load_model(name_or_path: str | Path, options: LoadOptions = LoadOptions(), *,
               registry: "Registry | None" = None) -> tuple["Model", "Tokenizer", Checkpoint]:
    """Resolve, open, find the family by model_type, and load: (model, tokenizer, checkpoint)."""
    if registry is None:
        from .plugins import registry as default_registry

        registry = default_registry()
    ckpt = Checkpoint.open(resolve_model(str(name_or_path), registry))
    family = registry.family_for(ckpt.model_type)
    model = family.load(ckpt, options)
    return model, ckpt.tokenizer(), ckpt
