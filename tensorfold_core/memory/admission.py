"""Admission against the one ledger: price a stream, make room, resume a kept prefix, give bytes back."""

from __future__ import annotations

from ..errors import RequestError
from .ledger import GIB, Ledger
from .prompt_cache import PromptCache


class Admission:
    """Every cache the host makes or keeps is reserved here first; what does not fit waits."""

    def __init__(self, model, ledger: Ledger, prompt_cache: PromptCache | None, drafter=None,
                 resume: bool = True, marks: int = 0):
        self.model = model
        self.ledger = ledger
        self.prompt_cache = prompt_cache
        self.drafter = drafter
        self.resume = resume  # resuming changes a stream's windows, so it needs row invariance
        self.marks = marks  # chunk marks: where a state that cannot be trimmed keeps resume points
        self.waits = 0  # streams that had to wait for room (each once, however often it was retried)
        self._last_waiter: int | None = None

    def slot_bytes(self, limit: int) -> int:
        return self.drafter.slot_bytes_for(limit) if self.drafter is not None else 0

    def price(self, limit: int) -> int:
        """Bytes a stream of `limit` tokens holds: its cache and its drafter slot."""
        return self.model.cache_bytes(limit) + self.slot_bytes(limit)

    def check(self, prompt_tokens: int, limit: int) -> None:
        """Refuse at once a stream that could never fit, even alone in an empty budget; say what would fit."""
        need, budget = self.price(limit), self.ledger.budget
        if need <= budget:
            return
        fits = self._most_tokens_within(budget, limit)
        advice = (f"send max_tokens of at most {fits - prompt_tokens}" if fits > prompt_tokens else
                  "the prompt alone does not fit; shorten it")
        raise RequestError(
            f"this request may hold {limit} tokens (its prompt's {prompt_tokens} and the reply's), whose cache "
            f"needs {need:,} bytes ({need / GIB:.3f} GiB), more than the whole memory budget of {budget:,} bytes "
            f"({budget / GIB:.3f} GiB); {advice}", param="max_tokens", code="memory_budget_exceeded")

    def _most_tokens_within(self, budget: int, limit: int) -> int:
        """The largest stream length whose price fits `budget` (0 if none): prices grow with the length."""
        low, high = 0, limit
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self.price(mid) <= budget else (low, mid - 1)
        return low

    def _make_room(self, need: int) -> bool:
        """Kept states, then kept drafter slots, give way; True when `need` bytes are free."""
        if self.ledger.free() >= need:
            return True
        if self.prompt_cache is not None:
            self.prompt_cache.shed(need)
        if self.ledger.free() < need and self.drafter is not None:
            self.drafter.shed_kept(need - self.ledger.free())
            self._sync_kept_slots()
        return self.ledger.free() >= need

    def admit(self, stream_id: int, prompt: list[int], limit: int):
        """A cache for the stream (resumed from the longest kept prefix) and its cached tokens; None: wait."""
        cache_bytes, slot_bytes = self.model.cache_bytes(limit), self.slot_bytes(limit)
        if not self._make_room(cache_bytes + slot_bytes):
            if stream_id != self._last_waiter:  # the head of the queue is retried every loop: count it once
                self.waits += 1
                self._last_waiter = stream_id
            return None
        self.ledger.reserve(("stream", stream_id), "stream_cache", cache_bytes)
        if slot_bytes:
            self.ledger.reserve(("slot", stream_id), "drafter_slot", slot_bytes)
        kept, usable = (None, 0)
        if self.resume and self.prompt_cache is not None:
            kept, usable = self.prompt_cache.lookup(prompt)
        if kept is not None:
            cache = self.model.restore(kept.state, limit, usable, marks=self.marks)
            if kept.context is not None and self.drafter is not None:
                self.drafter.resume_context(stream_id, kept.context, prompt[:usable], limit)
        else:
            cache = self.model.new_cache(limit, marks=self.marks)
        if hasattr(cache, "mark"):  # a repeat of this prompt resumes at its last token, whatever the chunks
            cache.mark(len(prompt) - 1)
        return cache, usable

    def leave(self, stream, kept: bool) -> None:
        """Give a stream's bytes back; keep its state (and its drafter slot) for later requests."""
        self.ledger.release(("stream", stream.id))
        self.ledger.release(("slot", stream.id))
        self._sync_kept_slots()
        if kept and stream.cache.offset > 0:
            self.keep(stream)

    def keep(self, stream) -> None:
        """Keep the stream's state at its cache's offset, with its drafter context where the drafter keeps one, if
        the prompt cache has room."""
        if not (self.resume and self.prompt_cache is not None and self.prompt_cache.cap_bytes):
            return
        state = self.model.snapshot(stream.cache)
        tokens = stream.tokens[:stream.cache.offset]
        context = None
        if self.drafter is not None and self.drafter.facts.kept_context:
            context = self.drafter.keep_context(stream.id, tokens, stream.cache)
            self._sync_kept_slots()  # the context left the drafter's kept slots: its bytes move to the state's
        nbytes = self.model.state_bytes(state) + (context.nbytes if context is not None else 0)
        if not self.prompt_cache.keep(tokens, state, nbytes, context) and context is not None:
            self.drafter.return_context(context)
            self._sync_kept_slots()

    def _sync_kept_slots(self) -> None:
        """Kept drafter slots sit in the ledger as one entry, resized as slots are kept or shed."""
        if self.drafter is None:
            return
        kept = self.drafter.kept_bytes()
        if not self.ledger.reserve(("drafter", "kept"), "kept_drafter_slots", kept):
            self.drafter.shed_kept(None)
            self.ledger.release(("drafter", "kept"))

    def snapshot(self) -> dict:
        out = {**self.ledger.snapshot(), "waits": self.waits}
        if self.prompt_cache is not None:
            out["prompt_cache"] = self.prompt_cache.snapshot()
        return out
