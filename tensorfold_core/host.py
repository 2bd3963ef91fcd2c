"""The engine thread: submit / cancel / events, and admission up to --parallel against the one ledger."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from .backend import release_thread
from .errors import GroupError, RequestError
from .lanes.engine import Engine
from .lanes.stream import Stream
from .lanes.types import DoneEvent, ErrorEvent, GenerationRequest, usage
from .lanes.warm_up import WarmUp, warm_up, warms_up
from .memory.admission import Admission
from .memory.ledger import GIB, Ledger, default_budget
from .memory.prompt_cache import PromptCache
from .options import ServeOptions
from .protocols import Drafter, Model
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from .group import GroupModel

log = logging.getLogger("tensorfold")


@dataclass(frozen=True)
class Ticket:
    """A submitted request's handle, for cancel()."""

    id: int


@dataclass(frozen=True)
class Submitted:
    """A request handed to the engine thread (and, until admitted, waiting in its queue)."""

    ticket: int
    request: GenerationRequest
    on_event: Callable


@dataclass(frozen=True)
class Cancelled:
    """A request the client gave up on: queued, it ends at once; decoding, at its next round."""

    ticket: int


class Host:
    """Owns the model and the one thread that runs MLX; the server talks to it through submit and cancel."""

    def __init__(self, model: Model, tokenizer: Tokenizer, options: ServeOptions, *, model_id: str,
                 context: int, row_invariant: bool = True, capabilities: dict | None = None,
                 drafter: Drafter | None = None, start: bool = True, timed: bool = True,
                 group: "GroupModel | None" = None):
        self.model = model
        self.tokenizer = tokenizer
        self.options = options
        self.model_id = model_id
        self.context = context
        # ids the model embeds and the tokenizer can write back: a prompt of ids must stay inside both
        self.vocab_size = min(model.vocab_size, tokenizer.backend.get_vocab_size(with_added_tokens=True))
        self.drafter = drafter
        self.group = group  # the tensor-parallel group the model runs on (None: this process alone)
        budget = int(options.memory_gib * GIB) if options.memory_gib else default_budget()
        self.ledger = Ledger(budget)
        prompt_cache = PromptCache(self.ledger, int(options.prompt_cache_gib * GIB))
        self.admission = Admission(model, self.ledger, prompt_cache, drafter, resume=row_invariant,
                                   marks=options.prefill_chunk)
        # Recall: copies from the kept prompt states' tokens (earlier requests' prompts and replies)
        self.engine = Engine(model, prefill_chunk=options.prefill_chunk, shared_rounds=row_invariant, drafter=drafter,
                             timed=timed, on_leave=self.admission.leave,
                             recall=lambda: [kept.tokens for kept in prompt_cache.entries.values()])
        if group is None:  # a group's caches live on every rank until its sync frees them: its rounds teach its lines
            self.engine.time_rows(options.parallel)
        self._warm = group is None and warms_up()  # a GPU builds its kernels at first use: at load, not in a reply
        self.warmed_up: WarmUp | None = None
        self._warmed = threading.Event()
        memory = {"budget_bytes": budget, "prompt_cache_cap_bytes": prompt_cache.cap_bytes,
                  "prompt_cache_resumes": row_invariant}
        # worked out at load: MLX and the plugin registry are touched only by the loading and engine threads
        self._capabilities = {**(capabilities or {}), "model": model_id, "context": context, "memory": memory}
        self._ids = itertools.count(1)
        self._inbox: queue.SimpleQueue[Submitted | Cancelled] = queue.SimpleQueue()
        self._waiting: deque[Submitted] = deque()
        self._wake = threading.Event()
        self._closed = False
        self._in_flight = 0  # submitted and not yet ended: decoding or waiting for a slot
        self._in_flight_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="tensorfold-engine", daemon=True)
        if start:
            self._thread.start()
            self._warmed.wait()  # the load ends once the engine thread has warmed up

    def validate(self, request: GenerationRequest, prompt_param: str = "prompt") -> None:
        """Refuse at once what can never be served, naming the field the prompt came in; the message carries the
        numbers. The one validation of a request's tokens and sizes: the server checks only their JSON."""
        n = len(request.prompt_ids)
        if n == 0:
            raise RequestError("the prompt is empty", param=prompt_param)
        if n >= self.context:
            raise RequestError(f"this model's context is {self.context} tokens; the prompt has {n} "
                               f"(at least one must be left for the reply)", param=prompt_param,
                               code="context_length_exceeded")
        bad = next(((i, t) for i, t in enumerate(request.prompt_ids) if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError(f"prompt token id {bad[1]} at index {bad[0]} is outside the vocabulary "
                               f"(0..{self.vocab_size - 1})", param=prompt_param, code="invalid_token_id")
        if request.max_tokens < 1:
            raise RequestError("max_tokens must be at least 1", param="max_tokens")
        self.admission.check(n, self.limit(request))

    def limit(self, request: GenerationRequest) -> int:
        """Most tokens the stream may hold: prompt + max_tokens, within the context."""
        return min(self.context, len(request.prompt_ids) + request.max_tokens)

    def submit(self, request: GenerationRequest, on_event: Callable, prompt_param: str = "prompt") -> Ticket:
        """Queue a request for the engine thread; one it can never serve raises RequestError here, and so does
        one that finds --max-queued requests already waiting (a 429)."""
        self.validate(request, prompt_param)
        if self.group is not None and self.group.failure:
            raise GroupError(self.group.failure)
        with self._in_flight_lock:
            if self._in_flight >= self.options.parallel + self.options.max_queued:
                raise RequestError(f"{self._in_flight - self.options.parallel} requests are already waiting for "
                                   f"one of {self.options.parallel} stream slots (--max-queued "
                                   f"{self.options.max_queued}); retry later", status=429,
                                   kind="rate_limit_error", code="queue_full")
            self._in_flight += 1
        ticket = Ticket(next(self._ids))
        self._inbox.put(Submitted(ticket.id, request, self._counted(on_event)))
        self._wake.set()
        return ticket

    def _counted(self, on_event: Callable) -> Callable:
        """`on_event`, and the request leaves the in-flight count with its last event."""
        def counted(event) -> None:
            if isinstance(event, (DoneEvent, ErrorEvent)):
                with self._in_flight_lock:
                    self._in_flight -= 1
            on_event(event)
        return counted

    def cancel(self, ticket: Ticket) -> None:
        self._inbox.put(Cancelled(ticket.id))
        self._wake.set()

    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, Submitted):
                self._waiting.append(message)
                continue
            queued = next((w for w in self._waiting if w.ticket == message.ticket), None)
            if queued is not None:
                self._waiting.remove(queued)
                queued.on_event(DoneEvent(finish_reason="cancelled", usage=usage(len(queued.request.prompt_ids))))
            else:
                self.engine.cancel(message.ticket)

    def _admit(self) -> None:
        """First come, first served: a stream that does not fit waits, and so do those behind it."""
        while self._waiting and len(self.engine.streams) < self.options.parallel:
            head = self._waiting[0]
            limit = self.limit(head.request)
            admitted = self.admission.admit(head.ticket, head.request.prompt_ids, limit)
            if admitted is None:
                return
            self._waiting.popleft()
            cache, cached_tokens = admitted
            self.engine.add(Stream(id=head.ticket, request=head.request, cache=cache, on_event=head.on_event,
                                   limit=limit, cached_tokens=cached_tokens))

    def _warm_up(self) -> None:
        """On the engine thread, so all it builds and keeps lives where the rounds run (MLX's streams are per
        thread); a failed warm-up only leaves the builds to the first requests."""
        try:
            if self._warm:
                self.warmed_up = warm_up(self.model, prefill_chunk=self.options.prefill_chunk, context=self.context,
                                         shared_rounds=self.engine.shared_rounds, drafter=self.drafter)
                log.info("warmed up: %s", self.warmed_up)
        except Exception as exc:
            log.warning("the warm-up failed (%s: %s); the first requests build what it would have",
                        type(exc).__name__, exc)
        finally:
            self._warmed.set()

    def _loop(self) -> None:
        try:
            self._warm_up()
            while not self._closed:
                self._drain_inbox()
                self._admit()
                if self.engine.idle():
                    if self.group is not None:  # frees the other ranks' caches, and finds a lost rank while idle
                        self.group.sync()
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                try:
                    self.engine.round()
                except Exception:  # keep serving: the engine already failed the streams it could name
                    log.exception("round failed")
        finally:
            release_thread()

    def queued(self) -> int:
        return len(self._waiting)

    def health(self) -> dict:
        report = {"status": "ok", "model": self.model_id, "streams": len(self.engine.streams),
                  "queued": self.queued(), "rounds": self.engine.rounds, "memory": self.admission.snapshot()}
        if self.group is not None:
            report["group"] = self.group.report(self.admission.ledger.held())
            if self.group.failure:
                report.update(status="error", error=self.group.failure)
        return report

    def metrics(self) -> dict:
        """What /metrics reads: streams, the ledger by kind, the prompt cache, and the engine's draft counters."""
        memory = self.admission.snapshot()
        return {"running": len(self.engine.streams), "waiting": self.queued(), "ledger": memory["held_by_kind"],
                "budget": memory["budget_bytes"], "prompt_cache": memory.get("prompt_cache", {}),
                "spec": self.engine.counters.snapshot()}

    def streams_report(self) -> list[dict]:
        """Each stream decoding now: its tokens, tokens/s since it was admitted, drafts offered and kept."""
        now = time.monotonic()
        return [{"id": s.id, "prompt_tokens": s.prompt_len, "generated": s.generated, "rounds": s.stats.rounds,
                 "drafted": s.stats.drafted, "accepted": s.stats.accepted,
                 "tokens_per_s": s.generated / max(now - s.admitted, 1e-3)}
                for s in list(self.engine.streams.values())]

    def capabilities(self) -> dict:
        live = {"memory": {**self._capabilities["memory"], **self.admission.snapshot()}, "queued": self.queued(),
                "warm_up_seconds": None if self.warmed_up is None else round(self.warmed_up.seconds, 3),
                "holds_ahead": self.engine.holds_ahead}
        if self.group is not None:
            live["group"] = self.group.report(self.admission.ledger.held())
        return {**self._capabilities, **live}

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
            if self._thread.is_alive():  # still inside MLX: the interpreter's teardown may abort under it
                log.warning("the engine thread is still running a round 10 s after close()")
        if self.drafter is not None:
            self.drafter.close()
        if self.group is not None:  # last: the other ranks leave once no round can run
            self.group.close()

