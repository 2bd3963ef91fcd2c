"""Figures that tell the truth: usage counts the ids a reply returns, however its end came."""

from __future__ import annotations

import httpx
import pytest

PROMPT = "def add(a, b):\n"


def _complete(served, **fields) -> dict:
    body = {"prompt": PROMPT, "return_token_ids": True, **fields}
    response = httpx.post(served.url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_completion_tokens_are_the_ids_returned_when_an_eos_ends_the_reply(served):
    for seed in range(1, 33):
        reply = _complete(served, temperature=1.0, seed=seed, max_tokens=200)
        if reply["choices"][0]["finish_reason"] == "stop":
            break
    else:
        pytest.skip("no seed drew the eos within the context")
    usage, ids = reply["usage"], reply["choices"][0]["token_ids"]
    assert usage["completion_tokens"] == len(ids)  # the eos is not returned, so it is not counted
    assert usage["total_tokens"] == usage["prompt_tokens"] + len(ids)


def test_completion_tokens_are_the_ids_returned_when_a_stop_string_ends_the_reply(served):
    whole = _complete(served, temperature=1.0, seed=1, max_tokens=60)
    text = whole["choices"][0]["text"]
    stop = next((text[i:i + n] for n in range(2, 9) for i in range(len(text) // 3, len(text) - n)
                 if text.find(text[i:i + n]) == i and "\ufffd" not in text[i:i + n]), None)
    if stop is None:
        pytest.skip("the reply has no short string that first occurs past its first third")
    cut = _complete(served, temperature=1.0, seed=1, max_tokens=60, stop=[stop])
    ids = cut["choices"][0]["token_ids"]
    assert cut["choices"][0]["finish_reason"] == "stop" and len(ids) < len(whole["choices"][0]["token_ids"])
    assert cut["usage"]["completion_tokens"] == len(ids)
