"""Running the app under uvicorn: in the foreground (`serve`) or on a background thread (tests, embedding)."""

from __future__ import annotations

import socket
import sys
import threading
from typing import Callable

import uvicorn

from .app import create_app
from .served import ServedHost


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


class _Uvicorn(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_started: Callable[[], None]):
        super().__init__(config)
        self.on_started = on_started

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            self.on_started()


class Server:
    """One HTTP server for a host on a bound socket: `.port` and `.url` are known as soon as it exists."""

    def __init__(self, host: ServedHost, bind_host: str = "127.0.0.1", port: int = 0, log_level: str = "info"):
        self.host = host
        self.bind_host = bind_host
        self.socket = _bind(bind_host, port)
        self.port: int = self.socket.getsockname()[1]
        shown = f"[{bind_host}]" if ":" in bind_host else bind_host
        self.url = f"http://{shown}:{self.port}"
        config = uvicorn.Config(create_app(host), log_level=log_level, timeout_graceful_shutdown=3,
                                lifespan="off")
        self._started = threading.Event()
        self._uvicorn = _Uvicorn(config, self._started.set)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def serve(self, ready_callback: Callable[["Server"], None] | None = None) -> None:
        """Serve in this thread until Ctrl-C / SIGTERM (or `stop()` from another thread)."""
        def started():
            self._started.set()
            print(f"tensorfold: serving {self.host.model_id} at {self.url}/v1", file=sys.stderr, flush=True)
            if ready_callback is not None:
                ready_callback(self)

        self._uvicorn.on_started = started
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
          ready_callback: Callable[[Server], None] | None = None, log_level: str = "info") -> None:
    """Serve `host` until interrupted; prints the bound URL and calls `ready_callback(server)` once listening.

    The caller keeps ownership of `host` (close it after this returns).
    """
    Server(host, bind_host, port, log_level=log_level).serve(ready_callback)


def start_in_thread(host: ServedHost, port: int = 0, bind_host: str = "127.0.0.1", log_level: str = "warning") -> Server:
    """A server on a background thread; `.url`, `.port` and `.stop()` on the returned handle."""
    return Server(host, bind_host, port, log_level=log_level).start()
