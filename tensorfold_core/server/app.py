"""The FastAPI app: OpenAI-compatible routes over a host (the server itself never touches MLX)."""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .. import __version__
from ..options import ServeOptions
from ..errors import RequestError
from . import errors, openapi
from .bodies import BodyRoute, reply_response
from .dashboard import install as install_dashboard
from .edge import Edge, redact_paths
from .chat import ChatTurn
from .choices import Choices
from .generation import ClientGone, Generation, Step
from .logprobs import chat_logprobs, completion_logprobs
from .metrics import Metrics, install as install_metrics
from .prompts import text_prompt_ids
from .reply import Reply
from .requests import engine_requests
from .schemas import (ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatCompletionRequest,
                      ChatDelta, Completion, CompletionChoice, CompletionRequest, GenerationFields,
                      ModelCard, ModelList, Usage)
from .served import ServedHost
from .stream import open_stream
from .structured import Grammars
from .tokenize import install as install_tokenize

GONE = 499  # nginx's "client closed request": never read by anyone, but honest in the access log


def create_app(host: ServedHost, options: ServeOptions | None = None) -> FastAPI:
    """An app serving `host` under the OpenAI API, behind the edge `options` set (server/edge.py)."""
    app = FastAPI(title="tensorfold", version=__version__, docs_url=None, redoc_url=None)
    app.router.route_class = BodyRoute  # every route after this line: a big body is parsed off the event loop
    app.state.host = host
    app.state.created = int(time.time())
    errors.install(app)
    openapi.install(app)
    app.state.edge = edge = Edge.from_options(options or ServeOptions())
    edge.install(app)
    install_dashboard(app, host)
    grammars = Grammars(host.tokenizer)
    metrics = Metrics(host)
    install_metrics(app, metrics)
    install_tokenize(app, host, _check_model)

    def model_card() -> ModelCard:
        return ModelCard(id=host.model_id, created=app.state.created, max_model_len=host.context)

    @app.get("/health")
    async def health():  # on the loop: a few dict reads cost less than the hop to a worker thread and back
        report = host.health()
        return JSONResponse(report, status_code=200 if report.get("status") == "ok" else 503)

    app.add_api_route("/health", health, methods=["HEAD"])  # its own route: one operation id per method

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
        turn = ChatTurn(host.tokenizer, body)  # tools, chat_template_kwargs; reasoning and calls in the reply
        prompt_ids = await turn.prompt_ids(host)
        generation = _start(host, grammars, metrics, body, prompt_ids, http, tool_grammar=turn.grammar(),
                            reasoning=turn.reasoning)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        logprobs = (lambda entries: chat_logprobs(entries, grammars.token_bytes)) \
            if body.logprob_count() is not None else (lambda entries: None)

        def chunk(step: Step) -> ChatCompletionChunk | None:
            delta, finish_reason = turn.delta(step)
            if not delta.model_dump() and finish_reason is None and not body.return_token_ids \
                    and not (step.logprobs and body.logprob_count() is not None):
                return None  # text held back (a stop string or a tag may be starting) and nothing else to say
            choice = ChatChunkChoice(index=step.index, delta=delta, finish_reason=finish_reason,
                                     logprobs=logprobs(step.logprobs),
                                     token_ids=step.piece.token_ids if body.return_token_ids else None)
            return ChatCompletionChunk(id=rid, created=created, model=host.model_id, choices=[choice])

        if body.stream:
            opening = [ChatCompletionChunk(id=rid, created=created, model=host.model_id, choices=[
                ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))]) for i in range(body.n)]
            usage_chunk = (lambda usage: ChatCompletionChunk(id=rid, created=created, model=host.model_id,
                                                             choices=[], usage=Usage(**usage))) \
                if body.include_usage else None
            return await open_stream(generation, chunk, opening, usage_chunk) or Response(status_code=GONE)
        try:
            done, usage = await _collect(generation)
        except ClientGone:
            return Response(status_code=GONE)

        def reply() -> ChatCompletion:
            choices = [ChatChoice(index=step.index, message=message, finish_reason=finish_reason,
                                  logprobs=logprobs(step.logprobs),
                                  token_ids=step.piece.token_ids if body.return_token_ids else None)
                       for step in done for message, finish_reason in [turn.message(step)]]
            return ChatCompletion(id=rid, created=created, model=host.model_id, choices=choices, usage=Usage(**usage))

        return await reply_response(reply, _tokens(done), body.logprob_count() is not None)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        _check_model(host, body.model)
        body.refuse_unsupported()
        prompt = body.single_prompt()
        prompt_ids = await text_prompt_ids(host, prompt)
        generation = _start(host, grammars, metrics, body, prompt_ids, http)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        offsets: dict[int, int] = {}  # each choice's text so far, for text_offset

        def logprobs(step: Step) -> dict | None:
            if body.logprobs is None:
                return None
            out = completion_logprobs(step.logprobs, grammars.token_bytes, offsets.get(step.index, 0))
            offsets[step.index] = offsets.get(step.index, 0) + sum(len(t) for t in out["tokens"])
            return out

        def chunk(step: Step) -> Completion | None:
            if not step.piece.text and step.finish_reason is None and not body.return_token_ids:
                return None
            choice = CompletionChoice(index=step.index, text=step.piece.text, finish_reason=step.finish_reason,
                                      logprobs=logprobs(step),
                                      token_ids=step.piece.token_ids if body.return_token_ids else None)
            return Completion(id=rid, created=created, model=host.model_id, choices=[choice])

        if body.stream:
            usage_chunk = (lambda usage: Completion(id=rid, created=created, model=host.model_id, choices=[],
                                                    usage=Usage(**usage))) if body.include_usage else None
            return await open_stream(generation, chunk, None, usage_chunk) or Response(status_code=GONE)
        try:
            done, usage = await _collect(generation)
        except ClientGone:
            return Response(status_code=GONE)

        def reply() -> Completion:
            choices = [CompletionChoice(index=step.index, text=step.piece.text, finish_reason=step.finish_reason,
                                        logprobs=logprobs(step),
                                        token_ids=step.piece.token_ids if body.return_token_ids else None)
                       for step in done]
            return Completion(id=rid, created=created, model=host.model_id, choices=choices, usage=Usage(**usage))

        return await reply_response(reply, _tokens(done), body.logprobs is not None)

    return app


