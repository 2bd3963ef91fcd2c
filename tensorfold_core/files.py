"""A checkpoint's small files: JSON read with errors that name the file (a leaf)."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import CheckpointError


def read_json(path: Path) -> object:
    """A JSON file's value; a missing or unreadable file is a CheckpointError naming it."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc


def read_json_if_present(path: Path) -> dict:
    """An optional JSON file's object ({} when the file is absent)."""
    return read_json(path) if path.exists() else {}
