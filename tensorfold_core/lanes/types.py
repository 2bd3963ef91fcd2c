"""What goes into the lane core (a generation request) and what comes out (events)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..sampling import SamplingParams


@dataclass
class GenerationRequest:
    """One stream to decode: prompt ids, how many tokens, how to draw them, when to stop."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: frozenset[int] = frozenset()
    draft: bool = True  # False: the serial reference, one token per round, no drafts


def usage(prompt_tokens: int, completion_tokens: int = 0, cached_tokens: int = 0,
          rounds: dict | None = None) -> dict:
    """A stream's usage, one shape everywhere: OpenAI's counts, cached prompt tokens and its rounds' stats."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
        "tensorfold": rounds or {"rounds": 0, "drafted": 0, "accepted": 0},
    }


@dataclass
class TokenEvent:
    """Tokens committed to a stream in one round (one, or several when drafts land)."""

    token_ids: list[int]


@dataclass
class DoneEvent:
    """The stream ended; finish_reason is "stop", "length" or "cancelled"."""

    finish_reason: str
    usage: dict


@dataclass
class ErrorEvent:
    """The stream failed; `error` is a TensorfoldError where the cause is known."""

    error: Exception
