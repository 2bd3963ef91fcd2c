"""Tools over HTTP with the real openai client on the shipped drafted pair (a template with no tool format: the
tools go in as Hermes text): calls read into message.tool_calls and delta.tool_calls, forced calls whose arguments
follow their schema, results round-tripping by tool_call_id, and every tool reply equal to its `"draft": false`
reply, greedy and seeded, side by side."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema_rs
import openai
import pytest

ASK = [{"role": "user", "content": "What is the weather in Oslo, and what is 2 + 3?"}]
GREEDY = {"temperature": 0}
SEEDED = {"temperature": 0.9, "seed": 5}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"], "properties": {
    "city": {"enum": ["Paris", "Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
ADD = {"type": "object", "additionalProperties": False, "required": ["a", "b"], "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": 0, "maximum": 99}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
# tool_choice auto leaves the call to the model; this tiny one never makes one, so a grammar writes text and a call
SPOKEN_CALL = ('start: /[A-Za-z ,.]{1,24}/ "\\n<tool_call>\\n" call "\\n</tool_call>"\ncall: %json '
               + json.dumps({"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                             "properties": {"name": {"const": "add"}, "arguments": ADD},
                             "x-guidance": {"whitespace_flexible": False, "item_separator": ", "}}))
CASES = {
    "required": dict(tool_choice="required", parallel_tool_calls=False),
    "named": dict(tool_choice={"type": "function", "function": {"name": "add"}}),
    "auto, a call": dict(tool_choice="auto", extra={"guided_grammar": SPOKEN_CALL}),
    "none": dict(tool_choice="none", extra={"guided_grammar": SPOKEN_CALL}),
    "named, n=2": dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}, n=2),
}


@pytest.fixture(scope="module")
def client(shipped):
    return openai.OpenAI(base_url=shipped.url + "/v1", api_key="unused", max_retries=0)


def chat(client, case: dict, draft=True, messages=ASK, **fields):
    case = dict(case)
    return client.chat.completions.create(model="tiny-llama", messages=messages, tools=TOOLS,
                                          max_tokens=fields.pop("max_tokens", 64),
                                          extra_body={"draft": draft, "return_token_ids": True,
                                                      **case.pop("extra", {})}, **case, **fields)


def follows_schema(call) -> bool:
    return jsonschema_rs.is_valid(SCHEMAS[call.function.name], json.loads(call.function.arguments))


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_tool_replies_equal_their_serial_replies_side_by_side_and_forced_calls_follow_their_schema(client, sampling):
    serial = {name: chat(client, case, draft=False, **sampling) for name, case in CASES.items()}
    with ThreadPoolExecutor(len(CASES)) as pool:
        drafted = dict(zip(CASES, pool.map(lambda case: chat(client, case, **sampling), CASES.values())))
    for name, reply in drafted.items():
        for choice, alone in zip(reply.choices, serial[name].choices, strict=True):
            assert choice.token_ids == alone.token_ids, name
            assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []] == \
                [(c.function.name, c.function.arguments) for c in alone.message.tool_calls or []]
    for name in ("required", "named", "auto, a call"):
        choice = drafted[name].choices[0]
        assert choice.finish_reason == "tool_calls", name
        assert len(choice.message.tool_calls) == 1 and follows_schema(choice.message.tool_calls[0]), name
        assert choice.message.tool_calls[0].id.startswith("call_") and choice.message.tool_calls[0].type == "function"
    assert drafted["named"].choices[0].message.tool_calls[0].function.name == "add"
    assert [c.message.tool_calls[0].function.name for c in drafted["named, n=2"].choices] == ["get_weather"] * 2
    assert drafted["named"].choices[0].message.content is None
    assert drafted["auto, a call"].choices[0].message.content.strip()  # the words before the call
    none = drafted["none"].choices[0]
    assert none.message.tool_calls is None and "<tool_call>" in none.message.content and none.finish_reason == "stop"
    assert sum(r.usage.model_extra["tensorfold"]["drafted"] for r in drafted.values()) > 0


def test_a_streamed_call_arrives_in_delta_tool_calls_and_joins_to_the_whole_reply(client):
    for name in ("named", "auto, a call"):
        whole = chat(client, CASES[name], **SEEDED).choices[0]
        case = dict(CASES[name])
        chunks = list(client.chat.completions.create(
            model="tiny-llama", messages=ASK, tools=TOOLS, max_tokens=64, stream=True,
            extra_body=case.pop("extra", {}), **case, **SEEDED))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        calls = [call for d in deltas for call in d.tool_calls or []]
        assert [(c.index, c.function.name, c.function.arguments) for c in calls] == \
            [(0, c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        assert calls[0].id.startswith("call_") and calls[0].type == "function"
        assert "".join(d.content or "" for d in deltas) == (whole.message.content or "")
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_a_parallel_required_reply_may_make_several_calls_each_following_its_schema(client):
    reply = chat(client, {"tool_choice": "required"}, max_tokens=160, **GREEDY).choices[0]
    assert reply.message.tool_calls and all(follows_schema(call) for call in reply.message.tool_calls)


def test_a_call_s_result_goes_back_by_its_tool_call_id_into_the_next_prompt(client, shipped):
    first = chat(client, CASES["named"], **GREEDY).choices[0].message
    call = first.tool_calls[0]
    history = ASK + [first, {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    second = chat(client, {"tool_choice": "none"}, messages=history, max_tokens=8, **GREEDY)
    assert second.choices[0].finish_reason in ("stop", "length")
    sent = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in history]
    prompt = _prompt_text(shipped, {"messages": sent, "tools": TOOLS})
    assert f'<tool_call>\n{{"name": "add", "arguments": {call.function.arguments}}}\n</tool_call>' in prompt
    assert '<tool_response>\n{"name": "add", "content": 5}\n</tool_response>' in prompt
    assert second.usage.prompt_tokens == len(_tokens(shipped, {"messages": sent, "tools": TOOLS}))


def test_the_tools_go_in_as_a_system_message_where_the_template_has_no_tool_format(shipped):
    prompt = _prompt_text(shipped, {"messages": ASK, "tools": TOOLS})
    assert prompt.startswith("<|im_start|>system\n# Tools\n")
    assert json.dumps(TOOLS[1], ensure_ascii=False) in prompt and prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "divide"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools[0].type"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": ASK + [{"role": "tool", "tool_call_id": "call_nowhere", "content": "1"}]},
     "messages[1].tool_call_id"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
])
def test_a_tool_field_the_server_cannot_serve_is_a_400_naming_it(shipped, body, param):
    request = {"messages": ASK, "tools": TOOLS, "max_tokens": 4, **body}
    response = httpx.post(shipped.url + "/v1/chat/completions", json=request)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def _tokens(shipped, body: dict) -> list[int]:
    response = httpx.post(shipped.url + "/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def _prompt_text(shipped, body: dict) -> str:
    tokens = _tokens(shipped, body)
    return shipped.host.tokenizer.decode(tokens, skip_special_tokens=False)
