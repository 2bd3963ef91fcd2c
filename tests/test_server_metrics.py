"""/metrics (Prometheus, vLLM's names) and /tokenize, /detokenize (vLLM's shapes) over a real server."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

CHAT = [{"role": "user", "content": "import os\n"}]


@pytest.fixture(scope="module")
def client(shipped):
    return openai.OpenAI(base_url=shipped.url + "/v1", api_key="unused", max_retries=0)


def scrape(server) -> dict:
    """Every sample as {(name, labels...): value}."""
    response = httpx.get(server.url + "/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {(s.name, *sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def test_metrics_count_requests_tokens_latencies_and_drafts_under_vllm_s_names(shipped, client):
    before = scrape(shipped)
    reply = client.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=32, temperature=0)
    client.completions.create(model="tiny-llama", prompt="def f(x):\n", max_tokens=16, temperature=0)
    after = scrape(shipped)

    def grew(key):
        return after.get(key, 0) - before.get(key, 0)

    assert grew(("vllm:request_success_total", ("finished_reason", reply.choices[0].finish_reason))) >= 1
    assert grew(("vllm:prompt_tokens_total",)) >= reply.usage.prompt_tokens
    assert grew(("vllm:generation_tokens_total",)) >= reply.usage.completion_tokens
    assert grew(("vllm:time_to_first_token_seconds_count",)) == 2
    assert grew(("vllm:e2e_request_latency_seconds_count",)) == 2
    assert grew(("vllm:inter_token_latency_seconds_count",)) >= 1
    assert grew(("tensorfold:http_requests_total", ("route", "/v1/chat/completions"), ("status", "200"))) == 1
    drafted = reply.usage.model_extra["tensorfold"]["drafted"]
    assert grew(("vllm:spec_decode_num_draft_tokens_total",)) >= drafted > 0
    accepted = grew(("vllm:spec_decode_num_accepted_tokens_total",))
    per_position = sum(grew(("vllm:spec_decode_num_accepted_tokens_per_pos_total", ("position", str(p))))
                       for p in range(15))
    assert per_position == accepted > 0
    assert grew(("tensorfold:guard_windows_total", ("verdict", "drafted"))) >= 1
    # the same counters by the proposer that gave each window's drafts: they sum to vLLM's, and name real proposers
    for ours, vllms in (("drafted_windows", "num_drafts"), ("draft_tokens", "num_draft_tokens"),
                        ("accepted_draft_tokens", "num_accepted_tokens")):
        by_source = {key[1][1]: grew(key) for key in after if key[0] == f"tensorfold:{ours}_total"}
        assert sum(by_source.values()) == grew((f"vllm:spec_decode_{vllms}_total",)) > 0, ours
        assert set(by_source) <= {"copy", "recall", "grammar", shipped.host.drafter.name}, by_source
    assert ("vllm:num_requests_running",) in after and ("vllm:num_requests_waiting",) in after
    assert after[("tensorfold:ledger_budget_bytes",)] > 0
    assert any(key[0] == "tensorfold:ledger_bytes" for key in after)
    assert ("tensorfold:prompt_cache_hits_total",) in after


def test_a_refused_request_is_counted_by_its_status(shipped):
    before = scrape(shipped)
    httpx.post(shipped.url + "/v1/completions", json={"prompt": "x", "n": 0})
    after = scrape(shipped)
    key = ("tensorfold:http_requests_total", ("route", "/v1/completions"), ("status", "400"))
    assert after[key] - before.get(key, 0) == 1


def test_tokenize_reads_text_or_messages_and_detokenize_gives_the_text_back(shipped):
    tokenizer = shipped.host.tokenizer
    text = "def add(a, b):\n    return a + b\n"
    out = httpx.post(shipped.url + "/tokenize", json={"model": "tiny-llama", "prompt": text}).json()
    assert out["tokens"] == tokenizer.encode(text) and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == shipped.host.context
    chat = httpx.post(shipped.url + "/tokenize", json={"messages": CHAT, "return_token_strs": True}).json()
    assert chat["tokens"] == tokenizer.encode_chat(CHAT)
    assert "".join(chat["token_strs"]) == tokenizer.apply_chat_template(CHAT)
    back = httpx.post(shipped.url + "/detokenize", json={"tokens": out["tokens"]}).json()
    assert back == {"prompt": text}
    assert httpx.post(shipped.url + "/v1/tokenize", json={"prompt": text}).json()["tokens"] == out["tokens"]


def test_tokenize_s_refusals_name_the_field(shipped):
    both = httpx.post(shipped.url + "/tokenize", json={"prompt": "a", "messages": CHAT})
    assert both.status_code == 400 and both.json()["error"]["param"] == "prompt"
    outside = httpx.post(shipped.url + "/detokenize", json={"tokens": [1, 10 ** 6]})
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "tokens"
    wrong = httpx.post(shipped.url + "/tokenize", json={"model": "other", "prompt": "a"})
    assert wrong.status_code == 404
