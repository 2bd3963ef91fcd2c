"""The OpenAPI document as the server answers: OpenAI error bodies with 400/401/404/413/429/503, never a 422."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_SCHEMA = {
    "title": "ErrorResponse", "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
# what every route may answer at the edge (server/edge.py), and what a body adds (validation, size, pace, queue)
EDGE = {"400": "A Host header this server does not answer for", "401": "A missing or wrong API key",
        "500": "The server failed (the body names the request id its log holds)",
        "503": "The server is shutting down"}
WITH_BODY = {"400": "The request is malformed or can never be served; `param` names the field",
             "404": "The model named is not served here", "408": "The body arrived too slowly",
             "413": "The body is larger than --max-body-mib", "429": "The queue is full (Retry-After says when)"}
NAMED = {"404": "The model named is not served here"}
STREAMED = ("/v1/chat/completions", "/v1/completions")
# one server-sent event: `data` holds a chunk's JSON, then an error body's where the stream failed, then [DONE]
SSE_EVENT = {"type": "object", "properties": {"event": {"type": "string"}, "data": {"type": "string"}}}


def install(app: FastAPI) -> None:
    """Make `app.openapi()` describe the error statuses the server really answers with."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, routes=app.routes)
            app.openapi_schema = described(document)
        return app.openapi_schema

    app.openapi = openapi


def described(document: dict) -> dict:
    """FastAPI's document with its 422 and validation schemas gone and the OpenAI error responses in."""
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    schemas["ErrorResponse"] = ERROR_SCHEMA
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    for path, operations in document.get("paths", {}).items():
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            if path in STREAMED:  # `stream: true` answers server-sent events
                content = responses.setdefault("200", {"description": "Successful Response"}).setdefault("content", {})
                content["text/event-stream"] = {"schema": SSE_EVENT}
            if path == "/metrics":  # prometheus' text format, which FastAPI cannot see from the route
                responses["200"] = {"description": "Prometheus metrics",
                                    "content": {"text/plain": {"schema": {"type": "string"}}}}
            if path == "/health":  # open to all, and its 503 is its own report, not an error body
                responses.setdefault("503", {"description": "Not serving: draining, or the engine is down"})
                continue
            statuses = {**EDGE, **(WITH_BODY if "requestBody" in operation else {}), **(NAMED if "{" in path else {})}
            for status, description in statuses.items():
                responses.setdefault(status, {"description": description, **error})
            if "429" in responses:
                responses["429"]["headers"] = {"Retry-After": {"schema": {"type": "integer"},
                                                               "description": "Seconds to wait"}}
    return document
