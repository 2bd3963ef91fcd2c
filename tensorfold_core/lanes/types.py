"""What goes into the lane core (a generation request) and what comes out (events)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

from ..protocols import MAX_DRAFT_DEPTH
from ..sampling import SamplingParams
from .constraints import Grammar
from .rows import Penalties, TokenLogprob


@dataclass
class GenerationRequest:
    """One stream to decode: prompt ids, how many tokens, how to draw them, when to stop."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: frozenset[int] = frozenset()
    draft: bool = True  # False: the serial reference, one token per round, no drafts
    penalties: Penalties = Penalties()
    logprobs: int | None = None  # None: none; k: each drawn token's logprob and its row's k most likely ids
    grammar: Grammar | None = None  # every drawn token must keep the reply inside this grammar
    prefill_group: Hashable | None = None  # streams of one group (n > 1) read their shared prompt once


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
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them


@dataclass
class DoneEvent:
    """The stream ended; finish_reason is "stop", "length" or "cancelled"."""

    finish_reason: str
    usage: dict


@dataclass
class ErrorEvent:
    """The stream failed; `error` is a TensorfoldError where the cause is known."""

    error: Exception


@dataclass
class SpecCounters:
    """What the engine's windows drafted and kept, over all streams (vLLM's spec-decode counters)."""

    drafts: int = 0  # windows that carried at least one draft
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=lambda: [0] * MAX_DRAFT_DEPTH)
    offered_per_position: list[int] = field(default_factory=lambda: [0] * MAX_DRAFT_DEPTH)
    verdicts: dict[str, int] = field(default_factory=lambda: {"drafted": 0, "plain": 0})  # windows that could draft
    cut_by_grammar: int = 0  # drafts cut before the verify because the grammar refused them
    # by the proposer that gave a window's drafts (copy, recall, grammar, the drafter's name): windows, drafts, kept
    by_source: dict[str, list[int]] = field(default_factory=dict)

    def window(self, drafted: int, accepted: int, source: str) -> None:
        if drafted:
            self.drafts += 1
            self.draft_tokens += drafted
            self.accepted_tokens += accepted
            counts = self.by_source.setdefault(source, [0, 0, 0])
            counts[0], counts[1], counts[2] = counts[0] + 1, counts[1] + drafted, counts[2] + accepted
            for position in range(accepted):
                self.accepted_per_position[position] += 1
            for position in range(drafted):
                self.offered_per_position[position] += 1

    def snapshot(self) -> dict:
        return {"num_drafts": self.drafts, "num_draft_tokens": self.draft_tokens,
                "num_accepted_tokens": self.accepted_tokens, "accepted_per_position": list(self.accepted_per_position),
                "offered_per_position": list(self.offered_per_position),
                "verdicts": dict(self.verdicts), "cut_by_grammar": self.cut_by_grammar,
                "by_source": {source: dict(zip(("windows", "draft_tokens", "accepted_tokens"), counts))
                              for source, counts in list(self.by_source.items())}}  # read from other threads
