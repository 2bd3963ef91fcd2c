"""Draining on SIGTERM: new requests get a 503, running ones finish within a grace period, the rest end cleanly."""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from ..errors import RequestError

log = logging.getLogger("tensorfold.server")

POLL_S = 0.05  # how often a drain looks at what is still running: short against any grace period
FLUSH_S = 5.0  # after the cut: time the cut replies get to write their error event and [DONE]


class Abortable(Protocol):
    def abort(self, error: Exception) -> None:
        """End the reply now with `error`: a final error event (or an error status) and its slot freed."""


def shutting_down() -> RequestError:
    return RequestError("the server is shutting down; this reply was still running when its grace period "
                        "(--grace-s) ended", status=503, kind="service_unavailable", code="server_shutting_down")


class Drain:
    """The replies in flight, and whether the server still takes new requests."""

    def __init__(self) -> None:
        self.live: set[Abortable] = set()
        self.draining = False

    def add(self, reply: Abortable) -> None:
        self.live.add(reply)

    def discard(self, reply: Abortable) -> None:
        self.live.discard(reply)

    async def run(self, grace_s: float) -> int:
        """Refuse new requests, give running ones `grace_s` to finish, then cut the rest; returns how many were cut."""
        self.draining = True
        loop = asyncio.get_running_loop()
        until = loop.time() + grace_s
        if self.live:
            log.info("draining: %d replies running, up to %.1f s to finish", len(self.live), grace_s)
        while self.live and loop.time() < until:
            await asyncio.sleep(POLL_S)
        cut = list(self.live)
        for reply in cut:
            reply.abort(shutting_down())
        if cut:
            log.warning("draining: %d replies still running after %.1f s end with an error event", len(cut), grace_s)
        until = loop.time() + FLUSH_S
        while self.live and loop.time() < until:
            await asyncio.sleep(POLL_S)
        return len(cut)
