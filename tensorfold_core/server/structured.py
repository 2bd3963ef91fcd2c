"""Structured outputs: response_format and vLLM's guided_* fields as one llguidance grammar, checked at the edge."""

from __future__ import annotations

import json
from typing import Any

import llguidance

from ..errors import RequestError
from ..lanes.constraints import Grammar
from ..tokenizer import Tokenizer
from .reasoning import after_reasoning

# one space after ':' and ',' as OpenAI's replies write JSON; free whitespace lets a small model run on in blanks
JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def json_grammar(schema: dict) -> str:
    """A JSON schema as an llguidance grammar, laid out as JSON_LAYOUT says."""
    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_LAYOUT)


def _schema_of(response_format: dict) -> tuple[str, dict] | None:
    """response_format's constraint: None for text, else (what it is, the JSON schema)."""
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise RequestError("response_format.json_schema must be an object with a `schema` object",
                               param="response_format.json_schema")
        # strict or not, the schema is enforced: a grammar either holds or it does not
        return "response_format", spec.get("schema") or {"type": "object"}
    raise RequestError(f"response_format type {kind!r} is not one of text, json_object, json_schema",
                       param="response_format.type")


def _compile(param: str, value: Any) -> str:
    """One guided field's value as an llguidance grammar (not yet checked against the tokenizer)."""
    try:
        if param == "guided_json":
            schema = json.loads(value) if isinstance(value, str) else value
            return json_grammar(schema)
        if param == "guided_regex":
            return llguidance.LLMatcher.grammar_from_regex(value)
        if param == "guided_choice":
            return llguidance.grammar_from("choice", json.dumps(value))
        if param == "guided_grammar":  # Lark as llguidance reads it, or GBNF (llama.cpp's), told apart by llguidance
            return llguidance.grammar_from("grammar", value)
    except (ValueError, TypeError) as exc:
        raise RequestError(f"{param}: {exc}", param=param) from exc
    raise AssertionError(param)


class Grammars:
    """Turns a request's constraint fields into a Grammar on the served tokenizer, or a 400 naming the field."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._guidance: llguidance.LLTokenizer | None = None

    @property
    def guidance(self) -> llguidance.LLTokenizer:
        """The tokenizer as llguidance reads it, built once (its eos ids end a grammar's reply)."""
        if self._guidance is None:
            self._guidance = llguidance.LLTokenizer(self.tokenizer.backend.to_str(),
                                                    eos_token=sorted(self.tokenizer.eos_ids))
        return self._guidance

    def token_bytes(self, token: int) -> bytes:
        """The bytes one token id spells (a piece of a UTF-8 character, where BPE split one)."""
        return self.guidance.decode_bytes([int(token)])

    def check(self, param: str, text: str, name: str) -> Grammar:
        """The grammar, once llguidance accepts it for this tokenizer."""
        error = llguidance.LLMatcher.validate_grammar(text, self.guidance)
        if error:
            raise RequestError(f"{param}: the grammar engine refused it: {error.strip()}", param=param,
                               code="invalid_grammar")
        return Grammar(text, self.guidance, name)

    def for_request(self, fields: dict[str, Any], tool_grammar: str | None = None,
                    reasoning: bool | None = None) -> Grammar | None:
        """The one grammar `fields` ask for (response_format, guided_json/regex/choice/grammar) or a chat's
        tool_choice does (`tool_grammar`, server/tools.py), or None. On a thinking turn (`reasoning`: whether the
        prompt opened the block) the reasoning is free and the grammar holds what follows it, except
        guided_grammar's, which holds the whole reply (write the reasoning into it)."""
        asked = [("tool_choice", lambda: tool_grammar)] if tool_grammar is not None else []
        if fields.get("response_format"):
            found = _schema_of(fields["response_format"])
            if found is not None:
                asked.append(("response_format", lambda schema=found[1]: json_grammar(schema)))
        for param in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            if fields.get(param) is not None:
                asked.append((param, lambda param=param: _compile(param, fields[param])))
        if len(asked) > 1:
            raise RequestError(f"one constraint at a time: {', '.join(p for p, _ in asked)} were sent together",
                               param=asked[1][0])
        if not asked:
            return None
        param, make = asked[0]
        try:
            text = make()
        except ValueError as exc:
            raise RequestError(f"{param}: {exc}", param=param) from exc
        if reasoning is not None and param != "guided_grammar":
            text = after_reasoning(text, reasoning)
        return self.check(param, text, param)
