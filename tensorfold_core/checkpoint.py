"""A checkpoint dir read on demand: config.json, safetensors shards, quantization block, tokenizer (a leaf)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx

from .errors import CheckpointError
from .files import read_json

if TYPE_CHECKING:
    from .tokenizer import Tokenizer

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


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
        config = read_json(path / "config.json")
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
            index = read_json(index_file)
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

