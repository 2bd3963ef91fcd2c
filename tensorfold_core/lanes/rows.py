"""The per-row logits stage: what changes a row's distribution, from that row's own context alone, before its draw."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..sampling import SamplingParams, draw, draw_rows
from .constraints import Constraint, Grammar


@dataclass(frozen=True)
class Penalties:
    """presence/frequency penalise the reply's own tokens (as OpenAI and vLLM do), repetition the prompt's and
    the reply's (as transformers and vLLM do); `bias` adds to chosen ids' logits (OpenAI's logit_bias)."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    bias: tuple[tuple[int, float], ...] = ()

    @property
    def counting(self) -> bool:
        """Whether a penalty reads which tokens came before (all but the bias)."""
        return bool(self.presence or self.frequency or self.repetition != 1.0)

    @property
    def active(self) -> bool:
        return self.counting or bool(self.bias)


@dataclass(frozen=True)
class TokenLogprob:
    """A drawn token's log-probability under its row's processed logits, and the row's most likely ids."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def row_logprobs(logits: np.ndarray) -> np.ndarray:
    """log-softmax in float64 (at temperature 1, after the row's processing); masked ids stay -inf."""
    finite = np.isfinite(logits)
    out = np.full(logits.shape, -np.inf)
    if finite.any():
        kept = logits[finite].astype(np.float64)
        out[finite] = kept - np.logaddexp.reduce(kept)
    return out


def token_logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """The drawn token's entry; `top` most likely ids, best first, ties to the lower id, masked ids left out."""
    logprobs = row_logprobs(logits)
    best = ()
    if top > 0:
        order = np.argsort(-logprobs, kind="stable")[:top]
        best = tuple((int(i), float(logprobs[i])) for i in order if np.isfinite(logprobs[i]))
    return TokenLogprob(int(token), float(logprobs[token]), best)


class RowStage:
    """One stream's rows: bias, penalties and the grammar mask applied to each row from that row's own context
    (the stream's tokens plus the drafts before the row in its window), then the keyed draw. A row's draw is the
    same whether it is a plain round's only row or the k-th row of a drafted window: drafted == plain by
    construction."""

    def __init__(self, prompt: Sequence[int], vocab_size: int, penalties: Penalties = Penalties(),
                 logprobs: int | None = None, grammar: Grammar | None = None):
        self.vocab_size = vocab_size
        self.penalties = penalties
        self.logprobs = logprobs  # None: none; k: the drawn token's and the k most likely ids
        self.constraint: Constraint | None = grammar.matcher(vocab_size) if grammar is not None else None
        # only the penalties read them: a stage without keeps no vocabulary-sized arrays and commits no counts
        self.counting = penalties.counting
        self.counts = np.zeros(vocab_size if self.counting else 0, dtype=np.int64)  # the reply's tokens
        self.seen = np.zeros(vocab_size if self.counting else 0, dtype=bool)  # the prompt's and the reply's tokens
        if self.counting:
            self.seen[self._ids(prompt)] = True
        self._bias_ids = np.array([i for i, _ in penalties.bias if 0 <= i < vocab_size], dtype=np.int64)
        self._bias = np.array([b for i, b in penalties.bias if 0 <= i < vocab_size], dtype=np.float64)

    @property
    def plain(self) -> bool:
        """Nothing to apply and nothing to report: the window's rows are drawn at once."""
        return not self.penalties.active and self.constraint is None and self.logprobs is None

    def _ids(self, tokens: Sequence[int]) -> np.ndarray:
        ids = np.asarray(tokens, dtype=np.int64)
        return ids[(ids >= 0) & (ids < self.vocab_size)]

    def process(self, row: np.ndarray, before: Sequence[int] = ()) -> np.ndarray:
        """The row's logits in float64 after logit_bias, the penalties and the grammar mask, in that order;
        `before` are the window's drafts ahead of this row (the grammar has already consumed them)."""
        out = np.array(row, dtype=np.float64)
        if self._bias_ids.size:
            np.add.at(out, self._bias_ids, self._bias)
        p = self.penalties
        if self.counting:
            counts, seen = self.counts, self.seen
            if len(before):
                counts, seen, ids = counts.copy(), seen.copy(), self._ids(before)
                np.add.at(counts, ids, 1)
                seen[ids] = True
            if p.repetition != 1.0:
                hit = out[seen]
                with np.errstate(over="ignore"):  # a penalty near 0 sends a logit to inf, which the draw handles
                    out[seen] = np.where(hit > 0, hit / p.repetition, hit * p.repetition)
            if p.presence or p.frequency:
                out -= p.frequency * counts + p.presence * (counts > 0)
        if self.constraint is not None:
            out[~self.constraint.allowed()] = -np.inf
        return out

    def legal(self, drafts: list[int]) -> list[int]:
        """The drafts cut before the first one the grammar refuses: its row could never draw it."""
        if self.constraint is None or not drafts:
            return drafts
        return drafts[:self.constraint.legal_prefix(drafts)]

    def forced(self, limit: int) -> list[int]:
        """Drafts for free: what the grammar forces next (its rows nearly always draw them)."""
        return self.constraint.forced(limit) if self.constraint is not None else []

    def verify(self, rows: np.ndarray, drafts: Sequence[int], sampling: SamplingParams, seed: int,
               position: int) -> tuple[list[int], list[TokenLogprob] | None]:
        """The target's draws along a window, the first at absolute `position`, up to and including the first
        draw that differs from its draft; with the drawn tokens' logprobs when asked."""
        if self.plain:
            return draw_rows(rows, sampling, seed, position), None
        draws: list[int] = []
        logprobs: list[TokenLogprob] | None = [] if self.logprobs is not None else None
        consumed = 0
        try:
            for i, row in enumerate(rows):
                logits = self.process(row, drafts[:i])
                token = draw(logits, sampling, seed, position + i)
                draws.append(token)
                if logprobs is not None:
                    logprobs.append(token_logprob(logits, token, self.logprobs))
                if i >= len(drafts) or token != drafts[i]:
                    break
                if self.constraint is not None:  # the next row's mask follows this accepted draft
                    self.constraint.consume(token)
                    consumed += 1
        finally:
            if self.constraint is not None:  # verifying changes no state: commit() advances it
                self.constraint.rollback(consumed)
        return draws, logprobs

    def commit(self, tokens: Sequence[int]) -> None:
        """The stream committed `tokens`: they join its reply's counts and advance its grammar."""
        if self.counting:
            ids = self._ids(tokens)
            np.add.at(self.counts, ids, 1)
            self.seen[ids] = True
        if self.constraint is not None:
            for token in tokens:
                self.constraint.consume(token)
