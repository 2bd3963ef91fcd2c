"""Big bodies are parsed and big replies rendered off the event loop, and answer exactly as small ones do."""

from __future__ import annotations

import json
import re
import threading

import httpx
import pytest
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse

from tensorfold_core.server import bodies
from tensorfold_core.server.schemas import (ChatChoice, ChatCompletion, ChatMessageOut, Completion, CompletionChoice,
                                            Usage)

PROMPT = "def add(a, b):\n"
JSON = {"Content-Type": "application/json"}


def _padded(raw: bytes) -> bytes:
    """The same document past INLINE_BYTES: JSON allows any whitespace before it."""
    return b" " * (bodies.INLINE_BYTES + 1) + raw


class HeldUntilHealth:
    """Replaces a function with one that waits, once called, until /health has answered: on the event loop that
    wait would keep /health from answering at all."""

    def __init__(self, monkeypatch, owner, name: str):
        self.real = getattr(owner, name)
        self.called, self.released = threading.Event(), threading.Event()
        monkeypatch.setattr(owner, name, self._held)

    def _held(self, *args, **kwargs):
        self.called.set()
        self.released.wait(60)
        return self.real(*args, **kwargs)

    def health_meanwhile(self, served, send) -> tuple[httpx.Response, httpx.Response]:
        """Run `send()` on a thread; once it reaches the held function, ask /health; then let it go on."""
        replies: list[httpx.Response] = []
        sender = threading.Thread(target=lambda: replies.append(send()))
        sender.start()
        try:
            assert self.called.wait(60), "the held function was never called"
            health = httpx.get(served.url + "/health", timeout=20)
        finally:
            self.released.set()
            sender.join(120)
        return health, replies[0]


def test_health_answers_while_a_large_body_is_being_parsed(served, monkeypatch):
    held = HeldUntilHealth(monkeypatch, bodies, "validated")
    raw = _padded(b'{"prompt": "%s", "max_tokens": 2, "temperature": 0}' % PROMPT.strip().encode())
    health, reply = held.health_meanwhile(
        served, lambda: httpx.post(served.url + "/v1/completions", content=raw, headers=JSON, timeout=120))
    assert health.status_code == 200  # answered while the parse was held
    assert reply.status_code == 200, reply.text


def test_a_small_body_is_parsed_where_it_arrives(served, monkeypatch):
    held = []
    monkeypatch.setattr(bodies, "validated", lambda *args: held.append(args))
    reply = httpx.post(served.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=60)
    assert reply.status_code == 200 and held == []


def test_health_answers_while_a_reply_with_logprobs_is_being_rendered(served, monkeypatch):
    held = HeldUntilHealth(monkeypatch, bodies, "rendered")
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 2}
    health, reply = held.health_meanwhile(
        served, lambda: httpx.post(served.url + "/v1/completions", json=body, timeout=120))
    assert health.status_code == 200
    assert reply.status_code == 200 and len(reply.json()["choices"][0]["logprobs"]["tokens"]) == 4


@pytest.mark.parametrize("path, body", [
    ("/tokenize", {"prompt": PROMPT}),
    ("/tokenize", {"messages": [{"role": "user", "content": PROMPT}]}),
])
def test_health_answers_while_tokenize_is_tokenizing(served, monkeypatch, path, body):
    held = HeldUntilHealth(monkeypatch, served.host.tokenizer, "encode" if "prompt" in body else "encode_chat")
    health, reply = held.health_meanwhile(served, lambda: httpx.post(served.url + path, json=body, timeout=120))
    assert health.status_code == 200
    assert reply.status_code == 200 and reply.json()["count"] == len(reply.json()["tokens"]) > 0


