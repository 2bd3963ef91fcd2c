"""Through the host's prompt cache, a hybrid's kept states resume repeated prompts and next turns like fresh runs."""

from __future__ import annotations

import pytest

from tensorfold_core.checkpoint import Checkpoint
from tensorfold_core.host import Host
from tensorfold_core.lanes.types import DoneEvent, GenerationRequest, TokenEvent
from tensorfold_core.memory.ledger import GIB
from tensorfold_core.options import ServeOptions
from tensorfold_core.sampling import SamplingParams
from tensorfold_lfm2.load import load

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20] * 5


@pytest.fixture(scope="module", params=[False, True], ids=["lfm2", "moe"])
def model(request, checkpoints):
    ckpt = Checkpoint.open(checkpoints("moe" if request.param else "lfm2", moe=request.param))
    return load(ckpt), ckpt.tokenizer()


def serve(host, prompt, sampled=False, max_tokens=20):
    """One request run inline on the host's engine: (token ids, cached prompt tokens)."""
    events = []
    sampling = SamplingParams(temperature=0.9, seed=3) if sampled else SamplingParams()
    host.submit(GenerationRequest(prompt_ids=prompt, max_tokens=max_tokens, sampling=sampling), events.append)
    while not any(isinstance(e, DoneEvent) for e in events):
        host._drain_inbox()
        host._admit()
        host.engine.round()
        assert host.ledger.held() <= host.ledger.budget
    done = next(e for e in events if isinstance(e, DoneEvent))
    tokens = [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids]
    return tokens, done.usage["prompt_tokens_details"]["cached_tokens"]


def make_host(model, prompt_cache_bytes=0):
    options = ServeOptions(parallel=2, memory_gib=1.0, prompt_cache_gib=prompt_cache_bytes / GIB, prefill_chunk=16)
    return Host(*model, options, model_id="m", context=256, row_invariant=True, start=False)


@pytest.mark.parametrize("sampled", [False, True])
def test_a_repeated_prompt_resumes_at_its_last_token_and_equals_the_fresh_run(model, sampled):
    fresh, cached = serve(make_host(model), PROMPT, sampled)
    assert cached == 0
    host = make_host(model, GIB // 8)
    first, _ = serve(host, PROMPT, sampled)
    again, cached = serve(host, PROMPT, sampled)
    assert first == fresh and again == fresh
    assert cached == len(PROMPT) - 1  # admission marks the prompt's last token, where a repeat resumes


def test_a_conversations_next_turn_resumes_the_previous_state_whole_and_equals_the_fresh_run(model):
    host = make_host(model, GIB // 8)
    reply, _ = serve(host, PROMPT)
    next_turn = PROMPT + reply + [30, 31, 32, 33]
    resumed, cached = serve(host, next_turn)
    assert resumed == serve(make_host(model), next_turn)[0]
    assert cached == len(PROMPT) + len(reply) - 1
    assert host.ledger.by_kind()["kept_state"] == host.admission.prompt_cache.held()
