"""A thinking checkpoint with its own tool format (the shipped tiny-llama with a Qwen3-like chat template, drafted by
the shipped drafter): chat_template_kwargs reach the template, tools render as transformers renders them, and
replies split their reasoning into reasoning_content, whole and streamed, equal drafted or not."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

# the generation prompt opens the reasoning block (as DeepSeek-R1's does); enable_thinking false closes an empty one
# (as Qwen3's does); past turns show their reasoning; tools, calls and results in the template's own format
TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}Functions you may call:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}<|im_start|>user
{{ m.content }}<|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{% if m.reasoning_content %}<think>
{{ m.reasoning_content }}
</think>

{% endif %}{{ m.content }}
{%- for call in m.tool_calls %}
<tool_call>
{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>tool
<tool_response id={{ m.tool_call_id | tojson }}>
{{ m.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}
{%- endif %}"""
ASK = [{"role": "user", "content": "What is 2 + 3? Think first."}]
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add <two> numbers & return the sum",
                                           "parameters": ADD}}]
HISTORY = [{"role": "system", "content": "Be brief."}, *ASK,
           {"role": "assistant", "content": "", "reasoning_content": "Adding is a tool's job.",
            "tool_calls": [{"id": "call_1", "type": "function",
                            "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
# the tiny model would think for ever: a grammar writes a short thought, the closing tag and an answer
THOUGHT = {"guided_grammar": 'start: /[a-z ]{1,30}/ "</think>" "\\n\\n" /[A-Za-z ]{1,20}/'}
GREEDY = {"temperature": 0}
SEEDED = {"temperature": 0.8, "seed": 9}


@pytest.fixture(scope="module")
def thinking_path(tmp_path_factory):
    from tensorfold_core.plugins import registry

    path = tmp_path_factory.mktemp("thinking") / "thinking-llama"
    shutil.copytree(registry().shipped("tiny-llama").path, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}, indent=1))
    return path


@pytest.fixture(scope="module")
def thinking(thinking_path):
    from tensorfold_core.loading import load_host
    from tensorfold_core.options import ServeOptions
    from tensorfold_core.server import start_in_thread

    host = load_host(str(thinking_path), ServeOptions(parallel=4, context=512, dtype="float32",
                                                      drafter="tiny-llama-drafter", model_name="thinking"),
                     timed=False)
    assert host.drafter is not None
    server = start_in_thread(host)
    yield server
    server.stop()
    host.close()


@pytest.fixture(scope="module")
def client(thinking):
    return openai.OpenAI(base_url=thinking.url + "/v1", api_key="unused", max_retries=0)


def chat(client, draft=True, extra=None, **fields):
    return client.chat.completions.create(model="thinking", messages=fields.pop("messages", ASK),
                                          max_tokens=fields.pop("max_tokens", 48),
                                          extra_body={"draft": draft, "return_token_ids": True, **(extra or {})},
                                          **fields)


def tokenize(server, body: dict) -> list[int]:
    response = httpx.post(server.url + "/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def test_tools_calls_and_results_render_as_transformers_apply_chat_template_renders_them(thinking, thinking_path):
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(thinking_path))
    history = [dict(m) for m in HISTORY]  # transformers' convention: a call's arguments as an object
    history[2] = {**history[2], "tool_calls": [{**history[2]["tool_calls"][0], "function": {
        "name": "add", "arguments": {"a": 2, "b": 3}}}]}
    for kwargs in ({}, {"enable_thinking": False}):
        expected = reference.apply_chat_template(history, tools=TOOLS, add_generation_prompt=True, tokenize=False,
                                                 **kwargs)
        assert "<two> numbers & return" in expected and 'id="call_1"' in expected
        ours = tokenize(thinking, {"messages": HISTORY, "tools": TOOLS, "chat_template_kwargs": kwargs})
        assert ours == reference.encode(expected, add_special_tokens=False)


def test_chat_template_kwargs_reach_the_template(thinking):
    on = thinking.host.tokenizer.decode(tokenize(thinking, {"messages": ASK}), skip_special_tokens=False)
    off = thinking.host.tokenizer.decode(tokenize(thinking, {"messages": ASK, "chat_template_kwargs": {
        "enable_thinking": False}}), skip_special_tokens=False)
    assert on.endswith("<|im_start|>assistant\n<think>\n") and off.endswith("assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_reasoning_is_split_off_and_the_reply_equals_its_serial_reply_side_by_side(client, sampling):
    serial = chat(client, draft=False, extra=THOUGHT, **sampling)
    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(lambda _: chat(client, extra=THOUGHT, **sampling), range(3)))
    for reply in replies:
        assert reply.choices[0].token_ids == serial.choices[0].token_ids
    message = replies[0].choices[0].message
    thought, answer = message.model_extra["reasoning_content"], message.content
    text = thinking_text(client, replies[0].choices[0].token_ids)
    assert text == f"{thought}</think>\n\n{answer}" and thought and answer and "</think>" not in answer
    assert replies[0].choices[0].finish_reason == "stop"
    assert sum(r.usage.model_extra["tensorfold"]["drafted"] for r in replies) > 0


def test_streamed_reasoning_arrives_in_delta_reasoning_content_and_joins_to_the_whole(client):
    whole = chat(client, extra=THOUGHT, **SEEDED).choices[0].message
    chunks = client.chat.completions.create(model="thinking", messages=ASK, max_tokens=48, stream=True,
                                            extra_body=THOUGHT, **SEEDED)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == \
        whole.model_extra["reasoning_content"]
    assert "".join(d.content or "" for d in deltas) == whole.content


def test_with_thinking_off_the_whole_reply_is_content(client):
    reply = chat(client, max_tokens=12, extra={"chat_template_kwargs": {"enable_thinking": False}}, **GREEDY)
    message = reply.choices[0].message
    assert "reasoning_content" not in (message.model_extra or {})
    assert message.content == thinking_text(client, reply.choices[0].token_ids)


def test_a_thinking_reply_may_end_in_a_tool_call_read_into_tool_calls(client):
    grammar = ('start: /[a-z ]{1,20}/ "</think>\\n\\n<tool_call>\\n" call "\\n</tool_call>"\ncall: %json '
               + json.dumps({"type": "object", "required": ["name", "arguments"], "additionalProperties": False,
                             "properties": {"name": {"const": "add"}, "arguments": {
                                 "type": "object", "additionalProperties": False, "required": ["a", "b"],
                                 "properties": {"a": {"enum": [2]}, "b": {"enum": [3]}}}},
                             "x-guidance": {"whitespace_flexible": False}}))
    for draft in (True, False):
        reply = chat(client, draft=draft, tools=TOOLS, extra={"guided_grammar": grammar}, **SEEDED).choices[0]
        assert reply.finish_reason == "tool_calls" and reply.message.content is None
        assert reply.message.model_extra["reasoning_content"]
        assert [(c.function.name, json.loads(c.function.arguments)) for c in reply.message.tool_calls] == \
            [("add", {"a": 2, "b": 3})]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_forced_call_follows_free_reasoning_and_with_thinking_off_comes_at_once(client, sampling):
    named = {"type": "function", "function": {"name": "add"}}
    for kwargs in ({}, {"enable_thinking": False}):
        extra = {"chat_template_kwargs": kwargs}
        serial = chat(client, draft=False, tools=TOOLS, tool_choice=named, extra=extra, **sampling).choices[0]
        reply = chat(client, tools=TOOLS, tool_choice=named, extra=extra, **sampling).choices[0]
        assert reply.token_ids == serial.token_ids
        text = thinking_text(client, reply.token_ids)
        if kwargs:  # the prompt closed the block: no reasoning, the call at once
            assert reply.finish_reason == "tool_calls" and text.startswith("<tool_call>\n")
            assert "reasoning_content" not in reply.message.model_extra
        else:  # the prompt opened the block: the tiny model reasons on, and its reasoning is read as such
            assert reply.message.model_extra["reasoning_content"] == text.split("</think>")[0]


def thinking_text(client, ids: list[int]) -> str:
    response = httpx.post(str(client.base_url).removesuffix("/v1/") + "/detokenize", json={"tokens": ids})
    return response.json()["prompt"]