@pytest.mark.parametrize("path, raw", [
    ("/v1/completions", b'{"prompt": "x", "max_tokens": "10"}'),
    ("/v1/completions", b'{"prompt": [true, false], "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": "ab\\ud800c", "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": "raw \xed\xa0\x80 bytes", "max_tokens": 2}'),
    ("/v1/completions", b'{"prompt": "x", "no_such_field": 1}'),
    ("/v1/completions", b'{"prompt": "x", "temperature": 1e400}'),
    ("/v1/completions", b'{"prompt": "x", '),
    ("/v1/completions", b'[]'),
    ("/v1/completions", b'{"prompt": "\xff"}'),
    ("/v1/completions", b'{"model": "nope", "prompt": "x"}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "image"}]}]}'),
    ("/v1/chat/completions", b'{"messages": []}'),
    ("/tokenize", b'{"prompt": "x", "messages": [{"role": "user", "content": "x"}]}'),
    ("/detokenize", b'{"tokens": [1, "2"]}'),
])
def test_a_bad_body_past_the_inline_size_is_refused_as_a_small_one_is(served, path, raw):
    small = httpx.post(served.url + path, content=raw, headers=JSON, timeout=60)
    large = httpx.post(served.url + path, content=_padded(raw), headers=JSON, timeout=60)
    assert 400 <= small.status_code < 500, small.text
    assert large.status_code == small.status_code
    refusal = {k: v for k, v in small.json()["error"].items() if k != "message"}
    assert {k: v for k, v in large.json()["error"].items() if k != "message"} == refusal


def test_a_large_body_without_a_json_content_type_is_refused_as_a_small_one_is(served):
    raw = b'{"prompt": "x", "max_tokens": 2}'
    for body in (raw, _padded(raw)):
        reply = httpx.post(served.url + "/v1/completions", content=body, headers={"Content-Type": "text/plain"})
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_content_type"


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "return_token_ids": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "temperature": 0,
                              "return_token_ids": True}),
    ("/tokenize", {"prompt": PROMPT}),
])
def test_a_valid_body_past_the_inline_size_is_served_as_a_small_one_is(served, path, body):
    raw = json.dumps(body).encode()
    small = httpx.post(served.url + path, content=raw, headers=JSON, timeout=60)
    large = httpx.post(served.url + path, content=_padded(raw), headers=JSON, timeout=60)
    assert small.status_code == large.status_code == 200, large.text
    if "choices" in small.json():
        assert small.json()["choices"][0]["token_ids"] == large.json()["choices"][0]["token_ids"]
    else:
        assert small.json() == large.json()


def test_a_long_list_of_bad_token_ids_is_refused_at_its_first_bad_entry(served):
    raw = b'{"prompt": [%s], "max_tokens": 2}' % b", ".join([b"true"] * 100_000)
    error = httpx.post(served.url + "/v1/completions", content=raw, headers=JSON, timeout=60).json()["error"]
    assert error["param"] == "prompt"
    more = re.search(r"and (\d+) more problem", error["message"])
    assert more is None or int(more.group(1)) < 10  # one per form of the prompt, not one per id


def test_a_rendered_reply_is_the_json_fastapi_writes_for_the_model():
    logprobs = {"tokens": ["a", "\u00e9"], "token_logprobs": [-0.5, -1e-9], "top_logprobs": [{"a": -0.5}, {}],
                "text_offset": [0, 1]}
    replies = [
        Completion(id="cmpl-1", created=1, model="m", usage=Usage(prompt_tokens=2, completion_tokens=2,
                                                                   total_tokens=4, tensorfold={"drafted": 1}),
                   choices=[CompletionChoice(text="a\u00e9", finish_reason="length", logprobs=logprobs)]),
        ChatCompletion(id="chatcmpl-1", created=1, model="m", usage=Usage(),
                       choices=[ChatChoice(message=ChatMessageOut(content=None, reasoning_content="r"),
                                           finish_reason="stop", token_ids=[1, 2])]),
    ]
    for reply in replies:
        assert bodies.rendered(reply).body == JSONResponse(jsonable_encoder(reply)).body
