"""Grammar constraints through llguidance: the tokens a row may draw, and how far a window's drafts stay legal."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import llguidance
import numpy as np


@dataclass(frozen=True)
class Grammar:
    """A compiled llguidance grammar and the tokenizer it reads tokens with; each stream gets its own matcher."""

    text: str  # llguidance's grammar JSON (from a JSON schema, a regex, a Lark grammar)
    tokenizer: llguidance.LLTokenizer
    name: str = "grammar"  # what the request asked for, for messages and metrics

    def matcher(self, vocab_size: int) -> "Constraint":
        matcher = llguidance.LLMatcher(self.tokenizer, self.text, log_level=0)
        return Constraint(matcher, vocab_size, self.tokenizer.vocab_size, self.tokenizer.eos_tokens)


class Constraint:
    """One stream's grammar state, in step with its generated tokens (the pending token included)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, tokenizer_size: int, eos_ids: Sequence[int]):
        self.matcher = matcher
        self.vocab_size = vocab_size  # logits columns (a model may pad its vocabulary past the tokenizer's)
        self.tokenizer_size = tokenizer_size
        self.eos_ids = [t for t in eos_ids if t < vocab_size]
        if matcher.is_error():
            raise ValueError(matcher.get_error())

    def allowed(self) -> np.ndarray:
        """Which ids the next token may be (one bool per logits column); ids past the tokenizer never."""
        if self.matcher.is_error():  # a grammar that broke down lets the stream end rather than draw noise
            out = np.zeros(self.vocab_size, dtype=bool)
            out[self.eos_ids] = True
            return out
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        out = np.zeros(self.vocab_size, dtype=bool)
        n = min(self.vocab_size, self.tokenizer_size)
        out[:n] = bits[:n].astype(bool)
        return out

    def consume(self, token: int) -> None:
        """Advance past a committed token (a refused one leaves the matcher in its error state)."""
        self.matcher.consume_token(int(token))

    def rollback(self, tokens: int) -> None:
        if tokens:
            self.matcher.rollback(tokens)

    def forced(self, limit: int) -> list[int]:
        """Tokens the grammar forces next (a key's closing quote and colon, say), at most `limit`."""
        if limit <= 0 or self.matcher.is_error():
            return []
        return [t for t in self.matcher.compute_ff_tokens()[:limit] if t < self.vocab_size]

    def legal_prefix(self, drafts: Sequence[int]) -> int:
        """How many drafts, from the first, the grammar lets follow the tokens so far."""
        if not drafts or self.matcher.is_error():
            return 0
        return self.matcher.validate_tokens([int(t) for t in drafts])
