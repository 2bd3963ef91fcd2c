"""A reply's text and token ids as tokens arrive: incremental detokenizing, eos, stop strings, hold-back."""

from __future__ import annotations

from typing import NamedTuple

from ..tokenizer import Tokenizer


class Piece(NamedTuple):
    """What a reply may hand the client now: text safe to show and the token ids that arrived with it."""

    text: str
    token_ids: list[int]


def partial_tail(text: str, marker: str, within: int | None = None) -> int:
    """Length of the longest tail of `text` (at most `within` characters) that begins `marker` without being all of
    it: text a streamed reply holds back until the next piece says whether the marker follows."""
    longest = min(len(marker) - 1, len(text) if within is None else within)
    for k in range(longest, 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class Reply:
    """Builds one reply's text from token ids.

    - An eos token ends the reply and is in neither the text nor the token ids.
    - A stop string ends the reply; the text is cut right before it (matched across token boundaries). The
      token ids keep every token up to the one that completed the stop string (what was generated).
    - Text that might be the start of a stop string is held back until it is known not to be one.
    """

    def __init__(self, tokenizer: Tokenizer, stops: list[str] = (), eos_ids=()):
        self.detok = tokenizer.detokenizer()
        self.stops = list(stops)
        self.eos_ids = frozenset(eos_ids)
        self.longest_stop = max((len(s) for s in self.stops), default=0)
        self.text = ""
        self.token_ids: list[int] = []
        self.sent = 0  # characters of self.text handed out
        self.searched = 0  # self.text[:searched] holds no complete stop string
        self.saw_eos = False
        self.stopped = False  # a stop string was found

    @property
    def ended(self) -> bool:
        return self.saw_eos or self.stopped

    def feed(self, token_ids) -> Piece:
        """Take one round's tokens; tokens after the end (eos or stop string) are dropped."""
        taken = []
        for token in token_ids:
            if self.ended:
                break
            if token in self.eos_ids:
                self.saw_eos = True
                break
            taken.append(token)
            self.token_ids.append(token)
            self.text += self.detok.add(token)
            self._find_stop()
        return self._take(taken)

    def finish(self) -> Piece:
        """The stream is done: release incomplete UTF-8 and whatever was held back."""
        if not self.ended:
            self.text += self.detok.flush()
            self._find_stop()
        return self._take([], final=True)

    def _find_stop(self) -> None:
        if not self.stops or len(self.text) <= self.searched:
            return
        start = max(0, self.searched - self.longest_stop + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True
        self.searched = len(self.text)

    def _held_back(self) -> int:
        """Length of the longest tail of the unsent text that is the start of some stop string."""
        return max((partial_tail(self.text, stop, len(self.text) - self.sent) for stop in self.stops), default=0)

    def _take(self, token_ids: list[int], final: bool = False) -> Piece:
        end = len(self.text) if (final or self.ended) else len(self.text) - self._held_back()
        text = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return Piece(text, token_ids)
