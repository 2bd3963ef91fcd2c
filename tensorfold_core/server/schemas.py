"""Pydantic models of the OpenAI-compatible request and response bodies."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from ..errors import RequestError
from .strict import Keyed, Many, RequestBody

MAX_CHOICES = 16  # n and best_of: each choice is a stream of its own, queued past --parallel

# --------------------------------------------------------------------------------------------- requests


class StreamOptions(RequestBody):
    include_usage: bool = False


class CalledFunction(RequestBody):
    name: str
    arguments: str  # JSON text, as OpenAI writes it; the template gets it parsed (server/tools.py)


class ToolCallIn(RequestBody):
    """A call an earlier assistant message made, sent back in the conversation."""

    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(RequestBody):
    """One message; content is text or a list of text parts (other part kinds are refused)."""

    model_config = ConfigDict(extra="allow")  # name, reasoning_content, ... reach the chat template as given

    role: str
    content: str | Many[dict[str, Any]] | None = None
    tool_calls: Many[ToolCallIn] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def for_template(self, index: int) -> dict:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            texts = []
            for i, part in enumerate(self.content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise RequestError(f"content part of type {part.get('type')!r} is not supported "
                                       "(only text parts)", param=f"messages[{index}].content[{i}]")
                texts.append(part["text"])
            message["content"] = "".join(texts)
        elif self.content is None:
            message["content"] = ""
        return message


class GenerationFields(RequestBody):
    """The fields both endpoints share: how many tokens, how to draw them, when to stop, what to return.

    Where OpenAI leaves room, tensorfold decides so:
    - temperature defaults to 1.0 as in OpenAI (sampled, keyed by `seed` or, without one, by the prompt);
      send temperature 0 for greedy. A temperature below 1e-5 draws greedily too (sampling.GREEDY_BELOW);
      NaN and infinities are refused, as every float field's are.
    - types are JSON's own (strict.RequestBody): "10" is not an int, 1 is not a bool; unknown fields are refused.
    - no max_tokens / max_completion_tokens: the reply may run to the end of the context; a limit past the
      context is cut at the context (finish_reason "length").
    - the tokenizer's eos tokens end a reply (finish_reason "stop") and are in neither the text nor token_ids.
    - `stop` strings match the detokenized text across token boundaries; the text ends right before the
      stop string, and `token_ids` keep every token up to the one that completed it.
    - `return_token_ids` puts the reply's token ids on the choice (and each chunk's own ids on each chunk).
    - `draft: false` decodes without drafts (the serial reference); the tokens are the same either way.
    - penalties, logit_bias and grammars (response_format, guided_*) change each row's logits from that row's own
      context before its draw (lanes/rows.py), so a drafted reply still equals its `draft: false` reply.
    - `n` choices are n streams reading the prompt once; the i-th is keyed by seed + i (docs/api.md).
    """

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    # OpenAI's default: a request that names no temperature samples at 1.0 (greedy is temperature 0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # 0 or -1: off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | Many[str] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    draft: bool = True
    return_token_ids: bool = False
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)  # vLLM's extra: > 1 discourages prompt and reply tokens
    logit_bias: Keyed[float] | None = None
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's extras: at most one constraint a request
    guided_regex: str | None = None
    guided_choice: Many[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    user: str | None = None  # OpenAI's end-user id: accepted, and used for nothing

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(s == "" for s in stops):
            raise RequestError("stop strings must not be empty", param="stop")
        return stops

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def refuse_unsupported(self) -> None:
        """Fields OpenAI defines that tensorfold does not serve yet: refused, never silently ignored."""
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed when stream is true", param="stream_options")

    def constraint_fields(self) -> dict[str, Any]:
        """The fields a grammar is made from (server/structured.py)."""
        return {name: getattr(self, name) for name in ("response_format", "guided_json", "guided_regex",
                                                        "guided_choice", "guided_grammar")}

    def streams(self) -> int:
        """Streams to decode: one per choice (completions' best_of may run more)."""
        return self.n


class FunctionSpec(RequestBody):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # accepted; a forced call's arguments follow the schema either way


class ToolSpec(RequestBody):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(RequestBody):
    name: str


class NamedToolChoice(RequestBody):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(GenerationFields):
    messages: Many[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: Many[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # server/tools.py
    parallel_tool_calls: bool | None = None  # default true: `required` may make several calls
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extra: variables for the chat template
    modalities: Many[Literal["text"]] | None = None  # text is what is served; "audio" is refused by the type

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        for name in ("tool_choice", "parallel_tool_calls"):
            if getattr(self, name) is not None and not self.tools:
                raise RequestError(f"{name} is only allowed when tools are given", param=name)

    def logprob_count(self) -> int | None:
        """None: no logprobs; k: each token's logprob and its row's k most likely tokens."""
        return (self.top_logprobs or 0) if self.logprobs else None


Text = Annotated[str, Field(min_length=1)]
Ids = Annotated[Many[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(GenerationFields):
    # an empty prompt ("", [] or [[]]) is refused by its type: there is nothing to continue
    prompt: Text | Annotated[Many[Text], Field(min_length=1)] | Ids | Annotated[Many[Ids], Field(min_length=1)]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)

    def logprob_count(self) -> int | None:
        return self.logprobs

    def streams(self) -> int:
        return max(self.n, self.best_of or 1)

    def token_limit(self) -> int | None:
        return self.max_tokens

    def single_prompt(self) -> str | list[int]:
        """The one prompt, as text or token ids; a batch of several is refused."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise RequestError(f"a batch of {len(prompt)} prompts is not supported; send one per request",
                                   param="prompt")
            prompt = prompt[0]
        return prompt

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise RequestError("echo is not supported", param="echo")
        if self.suffix:
            raise RequestError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of < self.n:
            raise RequestError(f"best_of ({self.best_of}) must be at least n ({self.n})", param="best_of")
        if self.stream and self.streams() > self.n:
            raise RequestError("best_of > n cannot be streamed (the best are known only at the end)",
                               param="best_of")


# -------------------------------------------------------------------------------------------- responses


class _Body(BaseModel):
    """A response body; fields named in `_drop_none` are left out when None (others are written as null)."""

    _drop_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _serialize(self, handler):
        data = handler(self)
        return {k: v for k, v in data.items() if not (v is None and k in self._drop_none)}


class Usage(BaseModel):
    """The host's usage dict: OpenAI's counts, prompt_tokens_details.cached_tokens and a `tensorfold` object."""

    model_config = ConfigDict(extra="allow")

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class FunctionOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionOut


class ToolCallDelta(ToolCallOut):
    """A streamed call: each arrives whole, in one chunk, once its closing tag is read (server/tools.py)."""

    index: int


class ChatMessageOut(_Body):
    """The reply: content is null only beside tool calls; reasoning where the template marks it."""

    _drop_none = frozenset({"reasoning_content", "tool_calls"})

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_Body):
    _drop_none = frozenset({"token_ids"})

    index: int = 0
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None
    token_ids: list[int] | None = None


class ChatCompletion(_Body):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(_Body):
    _drop_none = frozenset({"role", "content", "reasoning_content", "tool_calls"})

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Body):
    _drop_none = frozenset({"token_ids"})

    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(_Body):
    _drop_none = frozenset({"usage"})

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(_Body):
    _drop_none = frozenset({"token_ids"})

    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None
    token_ids: list[int] | None = None


class Completion(_Body):
    """A completion, or (object "text_completion" too, as OpenAI does) one streamed chunk of it."""

    _drop_none = frozenset({"usage"})

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tensorfold"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
