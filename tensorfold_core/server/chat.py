"""A chat request's turn: what its chat template reads (messages, tools, chat_template_kwargs), and each choice's text
split into reasoning, content and tool calls, the same streamed as whole."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import RequestError
from ..tokenizer import Tokenizer
from .generation import Step
from .prompts import chat_prompt_ids, chat_prompt_opening
from .reasoning import ReasoningSplitter, marks_reasoning, reply_opening
from .schemas import ChatCompletionRequest, ChatDelta, ChatMessageOut, FunctionOut, ToolCallDelta, ToolCallOut
from .served import ServedHost
from .tools import CallReader, ToolCall, Toolbox, renders_tools, template_messages

# what the server itself hands the template: chat_template_kwargs may not set these
RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception"})


def template_inputs(tokenizer: Tokenizer, messages: list[dict], toolbox: Toolbox | None,
                    kwargs: dict | None) -> tuple[list[dict], dict]:
    """The messages and the extra variables the checkpoint's chat template is rendered with: `tools` where the
    template has a tool format of its own (else the tools go in as text, server/tools.py), and the request's
    chat_template_kwargs (e.g. enable_thinking)."""
    variables = dict(kwargs or {})
    taken = sorted(RESERVED & variables.keys())
    if taken:
        raise RequestError(f"chat_template_kwargs: `{taken[0]}` is set by the server, not the request",
                           param=f"chat_template_kwargs.{taken[0]}")
    native = renders_tools(tokenizer.chat_template)
    if native and toolbox is not None:
        variables["tools"] = list(toolbox.tools)
    return template_messages(messages, toolbox, native), variables


@dataclass
class Parts:
    """What a piece of a reply adds to its message."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ChoiceText:
    """One choice's text as it arrives, through the reasoning splitter and then the call reader (each optional)."""

    def __init__(self, reasoning: ReasoningSplitter | None, calls: CallReader | None):
        self.reasoning = reasoning
        self.reader = calls
        self.calls = 0

    def feed(self, text: str, final: bool = False) -> Parts:
        reasoning, content = self.reasoning.feed(text, final) if self.reasoning is not None else ("", text)
        if self.reader is None:
            return Parts(reasoning, content)
        content, calls = self.reader.feed(content, final)
        self.calls += len(calls)
        return Parts(reasoning, content, calls)

    def finish_reason(self, reason: str | None) -> str | None:
        """A reply that made calls and ended on its own says so ("tool_calls"); one cut short keeps its reason."""
        return "tool_calls" if reason == "stop" and self.calls else reason


class ChatTurn:
    """A chat request from its messages to its choices' messages or deltas."""

    def __init__(self, tokenizer: Tokenizer, body: ChatCompletionRequest):
        self.toolbox = Toolbox.from_request(body.tools, body.tool_choice, body.parallel_tool_calls)
        given = [m.for_template(i) for i, m in enumerate(body.messages)]
        self.messages, self.template = template_inputs(tokenizer, given, self.toolbox, body.chat_template_kwargs)
        self.thinks = marks_reasoning(tokenizer.chat_template)
        self.opening: str | None = None  # a thinking template's reply opening (server/reasoning.py), once rendered
        self.streams: dict[int, ChoiceText] = {}

    async def prompt_ids(self, host: ServedHost) -> list[int]:
        if not self.thinks:
            return await chat_prompt_ids(host, self.messages, **self.template)
        ids, opening = await chat_prompt_opening(host, self.messages, **self.template)
        self.opening = reply_opening(opening)
        return ids

    @property
    def reasoning(self) -> bool | None:
        """Whether the reply begins inside its reasoning (True) or may open it (False); None where it holds none."""
        return {"reasoning": True, "start": False}.get(self.opening)

    def grammar(self) -> str | None:
        """The grammar a `required` or named tool_choice holds the reply to (server/tools.py)."""
        return self.toolbox.grammar() if self.toolbox is not None else None

    def _text(self) -> ChoiceText:
        reader = CallReader(self.toolbox.names, self.toolbox.most_calls) \
            if self.toolbox is not None and self.toolbox.reads_calls else None
        inside = self.reasoning
        return ChoiceText(ReasoningSplitter(inside) if inside is not None else None, reader)

    def message(self, step: Step) -> tuple[ChatMessageOut, str | None]:
        """A whole choice's message and its finish reason."""
        text = self._text()
        parts = text.feed(step.piece.text, final=True)
        calls = [ToolCallOut(id=c.id, function=FunctionOut(name=c.name, arguments=c.arguments)) for c in parts.calls]
        content = parts.content if parts.content or not calls else None
        return (ChatMessageOut(content=content, reasoning_content=parts.reasoning or None, tool_calls=calls or None),
                text.finish_reason(step.finish_reason))

    def delta(self, step: Step) -> tuple[ChatDelta, str | None]:
        """A streamed step's delta (each choice keeps its own state) and its finish reason."""
        text = self.streams.setdefault(step.index, self._text())
        parts = text.feed(step.piece.text, final=step.finish_reason is not None)
        first = text.calls - len(parts.calls)
        calls = [ToolCallDelta(index=first + i, id=c.id, function=FunctionOut(name=c.name, arguments=c.arguments))
                 for i, c in enumerate(parts.calls)]
        delta = ChatDelta(content=parts.content or None, reasoning_content=parts.reasoning or None,
                          tool_calls=calls or None)
        return delta, text.finish_reason(step.finish_reason)
