"""Running the app under uvicorn: in the foreground (`serve`) or on a background thread (tests, embedding)."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket
import sys
import threading
from typing import Callable

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..options import ServeOptions
from .app import create_app
from .edge import is_loopback
from .served import ServedHost

log = logging.getLogger("tensorfold.server")
DRAIN_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # the first drains; a second one stops at once, as uvicorn does


def _bind(bind_host: str, port: int) -> socket.socket:
    """Bind before uvicorn starts, so port 0 has its real number before the first request."""
    family, kind, proto, _, address = socket.getaddrinfo(bind_host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _read_timed(seconds: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request headers take longer than `seconds` to arrive
    (uvicorn times only idle keep-alive connections, so a slowloris client could hold one forever)."""

    class ReadTimed(H11Protocol):
        _late = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's headers are in
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request's headers are timed too

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._late = self.loop.call_later(seconds, self._headers_late)

        def _disarm(self) -> None:
            if self._late is not None:
                self._late.cancel()
                self._late = None

        def _headers_late(self) -> None:
            self._late = None
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self.transport.close()

    return ReadTimed


class _Uvicorn(uvicorn.Server):
    """uvicorn, but SIGTERM (or a first Ctrl-C) drains the app before it stops, and then exits 0."""

    def __init__(self, config: uvicorn.Config, on_started: Callable[[], None], drain: Callable):
        super().__init__(config)
        self.on_started = on_started
        self.drain = drain  # a coroutine function: refuse new requests, let running ones end
        self.loop: asyncio.AbstractEventLoop | None = None
        self.draining = False

    async def startup(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.started:
            self.on_started()

    def handle_exit(self, sig: int, frame) -> None:
        if self.draining or sig not in DRAIN_SIGNALS or self.loop is None:
            super().handle_exit(sig, frame)
            return
        self.draining = True
        self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self.drain_then_exit()))

    async def drain_then_exit(self) -> None:
        try:
            await self.drain()
        finally:
            self.should_exit = True


class Server:
    """One HTTP server for a host on a bound socket: `.port` and `.url` are known as soon as it exists."""

    def __init__(self, host: ServedHost, bind_host: str = "127.0.0.1", port: int = 0, log_level: str = "info",
                 options: ServeOptions | None = None):
        self.host = host
        self.bind_host = bind_host
        self.options = (options or ServeOptions()).model_copy(update={"host": bind_host, "port": port})
        self.socket = _bind(bind_host, port)
        self.port: int = self.socket.getsockname()[1]
        shown = f"[{bind_host}]" if ":" in bind_host else bind_host
        self.url = f"http://{shown}:{self.port}"
        self.app = create_app(host, self.options)
        self.edge = self.app.state.edge
        # the drain already gave running replies their grace: what uvicorn waits for after it is their last bytes
        config = uvicorn.Config(self.app, log_level=log_level, timeout_graceful_shutdown=5, lifespan="off",
                                http=_read_timed(self.options.read_timeout_s),
                                timeout_keep_alive=self.options.keep_alive_s)
        self._started = threading.Event()
        self._uvicorn = _Uvicorn(config, self._started.set, self.drain)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def serve(self, ready_callback: Callable[["Server"], None] | None = None) -> None:
        """Serve in this thread until Ctrl-C / SIGTERM (or `stop()` from another thread)."""
        def started():
            self._started.set()
            print(f"tensorfold: serving {self.host.model_id} at {self.url}/v1", file=sys.stderr, flush=True)
            warmed = self.host.capabilities().get("warm_up_seconds")
            if warmed is not None:  # TENSORFOLD_WARM_UP, on a GPU by default: the builds a first reply would wait on
                print(f"tensorfold: warmed up at load in {warmed:.1f} s", file=sys.stderr, flush=True)
            if not is_loopback(self.bind_host) and not self.edge.api_key:
                print(f"tensorfold: warning: listening on {self.bind_host} beyond loopback with no API key: anyone "
                      "who reaches this port can use the model (--api-key or TENSORFOLD_API_KEY sets one)",
                      file=sys.stderr, flush=True)
            if ready_callback is not None:
                ready_callback(self)

        self._uvicorn.on_started = started
        # the loaded model lives as long as the process: full collections, which stall the loop too, skip it
        gc.collect()
        gc.freeze()
        try:
            self._uvicorn.run(sockets=[self.socket])
        finally:
            self.socket.close()

    def start(self, timeout: float = 30.0) -> "Server":
        """Serve on a daemon thread; returns once the server accepts connections."""
        def run():
            try:
                self._uvicorn.run(sockets=[self.socket])
            except BaseException as exc:  # noqa: BLE001 - surfaced to the starting thread
                self._error = exc
                self._started.set()
            finally:
                self.socket.close()

        self._thread = threading.Thread(target=run, name=f"tensorfold-http-{self.port}", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout) or self._error is not None:
            self.stop()
            raise RuntimeError(f"the HTTP server on {self.url} did not start: {self._error!r}")
        return self

    async def drain(self) -> int:
        """New requests get a 503; running ones get --grace-s to finish; returns how many were cut after it."""
        return await self.edge.drain.run(self.options.grace_s)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop accepting, let open requests end (cancelled after a grace period), join the thread."""
        self._uvicorn.should_exit = True
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(host: ServedHost, bind_host: str = "127.0.0.1", port: int = 8000,
          ready_callback: Callable[[Server], None] | None = None, log_level: str = "info",
          options: ServeOptions | None = None) -> None:
    """Serve `host` until interrupted (SIGTERM drains first); prints the bound URL and calls
    `ready_callback(server)` once listening.

    The caller keeps ownership of `host` (close it after this returns).
    """
    Server(host, bind_host, port, log_level=log_level, options=options).serve(ready_callback)


def start_in_thread(host: ServedHost, port: int = 0, bind_host: str = "127.0.0.1", log_level: str = "warning",
                    options: ServeOptions | None = None) -> Server:
    """A server on a background thread; `.url`, `.port` and `.stop()` on the returned handle."""
    return Server(host, bind_host, port, log_level=log_level, options=options).start()