def _check_model(host: ServedHost, name: str | None) -> None:
    """A request may leave the model out or name the served id; any other name is a 404."""
    if name and name != host.model_id:
        raise RequestError(f"The model `{name}` does not exist; this server serves `{host.model_id}`.",
                           param="model", code="model_not_found", status=404, kind="not_found_error")


def _start(host: ServedHost, grammars: Grammars, metrics: Metrics, body: GenerationFields, prompt_ids: list[int],
           http: Request, tool_grammar: str | None = None, reasoning: bool | None = None) -> Generation | Choices:
    """Build the engine requests (one per choice; best_of may run more) and submit them; `tool_grammar` holds a
    chat's reply to tool calls (server/tools.py); `reasoning`: a thinking chat's grammar starts after it."""
    streams = body.streams()
    # best_of ranks by cumulative logprob, so its streams report the drawn tokens' logprobs whether shown or not
    logprobs = body.logprob_count() if streams == body.n else (body.logprob_count() or 0)
    grammar = grammars.for_request(body.constraint_fields(), tool_grammar, reasoning)
    requests = engine_requests(host, body, prompt_ids, streams=streams, logprobs=logprobs, grammar=grammar)
    eos, stops = host.tokenizer.eos_ids, body.stop_strings()
    # the first choice watches the connection; the others end with it
    generations = [Generation(host, request, Reply(host.tokenizer, stops, eos), http if i == 0 else None, index=i,
                              metrics=metrics) for i, request in enumerate(requests)]
    generation = generations[0] if len(generations) == 1 else Choices(generations, shown=body.n)
    generation.start("prompt" if isinstance(body, CompletionRequest) else "messages")
    return generation


def _tokens(done: list[Step]) -> int:
    return sum(len(step.piece.token_ids) for step in done)


async def _collect(generation: Generation | Choices) -> tuple[list[Step], dict]:
    """Every shown choice's whole reply, and the request's usage."""
    if isinstance(generation, Choices):
        return await generation.collect()
    done = await generation.collect()
    return [done], done.usage
