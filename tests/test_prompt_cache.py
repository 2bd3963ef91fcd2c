"""Kept prompt states: a repeated or continued prompt resumes from its longest kept prefix, token for token."""

from __future__ import annotations

import pytest

from tensorfold_core.lanes.types import GenerationRequest
from tensorfold_core.memory.ledger import GIB
from tensorfold_core.protocols import HELD_ENV
from tensorfold_core.sampling import SamplingParams

from test_memory import Driver, make_host, pair  # noqa: F401  (the pair fixture)

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20] * 5


def serve(host, prompt, sampled=False, draft=True, max_tokens=24):
    driver = Driver(host)
    sampling = SamplingParams(temperature=0.9, seed=3) if sampled else SamplingParams()
    ticket = driver.submit(GenerationRequest(prompt_ids=prompt, max_tokens=max_tokens, sampling=sampling,
                                             draft=draft))
    driver.finish()
    return driver.tokens(ticket), driver.done(ticket).usage["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("drafted", [False, True])
def test_a_repeated_prompt_resumes_and_equals_the_fresh_run(pair, sampled, drafted):
    fresh, cached = serve(make_host(pair, GIB, drafted=drafted), PROMPT, sampled)
    assert cached == 0
    host = make_host(pair, GIB, drafted=drafted, prompt_cache_bytes=GIB // 8)
    first, _ = serve(host, PROMPT, sampled)
    again, cached = serve(host, PROMPT, sampled)
    assert first == fresh and again == fresh
    assert cached == len(PROMPT) - 1  # all but the token whose logits draw the first reply token


@pytest.mark.parametrize("sampled", [False, True])
def test_a_conversations_next_turn_resumes_the_previous_prompt_and_reply(pair, sampled):
    host = make_host(pair, GIB, prompt_cache_bytes=GIB // 8)
    reply, _ = serve(host, PROMPT, sampled)
    next_turn = PROMPT + reply + [30, 31, 32, 33]
    resumed, cached = serve(host, next_turn, sampled)
    fresh, _ = serve(make_host(pair, GIB), next_turn, sampled)
    assert resumed == fresh
    assert cached >= len(PROMPT) + len(reply) - 1


@pytest.mark.parametrize("sampled", [False, True])
def test_with_the_drafters_chains_held_on_the_device_resumed_prompts_equal_fresh_ones(pair, sampled, monkeypatch):
    monkeypatch.setenv(HELD_ENV, "1")  # a GPU's default: each chain read by the verify on the device
    host = make_host(pair, GIB, prompt_cache_bytes=GIB // 8)
    assert host.drafter.facts.held_on_target
    fresh, _ = serve(make_host(pair, GIB), PROMPT, sampled)
    first, _ = serve(host, PROMPT, sampled)
    again, cached = serve(host, PROMPT, sampled)
    assert first == again == fresh and cached == len(PROMPT) - 1
    next_turn = PROMPT + first + [30, 31, 32, 33]
    resumed, cached = serve(host, next_turn, sampled)
    assert resumed == serve(make_host(pair, GIB), next_turn, sampled)[0]
    assert cached >= len(PROMPT) + len(first) - 1
    assert host.drafter.stats["proposals"] > 0  # chains were held and read, not only copies verified


def test_the_least_recently_used_state_gives_way_first(pair):
    host = make_host(pair, GIB, prompt_cache_bytes=GIB // 8)
    serve(host, PROMPT)
    one_state = host.admission.prompt_cache.held()
    host.admission.prompt_cache.cap_bytes = int(one_state * 2.5)
    serve(host, [40 + i for i in range(50)])
    serve(host, PROMPT)  # a hit: PROMPT's state is now the most recently used
    serve(host, [100 + i for i in range(50)])
    kept = [entry.tokens[:3] for entry in host.admission.prompt_cache.entries.values()]
    assert (40, 41, 42) not in kept
    assert tuple(PROMPT[:3]) in kept and (100, 101, 102) in kept
    assert host.ledger.by_kind()["kept_state"] == host.admission.prompt_cache.held()
