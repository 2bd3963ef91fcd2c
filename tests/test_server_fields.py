"""logprobs, penalties, logit_bias, n and best_of over HTTP on the shipped drafted pair: each reply equals its
`"draft": false` reply token for token, greedy and seeded, side by side with other requests."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

CHAT = [{"role": "user", "content": "import os\nimport sys\n"}]
PROMPT = "def add(a, b):\n    return a + b\n\ndef"
GREEDY = {"temperature": 0}
SEEDED = {"temperature": 0.8, "top_p": 0.95, "seed": 11}


@pytest.fixture(scope="module")
def client(shipped):
    return openai.OpenAI(base_url=shipped.url + "/v1", api_key="unused", max_retries=0)


def chat(client, draft=True, extra=None, **fields):
    return client.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=fields.pop("max_tokens", 40),
                                          extra_body={"draft": draft, "return_token_ids": True, **(extra or {})},
                                          **fields)


def complete(client, draft=True, extra=None, **fields):
    return client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=fields.pop("max_tokens", 40),
                                     extra_body={"draft": draft, "return_token_ids": True, **(extra or {})},
                                     **fields)


def ids(reply):
    return [choice.token_ids for choice in reply.choices]


def drafted(reply) -> int:
    return reply.usage.model_extra["tensorfold"]["drafted"]


CASES = {
    "penalised": dict(frequency_penalty=0.6, presence_penalty=0.4, extra={"repetition_penalty": 1.3}),
    "biased": dict(logit_bias={"96": 4.0, "11": -100}),
    "logprobs": dict(logprobs=True, top_logprobs=5),
    "n=3": dict(n=3),
}


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_penalised_biased_logprob_and_n_chats_equal_their_serial_replies_side_by_side(client, sampling):
    serial = {name: chat(client, draft=False, **sampling, **dict(case)) for name, case in CASES.items()}
    with ThreadPoolExecutor(len(CASES)) as pool:
        replies = dict(zip(CASES, pool.map(lambda case: chat(client, **sampling, **dict(case)), CASES.values())))
    for name in CASES:
        assert ids(replies[name]) == ids(serial[name]), name
        assert drafted(serial[name]) == 0
    assert sum(drafted(r) for r in replies.values()) > 0  # the pair really drafted
    logprobs = [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
                for e in replies["logprobs"].choices[0].logprobs.content]
    assert logprobs == [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
                        for e in serial["logprobs"].choices[0].logprobs.content]


def test_a_penalty_or_a_bias_changes_the_reply_and_a_neutral_one_does_not(client):
    plain = ids(chat(client, **GREEDY))
    assert ids(chat(client, **GREEDY, frequency_penalty=0.0, logit_bias={})) == plain
    assert ids(chat(client, **GREEDY, frequency_penalty=2.0, extra={"repetition_penalty": 2.0})) != plain
    banned = plain[0][0]
    assert banned not in ids(chat(client, **GREEDY, logit_bias={str(banned): -100}))[0]


def test_chat_logprobs_hold_the_drawn_token_and_its_row_s_most_likely_tokens(client):
    reply = chat(client, **GREEDY, logprobs=True, top_logprobs=3, max_tokens=8)
    content = reply.choices[0].logprobs.content
    assert len(content) == len(reply.choices[0].token_ids) == 8
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].token == entry.token  # greedy draws the most likely token
        assert entry.top_logprobs[0].logprob == entry.logprob
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    assert "".join(e.token for e in content) == reply.choices[0].message.content
    assert chat(client, **GREEDY, max_tokens=4).choices[0].logprobs is None


def test_streamed_chat_logprobs_join_to_the_whole_reply_s(client):
    whole = chat(client, **SEEDED, logprobs=True, top_logprobs=2, max_tokens=24).choices[0].logprobs.content
    chunks = list(client.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=24, stream=True,
                                                 logprobs=True, top_logprobs=2, **SEEDED))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole]


def test_completion_logprobs_come_in_the_completions_shape(client):
    reply = complete(client, **GREEDY, logprobs=2, max_tokens=6).choices[0]
    logprobs = reply.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert "".join(logprobs.tokens) == reply.text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]
    assert all(len(top) <= 2 and math.isclose(max(top.values()), lp) for top, lp
               in zip(logprobs.top_logprobs, logprobs.token_logprobs))


def test_n_choices_are_keyed_by_seed_plus_index_and_count_the_prompt_once(client):
    many = chat(client, **SEEDED, n=3, max_tokens=20)
    assert [c.index for c in many.choices] == [0, 1, 2]
    for i, choice in enumerate(many.choices):
        alone = chat(client, **{**SEEDED, "seed": SEEDED["seed"] + i}, max_tokens=20)
        assert choice.token_ids == alone.choices[0].token_ids, f"choice {i}"
    one = chat(client, **SEEDED, max_tokens=20)
    assert many.usage.prompt_tokens == one.usage.prompt_tokens
    assert many.usage.completion_tokens == sum(len(c.token_ids) for c in many.choices)
    assert many.usage.prompt_tokens_details.cached_tokens >= 0


def test_n_streamed_choices_arrive_by_index_and_join_to_the_whole_replies(client):
    whole = chat(client, **SEEDED, n=2, max_tokens=16)
    chunks = list(client.chat.completions.create(model="tiny-llama", messages=CHAT, max_tokens=16, stream=True,
                                                 n=2, stream_options={"include_usage": True}, **SEEDED))
    for i in (0, 1):
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        assert text == whole.choices[i].message.content
        assert sum(1 for c in chunks if c.choices and c.choices[0].index == i and c.choices[0].finish_reason) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_best_of_returns_the_n_choices_with_the_highest_cumulative_logprob(client):
    best = complete(client, **SEEDED, n=2, extra={"best_of": 4}, logprobs=0, max_tokens=12)
    runs = [complete(client, **{**SEEDED, "seed": SEEDED["seed"] + i}, logprobs=0, max_tokens=12).choices[0]
            for i in range(4)]
    ranked = sorted(range(4), key=lambda i: (-sum(runs[i].logprobs.token_logprobs), i))[:2]
    assert [c.text for c in best.choices] == [runs[i].text for i in ranked]
    assert [c.index for c in best.choices] == [0, 1]
    plain = complete(client, draft=False, **SEEDED, n=2, extra={"best_of": 4}, logprobs=0, max_tokens=12)
    assert ids(plain) == ids(best)


@pytest.mark.parametrize("body, param", [
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"96": 101}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"n": 0}, "n"), ({"presence_penalty": 3}, None),
])
def test_out_of_range_fields_are_a_400_naming_the_field(shipped, body, param):
    response = httpx.post(shipped.url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, **body})
    assert response.status_code == 400
    assert param is None or response.json()["error"]["param"] == param


def test_best_of_below_n_or_streamed_is_a_400(shipped):
    for body in ({"n": 3, "best_of": 2}, {"best_of": 3, "stream": True}):
        response = httpx.post(shipped.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == "best_of"
