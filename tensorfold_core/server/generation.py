"""One request's run on the host: submit, bridge engine events to asyncio, cancel on stop string or disconnect."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from starlette.requests import Request

from ..errors import TensorfoldError
from ..lanes.rows import TokenLogprob
from ..lanes.types import DoneEvent, ErrorEvent, GenerationRequest, TokenEvent
from .reply import Piece, Reply
from .served import ServedHost

log = logging.getLogger("tensorfold.server")


class ClientGone(Exception):
    """The HTTP client went away before the reply was done."""


@dataclass
class Step:
    """A piece of the reply; the last step also carries the finish reason and the usage."""

    piece: Piece
    finish_reason: str | None = None
    usage: dict | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token id of the piece, when asked
    index: int = 0  # which choice of the request (n > 1)


class Generation:
    """Drives one stream: the engine thread calls `_on_event`; the event loop reads `steps()`."""

    def __init__(self, host: ServedHost, request: GenerationRequest, reply: Reply, http: Request | None = None,
                 index: int = 0, metrics=None):
        self.host = host
        self.index = index
        self.metrics = metrics  # server/metrics.Metrics, told of each round's tokens and of the end
        self.submitted = self.last_tokens = time.monotonic()
        self.saw_tokens = False
        self.logprobs: list[TokenLogprob] = []
        self.request = request
        self.reply = reply
        self.http = http
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.ticket = None
        self.finished = False  # the host sent its DoneEvent or ErrorEvent
        self.cancelled = False
        self.edge = None  # server/edge.Edge: its drain and deadline, once started with an HTTP request
        self.timer: asyncio.TimerHandle | None = None
        self.expired = False  # the deadline ended the reply

    def start(self, prompt_param: str = "prompt") -> None:
        """Submit to the host; a request it can never serve raises RequestError here, naming `prompt_param`.
        A generation with its HTTP request joins the app's drain and runs under its deadline (server/edge.py)."""
        self.ticket = self.host.submit(self.request, self._on_event, prompt_param)
        if self.http is not None:
            self.edge = self.http.app.state.edge
            self.edge.drain.add(self)
            if self.edge.deadline_s is not None:
                self.timer = self.loop.call_later(self.edge.deadline_s, self._expire)

    def _expire(self) -> None:
        self.expired = True
        self.cancel()

    def abort(self, error: Exception) -> None:
        """End the reply now with `error` after what it already has (the server is going away); frees its slot."""
        self.queue.put_nowait(ErrorEvent(error=error))
        self.cancel()

    def _leave(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.edge is not None:
            self.edge.drain.discard(self)

    def _usage(self, usage: dict) -> dict:
        """The host's usage, counting the ids the reply returns: not an eos, nor tokens past a stop string."""
        completion = len(self.reply.token_ids)
        return {**usage, "completion_tokens": completion, "total_tokens": usage["prompt_tokens"] + completion}

    def _on_event(self, event) -> None:
        # called from the engine thread: hand the event to the loop, never touch asyncio objects here
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the loop is closed: the server is gone, nobody is listening
            pass

    def cancel(self) -> None:
        """Ask the host to end the stream at its next round (idempotent; a no-op once it is done)."""
        if self.ticket is not None and not self.finished and not self.cancelled:
            self.cancelled = True
            self.host.cancel(self.ticket)

    async def _next_event(self, watcher: asyncio.Task | None):
        if watcher is None:
            return await self.queue.get()
        getter = asyncio.ensure_future(self.queue.get())
        try:
            await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not getter.done():
                getter.cancel()
        if getter.done() and not getter.cancelled():
            return getter.result()
        raise ClientGone()

    async def steps(self) -> AsyncIterator[Step]:
        """Pieces of the reply as rounds land, then a final step; raises ClientGone or the stream's error."""
        watcher = asyncio.ensure_future(_disconnected(self.http)) if self.http is not None else None
        try:
            while True:
                event = await self._next_event(watcher)
                if isinstance(event, TokenEvent):
                    if self.metrics is not None:
                        self.last_tokens = self.metrics.tokens(self.last_tokens, len(event.token_ids),
                                                               first=not self.saw_tokens)
                    self.saw_tokens = True
                    piece = self.reply.feed(event.token_ids)
                    logprobs = (event.logprobs or [])[:len(piece.token_ids)]  # the reply keeps a prefix
                    self.logprobs += logprobs
                    if self.reply.stopped:
                        self.cancel()  # eos is the host's own stop token; a stop string needs telling
                    if piece.text or piece.token_ids:
                        yield Step(piece, logprobs=logprobs, index=self.index)
                elif isinstance(event, DoneEvent):
                    self.finished = True
                    if self.metrics is not None:
                        self.metrics.done(self.submitted, self._finish_reason(event), event.usage)
                    yield Step(self.reply.finish(), self._finish_reason(event), self._usage(event.usage),
                               index=self.index)
                    return
                elif isinstance(event, ErrorEvent):
                    self.finished = True
                    raise _as_raisable(event.error)
        finally:
            if watcher is not None:
                watcher.cancel()
            self.cancel()  # a client gone, or a generator closed early: free the engine's slot
            self._leave()

    def _finish_reason(self, event: DoneEvent) -> str:
        if self.reply.ended:
            return "stop"
        if self.expired and event.finish_reason == "cancelled":
            return "length"  # --deadline-s ends a reply as max_tokens would
        if event.finish_reason == "cancelled" and not self.cancelled:
            log.warning("stream cancelled by the host before it finished")
        return event.finish_reason

    async def collect(self) -> Step:
        """Run to the end; the step returned holds the whole reply's text and token ids."""
        last = None
        async for step in self.steps():
            last = step
        return Step(Piece(self.reply.text, list(self.reply.token_ids)), last.finish_reason, last.usage,
                    list(self.logprobs), self.index)


async def _disconnected(http: Request) -> None:
    """Returns once the client has gone (the request body is already read, so only a disconnect arrives)."""
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return


def _as_raisable(error) -> BaseException:
    """A stream's error as a TensorfoldError, so it maps to an error body like any other."""
    if isinstance(error, TensorfoldError):
        return error
    wrapped = TensorfoldError(f"the engine failed this stream: {type(error).__name__}: {error}")
    wrapped.__cause__ = error if isinstance(error, BaseException) else None
    return wrapped
