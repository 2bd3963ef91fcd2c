"""Big request bodies parsed and validated, and big replies rendered, on worker threads instead of the event loop."""

from __future__ import annotations

import email.message
import json
from typing import Any, Callable

import anyio
from anyio import to_thread
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .strict import MAY_HOLD_SURROGATES, may_hold_surrogates

# a smaller body is parsed on the loop: below this, parsing costs it about what a worker's round trip would
INLINE_BYTES = 16 << 10
# a reply without logprobs up to this many tokens renders on the loop (~0.15 ms); logprobs always go to a worker
INLINE_REPLY_TOKENS = 1024
# their own threads: big bodies queued here must not hold the threads /health and /v1/models run on
_WORKERS = anyio.CapacityLimiter(2)


def validated(body: bytes, field) -> Any:
    """The body as FastAPI's route makes it (JSON, then the route's body model), refused as FastAPI refuses it."""
    MAY_HOLD_SURROGATES.set(may_hold_surrogates(body))  # in this thread's copy of the request's context
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": exc.msg}}], body=exc.doc) from None
    except Exception:  # undecodable bytes, nesting past the recursion limit
        raise HTTPException(status_code=400, detail="There was an error parsing the body") from None
    value, errors = field.validate(data, {}, loc=("body",))
    if errors:
        raise RequestValidationError(errors, body=data)
    return value


def declares_json(content_type: str | None) -> bool:
    """FastAPI's own test for a body it parses as JSON: application/json or application/*+json."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


class _Validated(Request):
    """A request whose json() is its body already validated (FastAPI then takes the model as it is)."""

    model: BaseModel | None = None

    async def json(self) -> Any:
        return self.model if self.model is not None else await super().json()


class BodyRoute(APIRoute):
    """A route whose JSON body past INLINE_BYTES is parsed and validated on a worker thread."""

    def get_route_handler(self):
        handler = super().get_route_handler()
        field = self.body_field
        if field is None:
            return handler

        async def handle(request: Request) -> Response:
            request = _Validated(request.scope, request.receive)
            body = await request.body()  # already read by the edge: no wait here
            if len(body) > INLINE_BYTES and declares_json(request.headers.get("content-type")):
                request.model = await to_thread.run_sync(validated, body, field, limiter=_WORKERS)
            else:
                MAY_HOLD_SURROGATES.set(may_hold_surrogates(body))  # read by the validation FastAPI runs next
            return await handler(request)

        return handle


def rendered(reply: BaseModel) -> JSONResponse:
    """A reply as FastAPI writes a returned model (jsonable_encoder's output), in two calls to C instead of a walk."""
    return JSONResponse(reply.model_dump(mode="json"))


async def reply_response(build: Callable[[], BaseModel], tokens: int, logprobs: bool) -> JSONResponse:
    """The reply `build` makes, rendered; both on a worker thread when it has logprobs or many tokens."""
    if logprobs or tokens > INLINE_REPLY_TOKENS:
        return await to_thread.run_sync(lambda: rendered(build()), limiter=_WORKERS)
    return rendered(build())
