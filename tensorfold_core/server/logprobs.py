"""Logprobs in OpenAI's two shapes: chat's `content` entries and completions' parallel lists."""

from __future__ import annotations

from typing import Callable

from ..lanes.rows import TokenLogprob

TokenBytes = Callable[[int], bytes]


def _text(raw: bytes) -> str:
    # a token may hold part of a UTF-8 character: its text shows the replacement, its bytes stay exact
    return raw.decode("utf-8", errors="replace")


def chat_logprobs(entries: list[TokenLogprob], token_bytes: TokenBytes) -> dict:
    """Chat's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}."""
    def item(token: int, logprob: float) -> dict:
        raw = token_bytes(token)
        return {"token": _text(raw), "logprob": logprob, "bytes": list(raw)}

    content = [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]
    return {"content": content, "refusal": None}


def completion_logprobs(entries: list[TokenLogprob], token_bytes: TokenBytes, offset: int = 0) -> dict:
    """Completions' `logprobs`: tokens, token_logprobs, top_logprobs (token text -> logprob) and text_offset."""
    tokens, offsets = [], []
    for entry in entries:
        offsets.append(offset)
        tokens.append(_text(token_bytes(entry.token)))
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{_text(token_bytes(t)): lp for t, lp in e.top} for e in entries],
            "text_offset": offsets}
