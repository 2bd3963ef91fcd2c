"""The base of every request body: JSON's own types only, finite floats, no unknown field, only encodable text."""

from __future__ import annotations

import json
import re
from contextvars import ContextVar
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..errors import RequestError

# a lone surrogate reaches Python only as a JSON escape (\ud800) or as its raw UTF-8 bytes, which json.loads lets pass;
# two patterns, each led by a literal that re finds at memchr speed (one alternation tried every byte: ~8x slower)
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
SURROGATE_RAW = re.compile(rb"\xed[\xa0-\xbf]")
# False once the raw body was seen to hold neither (server/bodies.py): the walk below is then skipped
MAY_HOLD_SURROGATES: ContextVar[bool | None] = ContextVar("tensorfold_may_hold_surrogates", default=None)

T = TypeVar("T")
# a list or map stops at its first bad entry: 200,000 bad ids would be 200,000 errors, seconds of CPU to build and
# read, and a union tries each of its list forms in turn
Many = Annotated[list[T], Field(fail_fast=True)]
Keyed = Annotated[dict[str, T], Field(fail_fast=True)]


def may_hold_surrogates(body: bytes) -> bool:
    """Whether a raw JSON body holds a surrogate, escaped or as UTF-8 bytes (then the strings are walked)."""
    return bool(SURROGATE_ESCAPE.search(body) or SURROGATE_RAW.search(body))


class RequestBody(BaseModel):
    """A request body, or a part of one; every request model derives from it, so every field is strict.

    - strict: no coercion ("10", true or 1.0 for an int; "yes" for a bool; true for a token id);
    - finite: NaN and infinities (JSON's `Infinity`, `1e400`) are refused wherever a float is read;
    - closed: a field the server does not know is refused, never ignored (a part may open itself again);
    - encodable: a string holding a lone UTF-16 surrogate is refused, naming where it sits, before any
      tokenizer, template or JSON encoder meets it.
    """

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _encodable(cls, data: Any) -> Any:
        if MAY_HOLD_SURROGATES.get() is False:
            return data
        try:  # the common case at C speed (a 200k-id prompt would take a Python walk tens of ms of the event loop)
            json.dumps(data, ensure_ascii=False).encode("utf-8")
            return data
        except (UnicodeEncodeError, TypeError, ValueError):
            pass
        where = unencodable(data)
        if where is not None:
            path, index = where
            raise RequestError(f"{path or 'the body'}: holds a lone UTF-16 surrogate at character {index}, "
                               "which is not Unicode text", param=path or None, code="invalid_string")
        return data


def unencodable(value: Any, path: str = "") -> tuple[str, int] | None:
    """Where the first string (value or key) that UTF-8 cannot encode sits: its path and the character index."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return path, exc.start
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            inner = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and not key.isascii():
                found = unencodable(key, path)
                if found is not None:
                    return found
            found = unencodable(item, inner)
            if found is not None:
                return found
        return None
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = unencodable(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None
