"""Every bad input is a 4xx naming its field: strict JSON types, unencodable text, unserved fields, huge prompts."""

from __future__ import annotations

import json
import os
import threading

import httpx
import pytest

CHAT = [{"role": "user", "content": "Hello world! The quick brown fox"}]
PROMPT = "def add(a, b):\n"


def _post(served, path: str, raw: str, **headers) -> httpx.Response:
    """POST a body written by hand (JSON the json module would refuse to write: lone surrogates, Infinity)."""
    return httpx.post(served.url + path, content=raw.encode("utf-8", "surrogatepass"),
                      headers={"Content-Type": "application/json", **headers}, timeout=60)


def _refused(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/completions", '{"prompt": "ab\\ud800c", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "\\udc00"], "max_tokens": 2}', "prompt[1]"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud83d"}]}', "messages[0].content"),
    ("/v1/chat/completions", '{"messages": [{"role": "us\\udfffer", "content": "x"}]}', "messages[0].role"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages[0].content[0].text"),
    ("/v1/chat/completions", '{"model": "\\ud800", "messages": [{"role": "user", "content": "x"}]}', "model"),
    ("/v1/completions", '{"prompt": "x", "stop": ["\\udbff"]}', "stop[0]"),
    ("/v1/completions", '{"prompt": "raw \ud800 bytes", "max_tokens": 2}', "prompt"),  # UTF-8 of a surrogate
    ("/tokenize", '{"prompt": "ab\\ud800c"}', "prompt"),
    ("/detokenize", '{"model": "\\udc00", "tokens": [5]}', "model"),
])
def test_a_lone_surrogate_in_any_string_is_a_400_naming_where_it_sits(served, path, raw, param):
    error = _refused(_post(served, path, raw))
    assert error["param"] == param and error["code"] == "invalid_string"


@pytest.mark.parametrize("field, raw", [
    ("stream", '"yes"'), ("draft", '"no"'), ("max_tokens", '"10"'), ("max_tokens", "true"), ("max_tokens", "2.0"),
    ("return_token_ids", "1"), ("temperature", '"0.5"'), ("seed", '"7"'), ("stop", "5"),
])
def test_a_field_of_the_wrong_json_type_is_refused_not_coerced(served, field, raw):
    error = _refused(_post(served, "/v1/completions", f'{{"prompt": "x", "max_tokens": 2, "{field}": {raw}}}'))
    assert error["param"] == field


def test_booleans_are_not_token_ids(served):
    error = _refused(_post(served, "/v1/completions", '{"prompt": [true, false], "max_tokens": 2}'))
    assert error["param"] == "prompt"


@pytest.mark.parametrize("raw", ["1e400", "-1e400", "Infinity", "NaN"])
def test_a_temperature_that_is_not_finite_is_refused(served, raw):
    error = _refused(_post(served, "/v1/completions", f'{{"prompt": "x", "max_tokens": 2, "temperature": {raw}}}'))
    assert error["param"] == "temperature"


def test_a_temperature_below_the_greedy_floor_draws_the_greedy_tokens(served):
    def ids(temperature: str, draft: bool = True) -> list[int]:
        raw = (f'{{"prompt": "{PROMPT.strip()}", "max_tokens": 16, "temperature": {temperature}, '
               f'"return_token_ids": true, "draft": {json.dumps(draft)}}}')
        response = _post(served, "/v1/completions", raw)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["token_ids"]

    greedy = ids("0")
    assert ids("5e-324") == ids("5e-324", draft=False) == ids("1e-6") == greedy


@pytest.mark.parametrize("body", [{"prompt": ""}, {"prompt": []}, {"prompt": [[]]}, {"prompt": [""]}])
def test_an_empty_prompt_is_refused_by_its_type(served, body):
    assert _refused(httpx.post(served.url + "/v1/completions", json={**body, "max_tokens": 2}))["param"] == "prompt"


