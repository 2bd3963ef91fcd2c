"""The FastAPI app: OpenAI-compatible routes over a host (the server itself never touches MLX)."""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .. import __version__
from ..options import ServeOptions
from ..errors import RequestError
from ..lanes.types import GenerationRequest
from ..sampling import SamplingParams
from . import errors
from .edge import Edge, redact_paths
from .generation import ClientGone, Generation, Step
from .prompts import chat_prompt_ids, text_prompt_ids
from .reply import Reply
from .schemas import (ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest,
                      ChatDelta, ChatMessageOut, Completion, CompletionChoice, CompletionRequest, GenerationFields,
                      ModelCard, ModelList, Usage)
from .served import ServedHost
from .stream import open_stream

GONE = 499  # nginx's "client closed request": never read by anyone, but honest in the access log


def create_app(host: ServedHost, options: ServeOptions | None = None) -> FastAPI:
    """An app serving `host` under the OpenAI API, behind the edge `options` set (server/edge.py)."""
    app = FastAPI(title="tensorfold", version=__version__, docs_url=None, redoc_url=None)
    app.state.host = host
    app.state.created = int(time.time())
    errors.install(app)
    app.state.edge = edge = Edge.from_options(options or ServeOptions())
    edge.install(app)

    def model_card() -> ModelCard:
        return ModelCard(id=host.model_id, created=app.state.created, max_model_len=host.context)

    @app.api_route("/health", methods=["GET", "HEAD"])
    def health():
        report = host.health()
        return JSONResponse(report, status_code=200 if report.get("status") == "ok" else 503)

    @app.get("/v1/models")
    def models() -> ModelList:
        return ModelList(data=[model_card()])

    @app.get("/v1/models/{model:path}")
    def model(model: str) -> ModelCard:
        _check_model(host, model)
        return model_card()

    @app.get("/v1/capabilities")
    def capabilities():
        report = host.capabilities()
        return report if edge.api_key else redact_paths(report)  # where files lie is for key holders only

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: Request):
        _check_model(host, body.model)
        body.refuse_unsupported()
        messages = [m.for_template(i) for i, m in enumerate(body.messages)]
        prompt_ids = await chat_prompt_ids(host, messages)
        generation = _start(host, body, prompt_ids, http)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(step: Step) -> ChatCompletionChunk | None:
            if not step.piece.text and step.finish_reason is None and not body.return_token_ids:
                return None
            delta = ChatDelta(content=step.piece.text or None)
            choice = ChatChunkChoice(delta=delta, finish_reason=step.finish_reason,
                                     token_ids=step.piece.token_ids if body.return_token_ids else None)
            return ChatCompletionChunk(id=rid, created=created, model=host.model_id, choices=[choice])

        if body.stream:
            opening = ChatCompletionChunk(id=rid, created=created, model=host.model_id,
                                          choices=[ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))])
            usage_chunk = (lambda usage: ChatCompletionChunk(id=rid, created=created, model=host.model_id,
                                                             choices=[], usage=Usage(**usage))) \
                if body.include_usage else None
            return await open_stream(generation, chunk, opening, usage_chunk) or Response(status_code=GONE)
        try:
            done = await generation.collect()
        except ClientGone:
            return Response(status_code=GONE)
        choice = ChatChoice(message=ChatMessageOut(content=done.piece.text), finish_reason=done.finish_reason,
                            token_ids=done.piece.token_ids if body.return_token_ids else None)
        return ChatCompletion(id=rid, created=created, model=host.model_id, choices=[choice],
                              usage=Usage(**done.usage))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        _check_model(host, body.model)
        body.refuse_unsupported()
        prompt = body.single_prompt()
        prompt_ids = await text_prompt_ids(host, prompt)
        generation = _start(host, body, prompt_ids, http)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(step: Step) -> Completion | None:
            if not step.piece.text and step.finish_reason is None and not body.return_token_ids:
                return None
            choice = CompletionChoice(text=step.piece.text, finish_reason=step.finish_reason,
                                      token_ids=step.piece.token_ids if body.return_token_ids else None)
            return Completion(id=rid, created=created, model=host.model_id, choices=[choice])

        if body.stream:
            usage_chunk = (lambda usage: Completion(id=rid, created=created, model=host.model_id, choices=[],
                                                    usage=Usage(**usage))) if body.include_usage else None
            return await open_stream(generation, chunk, None, usage_chunk) or Response(status_code=GONE)
        try:
            done = await generation.collect()
        except ClientGone:
            return Response(status_code=GONE)
        choice = CompletionChoice(text=done.piece.text, finish_reason=done.finish_reason,
                                  token_ids=done.piece.token_ids if body.return_token_ids else None)
        return Completion(id=rid, created=created, model=host.model_id, choices=[choice],
                          usage=Usage(**done.usage))

    return app


def _check_model(host: ServedHost, name: str | None) -> None:
    """A request may leave the model out or name the served id; any other name is a 404."""
    if name and name != host.model_id:
        raise RequestError(f"The model `{name}` does not exist; this server serves `{host.model_id}`.",
                           param="model", code="model_not_found", status=404, kind="not_found_error")


def _start(host: ServedHost, body: GenerationFields, prompt_ids: list[int], http: Request) -> Generation:
    """Build the engine request (eos ids are stop tokens; no limit = the rest of the context) and submit it."""
    limit = body.token_limit()
    max_tokens = limit if limit is not None else max(1, host.context - len(prompt_ids))
    sampling = SamplingParams(temperature=body.temperature, top_k=max(0, body.top_k), top_p=body.top_p,
                              min_p=body.min_p, seed=body.seed)
    eos = frozenset(host.tokenizer.eos_ids)
    request = GenerationRequest(prompt_ids=list(prompt_ids), max_tokens=max_tokens, sampling=sampling,
                                stop_token_ids=eos, draft=body.draft)
    generation = Generation(host, request, Reply(host.tokenizer, body.stop_strings(), eos), http)
    generation.start("prompt" if isinstance(body, CompletionRequest) else "messages")
    return generation
