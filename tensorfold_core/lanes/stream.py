"""A stream: one request being decoded, its tokens, cache, sampling key, stop rules and round stats."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from ..protocols import Cache
from ..sampling import seed_from_prompt
from .rows import RowStage, TokenLogprob
from .types import DoneEvent, GenerationRequest, TokenEvent, usage

log = logging.getLogger("tensorfold")


@dataclass
class RoundStats:
    """What a stream's rounds did: how many, how many drafts offered and kept."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0

    def as_dict(self) -> dict:
        return {"rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted}


@dataclass
class Stream:
    """One request in the lane core: `tokens` is prompt + reply; the cache holds `cache.offset` of them."""

    id: int
    request: GenerationRequest
    cache: Cache
    on_event: Callable
    limit: int  # most tokens the stream may hold (prompt + reply), within the context
    tokens: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens resumed from a kept state rather than computed
    stats: RoundStats = field(default_factory=RoundStats)
    cancelled: bool = False
    finish_reason: str | None = None
    stage: RowStage | None = None  # the engine's per-row logits stage for this stream, made when it joins
    admitted: float = field(default_factory=time.monotonic)  # for the dashboard's tokens/s only, never a decision

    def __post_init__(self):
        self.tokens = list(self.request.prompt_ids)
        self.prompt_len = len(self.tokens)
        params = self.request.sampling
        self.seed = params.seed if params.seed is not None else seed_from_prompt(self.request.prompt_ids)

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def prefilling(self) -> bool:
        """True while more than the pending token is still outside the cache."""
        return len(self.tokens) - self.cache.offset > 1

    def window(self, chunk: int) -> list[int]:
        """The rows this stream feeds next: a prompt chunk ending on a chunk mark, or its pending token."""
        start = self.cache.offset
        end = min(len(self.tokens), (start // chunk + 1) * chunk)
        return self.tokens[start:end]

    def commit(self, drawn: list[int]) -> list[int]:
        """Append drawn tokens up to a stop token or the limits; return those the client sees."""
        shown = []
        for token in drawn:
            self.tokens.append(token)
            if token in self.request.stop_token_ids:
                self.finish_reason = "stop"
                break
            shown.append(token)
            if self.generated >= self.request.max_tokens or len(self.tokens) >= self.limit:
                self.finish_reason = "length"
                break
        return shown

    def usage(self) -> dict:
        return usage(self.prompt_len, self.generated, self.cached_tokens, self.stats.as_dict())

    def emit(self, event) -> None:
        try:
            self.on_event(event)
        except Exception:  # a failing listener must not stop the engine or other streams
            log.exception("stream %s: its listener failed on %s", self.id, type(event).__name__)

    def emit_tokens(self, token_ids: list[int], logprobs: list[TokenLogprob] | None = None) -> None:
        if token_ids:
            self.emit(TokenEvent(token_ids=token_ids,
                                 logprobs=logprobs[:len(token_ids)] if logprobs is not None else None))

    def finish(self, reason: str | None = None) -> None:
        self.finish_reason = reason or self.finish_reason or "stop"
        self.emit(DoneEvent(finish_reason=self.finish_reason, usage=self.usage()))
