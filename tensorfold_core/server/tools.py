"""Tools: OpenAI's tools and tool_choice as chat-template input, a grammar for forced calls, calls read from replies.

The calls' convention is Hermes/Qwen's (docs/api.md says why): a call is `<tool_call>` + a JSON object
`{"name": ..., "arguments": {...}}` + `</tool_call>`; where the template has no tool format of its own, a result
goes back as `<tool_response>` + `{"name": ..., "content": ...}` + `</tool_response>` in a user turn.
"""

from __future__ import annotations

import functools
import json
import uuid
from dataclasses import dataclass

import jinja2
import jinja2.meta
import llguidance

from ..errors import RequestError
from .reply import partial_tail
from .schemas import NamedToolChoice, ToolSpec
from .structured import JSON_LAYOUT

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"


@functools.lru_cache(maxsize=8)
def renders_tools(chat_template: str | None) -> bool:
    """Whether a chat template reads a `tools` variable: its own tool format, fed as transformers feeds it."""
    if not chat_template:
        return False
    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(chat_template)
    except jinja2.TemplateSyntaxError:
        return False  # the render names the error, with the request's messages
    return "tools" in jinja2.meta.find_undeclared_variables(tree)


@dataclass(frozen=True)
class ToolCall:
    """A call read from a reply; `arguments` is JSON text, as OpenAI hands it out."""

    id: str
    name: str
    arguments: str


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_schema(function: dict, index: int) -> dict:
    """The JSON schema of one call of `function`: its name, then arguments that follow its parameters."""
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    if parameters.get("type", "object") != "object":
        raise RequestError("a function's parameters must be a JSON schema of an object (type: object)",
                           param=f"tools[{index}].function.parameters")
    return {"type": "object", "properties": {"name": {"const": function["name"]},
                                             "arguments": {"type": "object", **parameters}},
            "required": ["name", "arguments"], "additionalProperties": False}


@dataclass(frozen=True)
class Toolbox:
    """A request's tools and what its tool_choice makes of them."""

    tools: tuple[dict, ...]  # {"type": "function", "function": {...}}, as the client sent them
    mode: str  # "none", "auto", "required", or "named" (tool_choice {"type": "function", "function": {"name": ...}})
    named: str | None = None
    parallel: bool = True  # parallel_tool_calls: may one reply make several calls

    @classmethod
    def from_request(cls, tools: list[ToolSpec] | None, choice: str | NamedToolChoice | None,
                     parallel: bool | None) -> "Toolbox | None":
        """From the request's typed `tools`, `tool_choice` and `parallel_tool_calls`; None without tools."""
        if not tools:
            return None
        names = [tool.function.name for tool in tools]
        twice = next((name for name in names if names.count(name) > 1), None)
        if twice is not None:
            raise RequestError(f"two tools are named {twice!r}; a call names its function", param="tools")
        specs = tuple(tool.model_dump(exclude_none=True) for tool in tools)
        if choice is None or isinstance(choice, str):
            return cls(specs, choice or "auto", None, parallel is not False)
        if choice.function.name not in names:
            raise RequestError(f"tool_choice names {choice.function.name!r}, which is not one of the tools "
                               f"({', '.join(names)})", param="tool_choice.function.name")
        return cls(specs, "named", choice.function.name, parallel is not False)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(tool["function"]["name"] for tool in self.tools)

    @property
    def reads_calls(self) -> bool:
        """Whether replies are read for calls (`none`: the tools are shown, every reply is content)."""
        return self.mode != "none"

    @property
    def most_calls(self) -> int | None:
        """How many calls a reply may make: one for a named function or without parallel calls."""
        return 1 if self.mode == "named" or not self.parallel else None

    def grammar(self) -> str | None:
        """The llguidance grammar holding the reply to calls whose arguments follow their function's schema
        (`required`: one or more calls of any tool, `named`: one call of that function); None where the model
        chooses."""
        if self.mode not in ("required", "named"):
            return None
        calls = [_call_schema(tool["function"], i) for i, tool in enumerate(self.tools)
                 if self.mode == "required" or tool["function"]["name"] == self.named]
        schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": JSON_LAYOUT}
        start = 'start: call' if self.most_calls == 1 else 'start: call ("\\n" call)*'
        lark = f'{start}\ncall: "{CALL_OPEN}\\n" body "\\n{CALL_CLOSE}"\nbody: %json {json.dumps(schema)}'
        try:
            return llguidance.grammar_from("lark", lark)
        except ValueError as exc:
            raise RequestError(f"tools: the grammar engine refused the functions' schemas: {exc}",
                               param="tools") from exc


# ------------------------------------------------------------------------------------------------ prompt side


def template_messages(messages: list[dict], toolbox: Toolbox | None, native: bool) -> list[dict]:
    """The messages as the chat template reads them: earlier calls' arguments parsed into objects (transformers'
    convention), each tool message's tool_call_id checked against the calls made before it; where the template
    has no tool format (`native` false), the tools as a system message and calls and results as Hermes text."""
    made: dict[str, str] = {}  # call id -> its function's name, over the conversation so far
    out = []
    for i, message in enumerate(messages):
        message = dict(message)
        if message.get("tool_calls"):
            if message["role"] != "assistant":
                raise RequestError("only assistant messages make tool calls", param=f"messages[{i}].tool_calls")
            message["tool_calls"] = [_parsed_call(call, f"messages[{i}].tool_calls[{j}]", made)
                                     for j, call in enumerate(message["tool_calls"])]
        if message["role"] == "tool":
            answered = message.get("tool_call_id")
            if answered is None:
                raise RequestError("a tool message needs the tool_call_id of the call it answers",
                                   param=f"messages[{i}].tool_call_id")
            if answered not in made:
                raise RequestError(f"tool_call_id {answered!r} answers no call an earlier assistant message made",
                                   param=f"messages[{i}].tool_call_id")
        elif message.get("tool_call_id") is not None:
            raise RequestError("only a tool message answers a call", param=f"messages[{i}].tool_call_id")
        out.append(message)
    return out if native else _as_text(out, toolbox, made)


