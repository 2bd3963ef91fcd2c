"""A request's prompt as ids, worked out off the event loop; text that cannot fit is refused before it is tokenized."""

from __future__ import annotations

from typing import Callable, TypeVar

import anyio
import jinja2
from anyio import to_thread

from ..errors import CheckpointError, RequestError
from .served import ServedHost

# its own threads: a queue of long prompts must not hold the threads the plain routes (/health, /v1/models) run on
_TOKENIZING = anyio.CapacityLimiter(2)
T = TypeVar("T")


async def tokenizing(work: Callable[..., T], *args) -> T:
    """`work(*args)` on the tokenizing threads."""
    return await to_thread.run_sync(work, *args, limiter=_TOKENIZING)


async def chat_prompt_ids(host: ServedHost, messages: list[dict], **template) -> list[int]:
    """The messages through the chat template (`template`: its extra variables, e.g. tools, enable_thinking),
    then tokenized; errors name `messages`."""
    return await tokenizing(_chat_ids, host, messages, template)


async def chat_prompt_opening(host: ServedHost, messages: list[dict], **template) -> tuple[list[int], str]:
    """chat_prompt_ids, and the text the generation prompt adds after the conversation (where a thinking
    template may open the reply's reasoning)."""
    return await tokenizing(_chat_opening, host, messages, template)


async def text_prompt_ids(host: ServedHost, prompt: str | list[int]) -> list[int]:
    """A completion's prompt: text tokenized, ids as given (the host checks them); errors name `prompt`."""
    if not isinstance(prompt, str):
        return list(prompt)
    return await tokenizing(_text_ids, host, prompt)


def _chat_ids(host: ServedHost, messages: list[dict], template: dict) -> list[int]:
    return _encoded(host, _render(host, messages, template))


def _chat_opening(host: ServedHost, messages: list[dict], template: dict) -> tuple[list[int], str]:
    whole = _render(host, messages, template)
    ids = _encoded(host, whole)
    bare = _render(host, messages, {**template, "add_generation_prompt": False})
    return ids, whole[len(bare):] if whole.startswith(bare) else whole


def _encoded(host: ServedHost, text: str) -> list[int]:
    _refuse_past_context(host, text, "messages")
    return host.tokenizer.encode(text, add_special_tokens=False)


def _render(host: ServedHost, messages: list[dict], template: dict) -> str:
    try:
        return host.tokenizer.apply_chat_template(messages, **template)
    except (CheckpointError, jinja2.TemplateError) as exc:
        raise RequestError(f"the chat template refused the messages: {exc}", param="messages") from exc


def _text_ids(host: ServedHost, text: str) -> list[int]:
    _refuse_past_context(host, text, "prompt")
    return host.tokenizer.encode(text)


def _refuse_past_context(host: ServedHost, text: str, param: str) -> None:
    """Text whose bytes alone prove it holds the whole context is refused without being tokenized."""
    fewest = host.tokenizer.fewest_tokens(text)
    if fewest >= host.context:
        raise RequestError(f"this model's context is {host.context} tokens; the prompt's text holds at least "
                           f"{fewest} (at least one must be left for the reply)", param=param,
                           code="context_length_exceeded")
