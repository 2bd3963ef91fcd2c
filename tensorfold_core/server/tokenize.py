"""/tokenize and /detokenize in vLLM's shapes: text or chat messages to ids (through the chat template), ids to text."""

from __future__ import annotations

from typing import Any, Callable

import jinja2
from fastapi import FastAPI
from fastapi.responses import Response
from pydantic import BaseModel, Field

from ..errors import CheckpointError, RequestError
from .bodies import rendered
from .chat import template_inputs
from .prompts import tokenizing
from .schemas import ChatMessage, ToolSpec
from .served import ServedHost
from .strict import Many, RequestBody
from .tools import Toolbox


class _Body(RequestBody):
    model: str | None = None


class TokenizeRequest(_Body):
    """vLLM's two forms: `prompt` (text), or `messages` through the chat template."""

    prompt: str | None = None
    messages: Many[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # default: true for a prompt (bos where the tokenizer adds one)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Many[ToolSpec] | None = None  # as a chat request's: the template's own tool format, or the tools as text
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Body):
    tokens: Many[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def install(app: FastAPI, host: ServedHost, check_model: Callable[[ServedHost, str | None], None]) -> None:
    """The two routes, under / as vLLM serves them (and under /v1 too)."""

    async def tokenize(body: TokenizeRequest) -> Response:
        check_model(host, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise RequestError("send exactly one of `prompt` and `messages`", param="prompt")
        # off the event loop: a long prompt takes the tokenizer seconds, and its ids and strings a while to write
        return await tokenizing(_tokenized, host, body)

    async def detokenize(body: DetokenizeRequest) -> Response:
        check_model(host, body.model)
        return await tokenizing(_detokenized, host, body.tokens)

    for prefix in ("", "/v1"):
        app.post(f"{prefix}/tokenize", response_model=TokenizeResponse)(tokenize)
        app.post(f"{prefix}/detokenize", response_model=DetokenizeResponse)(detokenize)


def _tokenized(host: ServedHost, body: TokenizeRequest) -> Response:
    if body.prompt is not None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = host.tokenizer.encode(body.prompt, add_special_tokens=special)
    else:
        if body.continue_final_message:
            raise RequestError("continue_final_message is not supported", param="continue_final_message")
        given = [m.for_template(i) for i, m in enumerate(body.messages)]
        toolbox = Toolbox.from_request(body.tools, None, None)
        messages, template = template_inputs(host.tokenizer, given, toolbox, body.chat_template_kwargs)
        template["add_generation_prompt"] = body.add_generation_prompt
        try:
            ids = host.tokenizer.encode_chat(messages, **template)
        except (CheckpointError, jinja2.TemplateError) as exc:
            raise RequestError(f"the chat template refused the messages: {exc}", param="messages") from exc
    strs = [host.tokenizer.decode([t], skip_special_tokens=False) for t in ids] if body.return_token_strs else None
    return rendered(TokenizeResponse(count=len(ids), max_model_len=host.context, tokens=ids, token_strs=strs))


def _detokenized(host: ServedHost, tokens: list[int]) -> Response:
    vocab = host.tokenizer.backend.get_vocab_size(with_added_tokens=True)
    bad = next((i for i, t in enumerate(tokens) if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(f"token id {tokens[bad]} at index {bad} is outside the vocabulary (0..{vocab - 1})",
                           param="tokens", code="invalid_token_id")
    return rendered(DetokenizeResponse(prompt=host.tokenizer.decode(tokens)))