@pytest.mark.parametrize("field, value", [
    ("functions", [{"name": "f", "parameters": {}}]), ("function_call", "auto"), ("audio", {"voice": "alloy"}),
    ("modalities", ["text", "audio"]), ("prediction", {"type": "content", "content": "x"}),
    ("parallel_tool_calls", True), ("tool_choice", "auto"), ("stream_options", {"include_usage": True}),
    ("no_such_field", 1),
])
def test_a_chat_field_the_server_does_not_serve_is_refused_naming_it(served, field, value):
    body = {"messages": CHAT, "max_tokens": 2, field: value}
    error = _refused(httpx.post(served.url + "/v1/chat/completions", json=body))
    assert error["param"].split("[")[0] == field


def test_served_no_op_fields_are_accepted(served):
    body = {"messages": CHAT, "max_tokens": 2, "modalities": ["text"], "user": "someone",
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", served.url + "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        assert list(response.iter_lines())


def test_a_body_past_the_cap_is_a_413_and_never_read_into_a_prompt(served):
    cap = int(served.options.max_body_mib * (1 << 20))
    body = json.dumps({"prompt": "x", "max_tokens": 2, "user": "y" * cap}).encode()
    error = _refused(httpx.post(served.url + "/v1/completions", content=body,
                                headers={"Content-Type": "application/json"}, timeout=60), 413)
    assert error["code"] == "request_too_large" and f"{cap:,}" in error["message"]

    def chunked():  # no Content-Length: the cap holds while the body arrives
        yield b'{"prompt": "x", "user": "'
        for _ in range(cap // 65536 + 2):
            yield b"y" * 65536
        yield b'"}'

    response = httpx.post(served.url + "/v1/completions", content=chunked(),
                          headers={"Content-Type": "application/json"}, timeout=60)
    assert _refused(response, 413)["code"] == "request_too_large"
    assert httpx.get(served.url + "/health").status_code == 200


def test_text_that_cannot_fit_the_context_is_refused_before_it_is_tokenized(served):
    tokenizer, context = served.host.tokenizer, served.host.context
    text = "ab " * (context * tokenizer._entry_bytes)
    assert tokenizer.fewest_tokens(text) >= context  # provably too long from its bytes alone
    for path, body in (("/v1/completions", {"prompt": text}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]})):
        error = _refused(httpx.post(served.url + path, json={**body, "max_tokens": 2}, timeout=60))
        assert error["code"] == "context_length_exceeded" and "at least" in error["message"]


def test_health_answers_while_a_long_prompt_is_being_tokenized(served):
    # a prompt just under the byte bound is tokenized in full, on a worker thread that lets go of the GIL
    tokenizer, context = served.host.tokenizer, served.host.context
    text = "x" * ((context - 1) * tokenizer._entry_bytes - 1)
    answered = []

    def poll():
        while not done.is_set():
            answered.append(httpx.get(served.url + "/health", timeout=60).status_code)

    done = threading.Event()
    poller = threading.Thread(target=poll)
    poller.start()
    try:
        for _ in range(3):
            httpx.post(served.url + "/v1/completions", json={"prompt": text, "max_tokens": 1}, timeout=120)
    finally:
        done.set()
        poller.join()
    assert answered and set(answered) == {200}


def _resident_mib() -> float:
    with open("/proc/self/status") as status:  # the server runs in this process (the `served` fixture)
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the resident size from /proc")
def test_huge_prompts_leave_the_server_s_memory_where_it_was(served):
    # a 20 MiB text once grew the process to ~3 GiB for good; refused at the door or by its bytes, they cost nothing
    tokenizer, context = served.host.tokenizer, served.host.context
    huge = json.dumps({"prompt": "ab " * (20 << 18), "max_tokens": 2}).encode()
    long_text = "ab " * (context * tokenizer._entry_bytes)

    def hostile_round():
        response = httpx.post(served.url + "/v1/completions", content=huge,
                              headers={"Content-Type": "application/json"}, timeout=60)
        assert response.status_code == 413
        response = httpx.post(served.url + "/v1/completions", json={"prompt": long_text, "max_tokens": 2},
                              timeout=60)
        assert response.status_code == 400

    hostile_round()  # the allocator's first high-water mark
    before = _resident_mib()
    for _ in range(4):
        hostile_round()
    assert _resident_mib() - before < 128
