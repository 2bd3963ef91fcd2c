"""Server-sent events: a generation's steps as OpenAI chunks, `data: {...}` each, then `data: [DONE]`."""

from __future__ import annotations

import json
import logging
from typing import AsyncIterator, Callable

from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse

from .errors import REQUEST_ID, describe
from .choices import Choices
from .generation import ClientGone, Generation, Step

log = logging.getLogger("tensorfold.server")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(payload) -> str:
    if isinstance(payload, BaseModel):
        payload = payload.model_dump(mode="json")
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"


async def _events(first: Step, steps: AsyncIterator[Step], chunk: Callable[[Step], BaseModel | None],
                  openings: list[BaseModel], usage_chunk: Callable[[dict], BaseModel] | None):
    """Chunks for `first` and the rest of `steps`; an error after the headers went out becomes an error event."""
    try:
        for opening in openings:
            yield sse(opening)
        step = first
        while True:
            body = chunk(step)
            if body is not None:
                yield sse(body)
            if step.usage is not None:  # the request's last step (every choice's, where n > 1)
                if usage_chunk is not None:
                    yield sse(usage_chunk(step.usage or {}))
                break
            step = await steps.__anext__()
        yield DONE
    except ClientGone:
        return
    except StopAsyncIteration:  # cannot happen: the generation's last step carries a finish reason
        yield DONE
    except Exception as exc:  # noqa: BLE001 - the status line is gone; tell the client in the stream
        status, body = describe(exc)
        if status >= 500:
            log.error("request %s: stream failed: %s", REQUEST_ID.get(), exc)
        yield sse(body)
        yield DONE
    finally:
        await steps.aclose()


async def open_stream(generation: Generation | Choices, chunk: Callable[[Step], BaseModel | None],
                      opening: BaseModel | list[BaseModel] | None = None,
                      usage_chunk: Callable[[dict], BaseModel] | None = None) -> StreamingResponse | None:
    """Wait for the first step (so an early error is still a plain HTTP error), then stream the rest; `opening`
    chunks (one per choice) go first.

    Returns None when the client left before anything was sent.
    """
    steps = generation.steps()
    try:
        first = await steps.__anext__()
    except ClientGone:
        await steps.aclose()
        return None
    except BaseException:
        await steps.aclose()
        raise
    # the background task also covers a response that never began iterating (client gone at once)
    openings = opening if isinstance(opening, list) else [opening] if opening is not None else []
    return StreamingResponse(_events(first, steps, chunk, openings, usage_chunk), media_type="text/event-stream",
                             headers=SSE_HEADERS, background=BackgroundTask(generation.cancel))