def _parsed_call(call: dict, where: str, made: dict[str, str]) -> dict:
    try:
        arguments = json.loads(call["function"]["arguments"])
    except json.JSONDecodeError as exc:
        raise RequestError(f"the arguments are not JSON: {exc}", param=f"{where}.function.arguments") from exc
    if not isinstance(arguments, dict):
        raise RequestError("the arguments must be a JSON object", param=f"{where}.function.arguments")
    made[call["id"]] = call["function"]["name"]
    return {**call, "function": {**call["function"], "arguments": arguments}}


def _as_text(messages: list[dict], toolbox: Toolbox | None, made: dict[str, str]) -> list[dict]:
    """Hermes' convention for a template without one: tools in the system message, a call as its block in the
    assistant's text, results (named by the call their tool_call_id answers) in one user turn."""
    out: list[dict] = []
    results = False  # the last message out is a user turn of tool results
    for message in messages:
        if message["role"] == "tool":
            block = f"{RESULT_OPEN}\n{_result(made[message['tool_call_id']], message.get('content'))}\n{RESULT_CLOSE}"
            if results:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            results = True
            continue
        results = False
        if message.get("tool_calls"):
            blocks = [_call_block(call["function"]["name"], call["function"]["arguments"])
                      for call in message["tool_calls"]]
            text = "\n".join(([message["content"]] if message.get("content") else []) + blocks)
            message = {**{k: v for k, v in message.items() if k != "tool_calls"}, "content": text}
        out.append(message)
    if toolbox is not None:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{tools_prompt(toolbox)}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": tools_prompt(toolbox)})
    return out


def _call_block(name: str, arguments: dict) -> str:
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CALL_CLOSE}"


def _result(name: str, content) -> str:
    """A result as Hermes writes it; content that is JSON text goes in as JSON, other text as a string."""
    try:
        value = json.loads(content) if isinstance(content, str) else content
    except json.JSONDecodeError:
        value = content
    return json.dumps({"name": name, "content": value}, ensure_ascii=False)


def tools_prompt(toolbox: Toolbox) -> str:
    """The system text that shows a template without a tool format the tools, and how to call them."""
    signatures = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in toolbox.tools)
    return ("# Tools\n\nYou may call functions to answer. Their signatures, one JSON object a line:\n"
            f"<tools>\n{signatures}\n</tools>\n\n"
            "To call one, write its name and a JSON object of its arguments inside tags, one block a call:\n"
            f'{CALL_OPEN}\n{{"name": <function name>, "arguments": <arguments object>}}\n{CALL_CLOSE}\n'
            f"Each call's result comes back inside {RESULT_OPEN}{RESULT_CLOSE} tags.")


# ------------------------------------------------------------------------------------------------- reply side


class CallReader:
    """Reads a reply's content as it arrives. A `<tool_call>` block holding a JSON object whose name is one of the
    tools and whose arguments are an object is a call; anything else (a malformed block, one past `most` calls, one
    left open) stays content. Whitespace touching a call is dropped, and a reply that made calls drops its trailing
    whitespace, so the streamed pieces join to the whole reply's content."""

    def __init__(self, names: frozenset[str], most: int | None = None):
        self.names = names
        self.most = most
        self.calls = 0
        self.pending = ""  # text not yet judged: an open block, or what may be the start of one
        self.blank = ""  # a whitespace run outside blocks, kept until what follows it is known
        self.after_call = False  # `blank` follows a call

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        """The content and the calls that `text` completes; `final`: the reply is over, nothing is held."""
        self.pending += text
        content: list[str] = []
        calls: list[ToolCall] = []
        while self.pending:
            if self.pending.startswith(CALL_OPEN) and self._reading():
                end = self.pending.find(CALL_CLOSE)
                if end < 0:
                    if not final:
                        break
                    end = len(self.pending) - len(CALL_CLOSE)  # left open: judged as text below
                block, self.pending = self.pending[:end + len(CALL_CLOSE)], self.pending[end + len(CALL_CLOSE):]
                call = self._call(block[len(CALL_OPEN):-len(CALL_CLOSE)]) if block.endswith(CALL_CLOSE) else None
                if call is not None:
                    self.calls += 1
                    calls.append(call)
                    self.blank, self.after_call = "", True
                else:
                    content.append(self._text(block))
                continue
            start = self.pending.find(CALL_OPEN) if self._reading() else -1
            if start < 0:
                start = len(self.pending) - (0 if final or not self._reading()
                                             else partial_tail(self.pending, CALL_OPEN))
                if start == 0:
                    break
            content.append(self._text(self.pending[:start]))
            self.pending = self.pending[start:]
        if final and self.blank and not self.calls:
            content.append(self.blank)
            self.blank = ""
        return "".join(content), calls

    def _reading(self) -> bool:
        return self.most is None or self.calls < self.most

    def _text(self, text: str) -> str:
        """Text outside calls: blanks after a call are dropped, a trailing blank run kept back until text follows."""
        if self.after_call:
            text = text.lstrip()
        body = text.rstrip()
        if not body:
            self.blank += text
            return ""
        out = self.blank + body
        self.blank, self.after_call = text[len(body):], False
        return out

    def _call(self, inner: str) -> ToolCall | None:
        try:
            value = json.loads(inner)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict) or value.get("name") not in self.names:
            return None
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        if not isinstance(arguments, dict):
            return None
        return ToolCall(call_id(), value["name"], json.dumps(arguments, ensure_ascii=False))
