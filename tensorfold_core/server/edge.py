"""What every request meets before a route: request id, Host check, API key, draining, body size and pace."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import os
import re
import uuid
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..options import ServeOptions
from .errors import REQUEST_ID, RETRY_AFTER_S, describe, error_response
from .shutdown import Drain

log = logging.getLogger("tensorfold.server")

API_KEY_ENV = "TENSORFOLD_API_KEY"
# a load balancer's probe needs no key; nor does the dashboard's page, which holds no data (its fetches send the key)
OPEN_PATHS = frozenset({"/health", "/dashboard"})
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
DRAIN_LIMIT = 64 << 20  # an oversized body is read and dropped up to this, so the client sees its 413
_GIVEN_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


def is_loopback(name: str) -> bool:
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:
        return False


def _names(value: str | None) -> frozenset[str] | None:
    """A comma-separated list of names; None where it holds '*' (any)."""
    names = frozenset(n.strip().lower().strip("[]") for n in (value or "").split(",") if n.strip())
    return None if "*" in names else names


@dataclass
class Edge:
    """The serve options the edge enforces, and the drain that SIGTERM starts."""

    api_key: str | None = None
    allowed_hosts: frozenset[str] | None = None  # None: any Host header
    allowed_origins: frozenset[str] | None = frozenset()  # empty: CORS off; None: any origin
    max_body_bytes: int = 4 << 20
    read_timeout_s: float = 10.0
    deadline_s: float | None = None
    drain: Drain = field(default_factory=Drain)

    @classmethod
    def from_options(cls, options: ServeOptions) -> "Edge":
        hosts = _names(options.allowed_hosts) if options.allowed_hosts else \
            (LOOPBACK_NAMES | {options.host.lower()}) if is_loopback(options.host) else None
        origins = _names(options.allowed_origins) if options.allowed_origins else frozenset()
        return cls(api_key=options.api_key or os.environ.get(API_KEY_ENV) or None, allowed_hosts=hosts,
                   allowed_origins=origins, max_body_bytes=int(options.max_body_mib * (1 << 20)),
                   read_timeout_s=options.read_timeout_s, deadline_s=options.deadline_s)

    def install(self, app: Starlette) -> None:
        """Put the edge in front of `app`'s routes, and CORS in front of it where origins are allowed (a browser's
        preflight carries no key)."""
        app.add_middleware(EdgeMiddleware, edge=self)
        if self.allowed_origins != frozenset():
            origins = ["*"] if self.allowed_origins is None else sorted(self.allowed_origins)
            app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["GET", "POST", "HEAD"],
                               allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
                               expose_headers=["X-Request-Id", "Retry-After"], max_age=600)


def host_name(header: str) -> str:
    """The name in a Host header, without its port: 'localhost:8000' -> 'localhost', '[::1]:80' -> '::1'."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def redact_paths(value):
    """Capabilities for a client without a key: an absolute path keeps only its last part."""
    if isinstance(value, dict):
        return {k: redact_paths(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact_paths(v) for v in value]
    if isinstance(value, str) and os.path.isabs(value) and len(value) > 1:
        return ".../" + os.path.basename(value.rstrip("/\\"))
    return value


class EdgeMiddleware:
    """Refuses at the door what no route should see; reads the body (capped, paced) before the route does."""

    def __init__(self, app: ASGIApp, edge: Edge):
        self.app = app
        self.edge = edge

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        given = headers.get("x-request-id", "")
        rid = given if _GIVEN_ID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        REQUEST_ID.set(rid)
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        refusal = self._refusal(scope, headers)
        if refusal is not None:
            await self._drained(receive)
            await refusal(scope, receive, send_with_id)
            return
        if scope["method"] not in ("GET", "HEAD", "OPTIONS"):
            body = await self._read_body(headers, receive)
            if not isinstance(body, bytes):
                await body(scope, receive, send_with_id)
                return
            receive = _replay(body, receive)
        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:  # noqa: BLE001 - logged once here, with its request id; never re-raised
            log.exception("request %s (%s %s) failed", rid, scope["method"], scope["path"])
            if not started:
                status, body = describe(exc, rid)
                await error_response(body["error"]["message"], status, kind=body["error"]["type"],
                                     code=body["error"]["code"])(scope, receive, send_with_id)

    def _refusal(self, scope: Scope, headers: dict[str, str]):
        """The response that refuses this request before any route runs, or None."""
        edge, path = self.edge, scope["path"]
        host = headers.get("host")
        if edge.allowed_hosts is not None and host is not None and host_name(host) not in edge.allowed_hosts:
            return error_response(f"this server does not answer for the host {host_name(host)!r} (--allowed-hosts)",
                                  400, code="host_not_allowed", headers={"Connection": "close"})
        if edge.drain.draining:
            if path == "/health":
                return _draining_health()
            return error_response("the server is shutting down and takes no new requests", 503,
                                  code="server_shutting_down",
                                  headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"})
        if edge.api_key and path not in OPEN_PATHS and not _key_matches(headers.get("authorization"), edge.api_key):
            given = "authorization" in headers
            return error_response("Incorrect API key provided." if given else
                                  "You didn't provide an API key: send it as `Authorization: Bearer KEY`.", 401,
                                  kind="invalid_request_error", code="invalid_api_key",
                                  headers={"WWW-Authenticate": "Bearer"})
        return None

    async def _read_body(self, headers: dict[str, str], receive: Receive):
        """The whole body, or the response refusing it: past --max-body-mib (413), or too slow (408)."""
        cap, length = self.edge.max_body_bytes, headers.get("content-length", "")
        if length.isdigit() and int(length) > cap:
            await self._drained(receive)
            return _too_large(f"{int(length):,} bytes", cap)
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.edge.read_timeout_s)
            except asyncio.TimeoutError:
                return error_response(f"the request body stalled for {self.edge.read_timeout_s:g} s "
                                      "(--read-timeout-s)", 408, code="request_timeout",
                                      headers={"Connection": "close"})
            if message["type"] == "http.disconnect":
                return error_response("the client went away", 400, code="client_gone")
            size += len(message.get("body", b""))
            if size > cap:
                await self._drained(receive, size)
                return _too_large(f"more than {cap:,} bytes", cap)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _drained(self, receive: Receive, read: int = 0) -> None:
        """Read and drop what is left of a refused body (up to DRAIN_LIMIT), so the client can read the refusal."""
        while read < DRAIN_LIMIT:
            try:
                message = await asyncio.wait_for(receive(), self.edge.read_timeout_s)
            except asyncio.TimeoutError:
                return
            if message["type"] != "http.request":
                return
            read += len(message.get("body", b""))
            if not message.get("more_body", False):
                return


def _key_matches(header: str | None, key: str) -> bool:
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())


def _too_large(size: str, cap: int) -> JSONResponse:
    return error_response(f"the request body is {size}; this server takes at most {cap:,} (--max-body-mib)", 413,
                          code="request_too_large",
                          headers={"Connection": "close"})


def _draining_health() -> JSONResponse:
    return JSONResponse({"status": "draining"}, status_code=503, headers={"Connection": "close"})


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body read once, then the connection's own messages (a disconnect, for the stream watchers)."""
    given = False

    async def replayed() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
