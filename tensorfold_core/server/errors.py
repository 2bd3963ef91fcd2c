"""The one place errors become HTTP statuses and OpenAI error bodies."""

from __future__ import annotations

import logging
from contextvars import ContextVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..errors import RequestError, TensorfoldError

log = logging.getLogger("tensorfold.server")

_STATUS_KIND = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                429: "rate_limit_error", 503: "service_unavailable"}


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


RETRY_AFTER_S = 1  # what a 429 asks a client to wait: a stream slot frees within a round or two


def error_response(message: str, status: int = 400, *, kind: str | None = None, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    kind = kind or _STATUS_KIND.get(status, "server_error")
    if status == 429:
        headers = {"Retry-After": str(RETRY_AFTER_S), **(headers or {})}
    return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)


def describe(error: BaseException, request_id: str | None = None) -> tuple[int, dict]:
    """Status and OpenAI error body for any error a request can meet (also used inside SSE streams); a failure of
    the server's own says only where its log holds the cause, never the exception's text."""
    if isinstance(error, RequestError):
        return error.status, error_body(error.message, error.kind, error.param, error.code)
    request_id = request_id or REQUEST_ID.get()
    where = f" (request id {request_id})" if request_id else ""
    return 500, error_body(f"the server failed on this request{where}; its log holds the cause", "server_error",
                           None, "internal_error")


# the id the edge gave the request being served (server/edge.py), for its log line and error body
REQUEST_ID: ContextVar[str | None] = ContextVar("tensorfold_request_id", default=None)


def _param(loc) -> str | None:
    """pydantic's ('body', 'messages', 0, 'content') -> 'messages[0].content'."""
    parts = [p for p in loc if p != "body"]
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "int", "float", "bool") or "[" in part or part.startswith("constrained-"):
            continue  # union-branch names pydantic puts in the location
        else:
            out += ("." if out else "") + str(part)
    return out or None


def validation_response(exc: RequestValidationError, content_type: str = "application/json") -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    if tuple(first.get("loc", ())) == ("body",) and "json" not in content_type:
        # kept strict on purpose: a body without a JSON content type is how cross-site forms reach localhost
        return error_response(f"the body must be JSON sent with Content-Type: application/json (got "
                              f"{content_type or 'no Content-Type'})", 400, code="invalid_content_type")
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return error_response(f"We could not parse the JSON body of your request ({detail}); "
                              "send valid JSON with Content-Type: application/json.", 400, code="invalid_json")
    if tuple(first.get("loc", ())) == ("body",):
        missing = first.get("type") == "missing"
        return error_response("the request needs a JSON body" if missing else "the request body must be a JSON "
                              "object", 400, code="missing_body" if missing else "invalid_body")
    param = _param(first.get("loc", ()))
    if first.get("type") == "extra_forbidden":
        return error_response(f"{param}: tensorfold does not know this field (a field it does not serve is refused, "
                              "never ignored)", 400, param=param, code="unknown_field")
    same = [e["msg"] for e in errors if _param(e.get("loc", ())) == param]
    if len(same) > 1:  # one field, several union branches refused it: say what each wanted
        message = f"{param}: none of its accepted forms fit ({'; '.join(dict.fromkeys(same))})"
    else:
        message = f"{param}: {first['msg']}" if param else first["msg"]
    if len(errors) > len(same):
        more = len(errors) - len(same)
        message += f" (and {more} more problem{'s' if more > 1 else ''})"
    return error_response(message, 400, param=param, code="invalid_value")


def install(app: FastAPI) -> None:
    """Route every error through the OpenAI error body: 400 (never 422) for bad input."""

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return validation_response(exc, request.headers.get("content-type", ""))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        return error_response(str(exc.detail), exc.status_code, headers=exc.headers)  # a 405 keeps its Allow

    @app.exception_handler(TensorfoldError)
    async def _tensorfold(request: Request, exc: TensorfoldError):
        status, body = describe(exc)
        if status >= 500:
            log.error("request %s failed: %s", REQUEST_ID.get(), exc)
        error = body["error"]
        return error_response(error["message"], status, kind=error["type"], param=error["param"], code=error["code"])
    # any other exception is logged once and answered by the edge (server/edge.py), which knows the request id
