"""The edge: a bounded queue with 429s, deadlines, slow clients cut off, API keys, Host and CORS checks."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import httpx
import openai
import pytest

from tensorfold_core.options import ServeOptions
from tensorfold_core.server import Server

PROMPT = "def add(a, b):\n"


@contextmanager
def server_over(host, bind_host: str = "127.0.0.1", **options):
    """Another real server, with its own options, over an already loaded host."""
    server = Server(host, bind_host, 0, log_level="warning", options=ServeOptions(**options)).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def idle_host(tiny_llama_path):
    """A real host whose engine thread is not started: what is submitted stays queued until the test starts it."""
    from tensorfold_core.host import Host
    from tensorfold_core.loading import load_target

    options = ServeOptions(parallel=1, max_queued=1)
    target = load_target(str(tiny_llama_path), options)
    host = Host(target.model, target.tokenizer, options, model_id="idle", context=target.context(None), start=False)
    yield host
    host.close()


def test_a_request_past_max_queued_is_a_429_with_retry_after(idle_host):
    from tensorfold_core.lanes.types import GenerationRequest

    with server_over(idle_host, parallel=1, max_queued=1) as server:
        for _ in range(2):  # one would decode, one waits: the queue is full
            idle_host.submit(GenerationRequest(prompt_ids=[5, 6, 7], max_tokens=4), lambda event: None)
        response = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert response.status_code == 429 and int(response.headers["retry-after"]) >= 1
        error = response.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "queue_full"
        assert "--max-queued 1" in error["message"]
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="idle", prompt=PROMPT, max_tokens=2)


def test_a_reply_past_its_deadline_ends_as_max_tokens_would(tiny_llama_path):
    from tensorfold_core.host import Host
    from tensorfold_core.loading import load_target

    options = ServeOptions(parallel=1, deadline_s=0.05)
    target = load_target(str(tiny_llama_path), options)
    host = Host(target.model, target.tokenizer, options, model_id="late", context=target.context(None), start=False)
    try:
        with server_over(host, deadline_s=0.05) as server:
            replies = []
            asking = threading.Thread(target=lambda: replies.append(httpx.post(
                server.url + "/v1/completions", json={"prompt": PROMPT, "temperature": 0}, timeout=60)))
            asking.start()
            time.sleep(0.5)  # the request waits in the queue of an engine not yet running, past its deadline
            host._thread.start()
            asking.join(60)
        reply = replies[0].json()
        assert reply["choices"][0]["finish_reason"] == "length" and reply["usage"]["completion_tokens"] == 0
    finally:
        host.close()


def _raw(server: Server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(30)
    return sock


def test_a_client_that_never_finishes_its_headers_is_disconnected(served):
    with server_over(served.host, read_timeout_s=0.3) as server:
        sock = _raw(server)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        assert sock.recv(1024) == b""  # closed by the server, not by our 30 s timeout
        sock.close()


def test_an_idle_keep_alive_connection_is_closed_after_its_answer(served):
    with server_over(served.host, keep_alive_s=0.3, read_timeout_s=120) as server:  # only keep-alive can close it
        sock = _raw(server)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: keep-alive\r\n\r\n")
        answer = b""
        while chunk := sock.recv(4096):  # ends when the server closes the idle connection, not at our 30 s timeout
            answer += chunk
        sock.close()
        assert answer.startswith(b"HTTP/1.1 200") and answer.count(b"HTTP/1.1") == 1


def test_a_body_that_stalls_is_a_408_and_the_connection_closes(served):
    with server_over(served.host, read_timeout_s=0.3) as server:
        sock = _raw(server)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\":")
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
        sock.close()
        assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer


def test_with_an_api_key_every_route_but_health_needs_it(served, monkeypatch):
    with server_over(served.host, api_key="sekret") as server:
        for path in ("/v1/models", "/v1/capabilities", "/openapi.json"):
            response = httpx.get(server.url + path)
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
            assert response.headers["www-authenticate"] == "Bearer"
            wrong = httpx.get(server.url + path, headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401
            assert httpx.get(server.url + path, headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT}).status_code == 401
        assert httpx.get(server.url + "/health").status_code == 200
        assert httpx.head(server.url + "/health").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="sekret", max_retries=0)
        assert client.completions.create(model=served.host.model_id, prompt=PROMPT, max_tokens=2).choices
    monkeypatch.setenv("TENSORFOLD_API_KEY", "from-env")
    with server_over(served.host) as server:
        assert httpx.get(server.url + "/v1/models").status_code == 401
        assert httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer from-env"}).status_code == 200


def test_capabilities_show_absolute_paths_only_to_key_holders(served):
    def absolute(value) -> list[str]:
        if isinstance(value, dict):
            return [p for v in value.values() for p in absolute(v)]
        if isinstance(value, list):
            return [p for v in value for p in absolute(v)]
        return [value] if isinstance(value, str) and value.startswith("/") else []

    assert absolute(served.host.capabilities())  # the checkpoint's dir, at least
    assert not absolute(httpx.get(served.url + "/v1/capabilities").json())
    with server_over(served.host, api_key="k") as server:
        caps = httpx.get(server.url + "/v1/capabilities", headers={"Authorization": "Bearer k"}).json()
        assert absolute(caps)


def test_a_foreign_host_header_is_refused_against_dns_rebinding(served):
    response = httpx.get(served.url + "/v1/models", headers={"Host": "attacker.example:8000"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "host_not_allowed"
    assert httpx.get(served.url + "/v1/models", headers={"Host": f"localhost:{served.port}"}).status_code == 200
    with server_over(served.host, allowed_hosts="api.example") as server:
        assert httpx.get(server.url + "/v1/models", headers={"Host": "api.example"}).status_code == 200
        assert httpx.get(server.url + "/v1/models").status_code == 400


def test_cors_is_off_unless_origins_are_allowed(served):
    origin = {"Origin": "http://app.example"}
    assert "access-control-allow-origin" not in httpx.get(served.url + "/v1/models", headers=origin).headers
    with server_over(served.host, allowed_origins="http://app.example", api_key="k") as server:
        preflight = httpx.options(server.url + "/v1/chat/completions", headers={
            **origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://app.example"
        other = httpx.get(server.url + "/v1/models", headers={"Origin": "http://evil.example",
                                                               "Authorization": "Bearer k"})
        assert "access-control-allow-origin" not in other.headers


def test_serving_beyond_loopback_without_a_key_warns(served, capfd):
    from tensorfold_core.server import serve

    ready, handle = threading.Event(), {}

    def on_ready(server):
        handle["server"] = server
        ready.set()

    thread = threading.Thread(target=serve, args=(served.host, "0.0.0.0", 0),
                              kwargs={"ready_callback": on_ready, "log_level": "warning"}, daemon=True)
    thread.start()
    assert ready.wait(60)
    handle["server"].stop()
    thread.join(30)
    assert "beyond loopback with no API key" in capfd.readouterr().err


def test_every_response_carries_a_request_id_and_a_given_one_is_kept(served):
    assert len(httpx.get(served.url + "/health").headers["x-request-id"]) >= 16
    given = httpx.get(served.url + "/v1/models", headers={"X-Request-Id": "trace-42"})
    assert given.headers["x-request-id"] == "trace-42"


def test_a_wrong_method_is_a_405_with_allow_and_health_answers_head(served):
    response = httpx.get(served.url + "/v1/completions")
    assert response.status_code == 405 and "POST" in response.headers["allow"]
    head = httpx.head(served.url + "/health")
    assert head.status_code == 200 and head.content == b""
