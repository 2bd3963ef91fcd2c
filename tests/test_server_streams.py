"""Replies over HTTP are exact: repeats, seeds, stop strings, neighbours and disconnects change no token."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

PROMPTS = ["def add(a, b):\n", "class Point:\n", "import os\n", "Hello world! The quick"]
IDS = {"return_token_ids": True}


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(served):
    return served.host.model_id


def complete(client, model, prompt, **fields):
    extra = dict(IDS, **fields.pop("extra", {}))
    reply = client.completions.create(model=model, prompt=prompt, extra_body=extra, **fields)
    return reply.choices[0]


def test_greedy_replies_repeat_exactly(client, model):
    first = complete(client, model, PROMPTS[0], max_tokens=32, temperature=0)
    again = complete(client, model, PROMPTS[0], max_tokens=32, temperature=0)
    assert first.token_ids == again.token_ids and first.text == again.text


def test_seeded_sampled_replies_repeat_exactly_and_differ_across_seeds(client, model):
    def sampled(seed):
        return complete(client, model, PROMPTS[1], max_tokens=24, temperature=1.0, seed=seed).token_ids

    assert sampled(1) == sampled(1)
    assert any(sampled(seed) != sampled(1) for seed in (2, 3, 4, 5))


def test_drafting_off_gives_the_same_reply(client, model):
    drafted = complete(client, model, PROMPTS[2], max_tokens=24, temperature=0)
    serial = complete(client, model, PROMPTS[2], max_tokens=24, temperature=0, extra={"draft": False})
    assert drafted.token_ids == serial.token_ids


def _spanning_stop(tokenizer, ids) -> tuple[str, int]:
    """A stop string that straddles a token boundary in the reply's first half and first occurs there;
    returns it and where it starts."""
    text = tokenizer.decode(ids)
    ends = sorted({len(tokenizer.decode(ids[:k])) for k in range(1, len(ids) // 2)})
    for end in ends:
        stop = text[end - 1:end + 1]
        if end >= 2 and len(stop) == 2 and "\ufffd" not in stop and text.find(stop) == end - 1:
            return stop, end - 1
    pytest.skip("the greedy reply has no boundary whose two characters occur only there")


def test_a_stop_string_spanning_tokens_cuts_the_text_before_it_and_finishes_with_stop(served, client, model):
    whole = complete(client, model, PROMPTS[3], max_tokens=48, temperature=0)
    stop, at = _spanning_stop(served.host.tokenizer, whole.token_ids)
    cut = complete(client, model, PROMPTS[3], max_tokens=48, temperature=0, stop=[stop])
    assert cut.text == whole.text[:at] and cut.finish_reason == "stop"
    assert whole.token_ids[:len(cut.token_ids)] == cut.token_ids
    chunks = list(client.completions.create(model=model, prompt=PROMPTS[3], max_tokens=48, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.text[:at]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_stop_string_in_a_chat_reply_ends_the_stream_early(served, client, model):
    messages = [{"role": "user", "content": "The quick brown fox"}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0,
                                           extra_body=IDS).choices[0]
    stop, at = _spanning_stop(served.host.tokenizer, whole.token_ids)
    cut = client.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0,
                                         stop=stop, stream_options={"include_usage": True}, stream=True)
    chunks = list(cut)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.message.content[:at]
    assert chunks[-1].usage.completion_tokens < 40  # the stream left at the stop string, not at max_tokens


def _requests():
    """Greedy and seeded, chat and completions: (kind, fields) pairs with token ids returned."""
    out = []
    for i, prompt in enumerate(PROMPTS):
        sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 0.9, "seed": 100 + i, "top_p": 0.95}
        out.append(("completions", dict(prompt=prompt, max_tokens=20 + 3 * i, **sampling)))
        out.append(("chat", dict(messages=[{"role": "user", "content": prompt}], max_tokens=18 + i, **sampling)))
    return out


def _run(client, model, kind, fields) -> list[int]:
    if kind == "completions":
        return client.completions.create(model=model, extra_body=IDS, **fields).choices[0].token_ids
    return client.chat.completions.create(model=model, extra_body=IDS, **fields).choices[0].token_ids


def test_concurrent_requests_equal_their_solo_runs(client, model):
    requests = _requests()
    solo = [_run(client, model, kind, fields) for kind, fields in requests]
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(lambda r: _run(client, model, *r), requests))
    assert together == solo


def _wait_for(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.01)


@pytest.fixture
def cancels(served):
    """Records the tickets the server cancels (the host's own cancel still runs)."""
    host, seen = served.host, []
    original = host.cancel

    def spy(ticket):
        seen.append(ticket)
        original(ticket)

    host.cancel = spy
    yield seen
    host.cancel = original


def _long_greedy_prompt(client, model, max_tokens) -> list[int]:
    """A prompt whose greedy reply runs to max_tokens (no eos), so only a cancel can end it early."""
    for prompt in PROMPTS + ["for i in range(10):\n", "print(", "x = 1\n"]:
        if complete(client, model, prompt, max_tokens=max_tokens, temperature=0).finish_reason == "length":
            return prompt
    pytest.skip("every candidate prompt reaches eos before max_tokens on this checkpoint")


def test_a_stream_whose_client_disconnects_is_cancelled_and_its_neighbour_is_undisturbed(served, client, model,
                                                                                         cancels):
    long = served.host.context - 64
    doomed_prompt = _long_greedy_prompt(client, model, long)
    neighbour = dict(prompt=PROMPTS[1], max_tokens=64, temperature=0.8, seed=7)
    solo = complete(client, model, **neighbour).token_ids
    cancels.clear()

    result = {}

    def run_neighbour():
        chunks = client.completions.create(model=model, stream=True, extra_body=IDS, **neighbour)
        result["ids"] = [t for c in chunks for t in (c.choices[0].model_extra.get("token_ids") or [])]

    body = {"prompt": doomed_prompt, "max_tokens": long, "temperature": 0, "stream": True}
    with httpx.Client(base_url=served.url) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            seen = [line for line, _ in zip(lines, range(4)) if line.startswith("data:")]
            thread = threading.Thread(target=run_neighbour)
            thread.start()
            assert seen and json.loads(seen[0][5:])["choices"][0]["finish_reason"] is None
        # leaving the block closed the connection mid-stream
    _wait_for(lambda: cancels, "the server to cancel the abandoned stream")
    thread.join()
    assert len(cancels) == 1
    assert result["ids"] == solo
    _wait_for(lambda: served.host.health()["streams"] == 0, "the engine to drop the cancelled stream")


def test_a_non_streaming_client_that_disconnects_while_waiting_is_cancelled(served, client, model, cancels):
    long = served.host.context - 64
    prompt = _long_greedy_prompt(client, model, long)
    cancels.clear()
    body = json.dumps({"prompt": prompt, "max_tokens": long, "temperature": 0}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {served.url[7:]}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((served.url[7:].rsplit(":", 1)[0], served.port)) as sock:
        sock.sendall(head + body)
        _wait_for(lambda: served.host.health()["streams"] >= 1, "the request to be admitted")
    _wait_for(lambda: cancels, "the server to cancel the abandoned request")
    assert len(cancels) == 1
    _wait_for(lambda: served.host.health()["streams"] == 0, "the engine to drop the cancelled stream")


@pytest.fixture
def failing(served):
    """Makes the host fail the next streams after `after` token events, as an engine error would."""
    from tensorfold_core.errors import TensorfoldError
    from tensorfold_core.lanes.types import ErrorEvent, TokenEvent

    host, original = served.host, served.host.submit
    settings = {"after": 0}

    def submit(request, on_event, prompt_param="prompt"):
        state = {"tokens": 0, "failed": False}

        def relay(event):
            if state["failed"]:
                return
            if isinstance(event, TokenEvent) and state["tokens"] >= settings["after"]:
                state["failed"] = True  # the host's stream runs on to its max_tokens, unseen
                return on_event(ErrorEvent(TensorfoldError("injected: the round failed")))
            state["tokens"] += isinstance(event, TokenEvent)
            on_event(event)

        return original(request, relay, prompt_param)

    host.submit = submit
    yield settings
    host.submit = original


def test_an_engine_error_before_the_first_token_is_a_500_logged_once_under_its_request_id(served, failing, caplog):
    for stream in (False, True):
        caplog.clear()
        body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "stream": stream}
        response = httpx.post(served.url + "/v1/completions", json=body)
        assert response.status_code == 500
        message, rid = response.json()["error"]["message"], response.headers["x-request-id"]
        assert "injected" not in message and rid in message  # the cause is the log's, never the client's
        logged = [r.getMessage() for r in caplog.records if "injected" in r.getMessage()]
        assert len(logged) == 1 and rid in logged[0]


def test_an_engine_error_mid_stream_ends_the_stream_with_an_error_event(served, failing):
    failing["after"] = 2
    # undrafted: one token an event, so a third event always comes (a timed planner's drafts could land 16 in two)
    body = {"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0, "stream": True, "draft": False}
    with httpx.stream("POST", served.url + "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "internal_error"
    assert "injected" not in events[-2]
    assert all("choices" in json.loads(e) for e in events[:-2])
