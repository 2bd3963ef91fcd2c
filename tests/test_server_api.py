"""The OpenAI-compatible API over a real host on a tiny random llama: shapes, fields and errors."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

CHAT = [{"role": "user", "content": "Hello world! The quick brown fox"}]
PROMPT = "def add(a, b):\n"


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(served):
    return served.host.model_id


def test_a_chat_completion_returns_text_finish_reason_and_usage(served, client, model):
    reply = client.chat.completions.create(model=model, messages=CHAT, max_tokens=12, temperature=0)
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.model == model
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    usage = reply.usage
    assert usage.prompt_tokens == len(served.host.tokenizer.encode_chat(CHAT))
    assert 1 <= usage.completion_tokens <= 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0
    assert usage.model_extra["tensorfold"]["rounds"] >= 1
    assert set(usage.model_extra["tensorfold"]) >= {"rounds", "drafted", "accepted"}


def test_a_streamed_chat_completion_joins_to_the_non_streamed_reply(client, model):
    whole = client.chat.completions.create(model=model, messages=CHAT, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=16, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] \
        == [whole.choices[0].finish_reason]
    assert all(c.usage is None for c in chunks)


def test_completions_read_a_text_prompt_and_its_token_ids_alike(served, client, model):
    ids = served.host.tokenizer.encode(PROMPT)
    by_text = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0)
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=16, temperature=0)
    by_batch_of_one = client.completions.create(model=model, prompt=[ids], max_tokens=16, temperature=0)
    assert by_text.object == "text_completion"
    assert by_text.usage.prompt_tokens == len(ids)
    assert by_text.choices[0].text == by_ids.choices[0].text == by_batch_of_one.choices[0].text


def test_a_streamed_completion_joins_to_the_non_streamed_text(client, model):
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_return_token_ids_are_the_ids_whose_decode_is_the_text(served, client, model):
    decode = served.host.tokenizer.decode
    extra = {"return_token_ids": True}
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=24, temperature=0,
                                          extra_body=extra)
    ids = chat.choices[0].token_ids
    assert ids and decode(ids) == chat.choices[0].message.content
    assert len(ids) == chat.usage.completion_tokens
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=24, temperature=0,
                                                 stream=True, extra_body=extra))
    streamed = [t for c in chunks for t in (c.choices[0].model_extra.get("token_ids") or [])]
    assert streamed == ids
    done = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, extra_body=extra)
    assert decode(done.choices[0].token_ids) == done.choices[0].text


def test_without_return_token_ids_no_token_ids_are_sent(client, model):
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
    assert "token_ids" not in reply.choices[0].model_extra


def test_include_usage_adds_a_last_chunk_with_no_choices_and_the_usage(client, model):
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens >= 1
    assert last.usage.model_extra["tensorfold"]["rounds"] >= 1
    assert all(c.usage is None for c in chunks[:-1])
    completion_chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                                       stream=True, stream_options={"include_usage": True}))
    assert completion_chunks[-1].choices == [] and completion_chunks[-1].usage.prompt_tokens >= 1


def test_max_tokens_ends_the_reply_with_finish_reason_length(client, model):
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 5
    chat = client.chat.completions.create(model=model, messages=CHAT, max_completion_tokens=3, temperature=0)
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 3


def test_without_max_tokens_a_reply_may_run_to_the_end_of_the_context(served, client, model):
    ids = [5] * (served.host.context - 4)
    reply = client.completions.create(model=model, prompt=ids, temperature=0)
    assert reply.usage.completion_tokens <= 4
    assert reply.usage.total_tokens <= served.host.context


def test_a_prompt_past_the_context_is_a_400_context_length_exceeded(served, client, model):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=model, prompt=[5] * (served.host.context + 10), max_tokens=4)
    assert caught.value.code == "context_length_exceeded" and caught.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x " * 2000}])
    assert caught.value.code == "context_length_exceeded" and caught.value.param == "messages"


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_malformed_json_is_a_400_with_an_openai_error_body(served):
    response = httpx.post(served.url + "/v1/chat/completions", content=b'{"messages": [',
                          headers={"Content-Type": "application/json"})
    assert _error(response, 400)["type"] == "invalid_request_error"


def test_a_bad_parameter_is_a_400_that_names_it(served):
    body = {"messages": CHAT, "temperature": -1}
    error = _error(httpx.post(served.url + "/v1/chat/completions", json=body), 400)
    assert error["param"] == "temperature"
    error = _error(httpx.post(served.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 0}), 400)
    assert error["param"] == "max_tokens"
    error = _error(httpx.post(served.url + "/v1/chat/completions", json={"model": "x"}), 400)
    assert error["param"] == "messages"


def test_unsupported_fields_are_refused_not_ignored(served):
    url = served.url + "/v1/completions"
    for field, value in (("echo", True), ("suffix", "x")):
        assert _error(httpx.post(url, json={"prompt": PROMPT, field: value}), 400)["param"] == field
    batch = {"prompt": ["a", "b"], "max_tokens": 2}
    assert _error(httpx.post(served.url + "/v1/completions", json=batch), 400)["param"] == "prompt"
    outside = {"prompt": [10 ** 6], "max_tokens": 2}
    assert _error(httpx.post(served.url + "/v1/completions", json=outside), 400)["param"] == "prompt"


def test_an_unknown_model_is_a_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=2)
    assert caught.value.code == "model_not_found"


def test_a_request_without_a_model_is_served_by_the_served_model(served):
    response = httpx.post(served.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
    assert response.status_code == 200 and response.json()["model"] == served.host.model_id


def test_an_unknown_route_is_a_404_with_an_openai_error_body(served):
    _error(httpx.get(served.url + "/v1/nothing-here"), 404)


def test_health_models_and_capabilities_describe_the_server(served, client, model):
    health = httpx.get(served.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    models = client.models.list()
    assert [m.id for m in models.data] == [model]
    assert models.data[0].model_extra["max_model_len"] == served.host.context
    assert client.models.retrieve(model).id == model
    capabilities = httpx.get(served.url + "/v1/capabilities").json()
    # a model served from a dir is named by its path: only a key holder sees the whole of it
    assert capabilities["model"].rsplit("/")[-1] == model.rsplit("/")[-1]
    assert capabilities["context"] == served.host.context


def test_serve_on_port_zero_tells_its_ready_callback_the_bound_port(served, capfd):
    from tensorfold_core.server import serve

    ready = threading.Event()
    handle = {}

    def on_ready(server):
        handle["server"] = server
        ready.set()

    thread = threading.Thread(target=serve, args=(served.host, "127.0.0.1", 0),
                              kwargs={"ready_callback": on_ready, "log_level": "warning"}, daemon=True)
    thread.start()
    assert ready.wait(60)
    server = handle["server"]
    try:
        assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}"
        assert httpx.get(server.url + "/health").json()["status"] == "ok"
    finally:
        server.stop()
        thread.join(30)
    assert server.url in capfd.readouterr().err


def test_a_chats_next_turn_reports_the_cached_tokens_it_resumed(client, model):
    messages = [{"role": "user", "content": "def fib(n):"}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "and again"}]
    second = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


def test_health_shows_the_memory_budget_held_bytes_and_kept_states(served):
    health = httpx.get(served.url + "/health").json()
    memory = health["memory"]
    assert memory["budget_bytes"] > 0 and memory["held_bytes"] <= memory["budget_bytes"]
    assert "kept_states" in memory["prompt_cache"] and "queued" in health


def test_capabilities_show_the_live_memory_ledger_and_the_queue(served):
    caps = httpx.get(served.url + "/v1/capabilities").json()
    memory = caps["memory"]
    assert 0 <= memory["held_bytes"] <= memory["budget_bytes"]
    assert sum(memory["held_by_kind"].values()) == memory["held_bytes"]
    assert {"held_by_kind", "prompt_cache", "budget_bytes"} <= set(caps["memory"]) and caps["queued"] == 0


def test_the_server_types_against_one_host_interface_which_the_engine_host_gives(served):
    from tensorfold_core.server.served import ServedHost

    assert isinstance(served.host, ServedHost)
