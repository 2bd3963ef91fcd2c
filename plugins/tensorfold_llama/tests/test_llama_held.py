"""held_on_target for the llama drafter: a chain launched and not waited on, read by the verify's window on the
device and by the host only with the verify's logits; replies equal to plain decoding, a grammar's stream given host
drafts, a chain never read trimmed away by the next sync."""

from __future__ import annotations

import dataclasses

import llguidance
import pytest

from tensorfold_core.lanes.constraints import Grammar
from tensorfold_core.lanes.types import GenerationRequest, SamplingParams
from tensorfold_core.loading import load_target, start_drafter
from tensorfold_core.options import ServeOptions
from tensorfold_core.protocols import HELD_ENV, DraftAsk, HeldDrafts
from tensorfold_core.testing import drive, serial

TARGET, NAME = "tiny-llama", "tiny-llama-drafter"
PROMPTS = ["def fib(n):\n", "import os\nimport sys\n", "class Stack:\n    def __init__(self):\n",
           "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2,", "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"]


def start(held: bool):
    with pytest.MonkeyPatch.context() as env:
        env.setenv(HELD_ENV, "1" if held else "0")
        target = load_target(TARGET, ServeOptions(dtype="float32"))
        return target, start_drafter(NAME, target.model, target.tokenizer)


@pytest.fixture(scope="module")
def pair():
    target, drafter = start(held=True)
    yield target, drafter
    drafter.close()


@pytest.fixture(scope="module")
def read_back():
    target, drafter = start(held=False)
    yield drafter
    drafter.close()


def requests(target, seeded: bool, tokens: int = 40) -> list[GenerationRequest]:
    return [GenerationRequest(prompt_ids=target.tokenizer.encode(p), max_tokens=tokens,
                              sampling=SamplingParams(temperature=0.8, seed=5 + i) if seeded else SamplingParams())
            for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def plain(pair):
    target = pair[0]
    return {seeded: drive(target.model, None, [serial(r) for r in requests(target, seeded)], 8, timed=False)
            for seeded in (False, True)}


def counting_holds(drafter, monkeypatch) -> list[bool]:
    """Whether each draft list a propose call gives is HeldDrafts."""
    held, propose = [], drafter.propose
    monkeypatch.setattr(drafter, "propose", lambda asks: (out := propose(asks),
                                                          held.extend(isinstance(d, HeldDrafts) for d in out))[0])
    return held


def test_the_knob_holds_a_chain_on_the_device_and_its_drafts_are_those_read_back(pair, read_back):
    target, drafter = pair
    assert drafter.facts.held_on_target and not read_back.facts.held_on_target
    prompt = target.tokenizer.encode("def fib(n):\n    return")
    (drafts,) = drafter.propose([DraftAsk(90, prompt, 6, limit=64)])
    (host,) = read_back.propose([DraftAsk(90, prompt, 6, limit=64)])
    try:
        assert isinstance(drafts, HeldDrafts) and len(drafts) == 6 and isinstance(host, list)
        assert drafts.ids.tolist() == drafts.read() == host  # no eos in this chain: read back, nothing was cut
        assert drafts[:2].read() == host[:2]
        assert drafter.slots[90].tokens == prompt + host[:-1]  # the read told the slot which drafts it fed
    finally:
        drafter.release(90)
        read_back.release(90)


def test_a_held_chain_never_read_is_trimmed_by_the_next_sync_and_the_next_chain_is_a_fresh_drafters(pair, read_back):
    target, drafter = pair
    prompt = target.tokenizer.encode("class Stack:\n    def __init__(self):\n")
    longer = prompt + target.tokenizer.encode("        self.items")
    drafter.propose([DraftAsk(91, prompt, 5, limit=96)])  # never read: its verify was cut short
    try:
        (drafts,) = drafter.propose([DraftAsk(91, longer, 5, limit=96)])
        (fresh,) = read_back.propose([DraftAsk(92, longer, 5, limit=96)])
        assert drafts.read() == fresh
    finally:
        drafter.release(91)
        read_back.release(92)


@pytest.mark.parametrize("parallel", [1, 4])
@pytest.mark.parametrize("seeded", [False, True])
def test_replies_with_held_chains_equal_plain_decoding(pair, plain, parallel, seeded, monkeypatch):
    target, drafter = pair
    held = counting_holds(drafter, monkeypatch)
    # an untimed engine: the guards' clocks stop no stretch, so the drafter drafts in every round it may
    assert drive(target.model, drafter, requests(target, seeded), parallel, timed=False) == plain[seeded]
    assert held and all(held)


@pytest.mark.parametrize("seeded", [False, True])
def test_replies_with_held_chains_on_a_timed_engine_equal_plain_decoding(pair, plain, seeded):
    target, drafter = pair
    assert drive(target.model, drafter, requests(target, seeded), 4) == plain[seeded]


def test_a_stream_with_a_grammar_reads_its_held_chain_back_and_its_reply_equals_plain(pair, monkeypatch):
    target, drafter = pair
    guidance = llguidance.LLTokenizer(target.tokenizer.backend.to_str(), eos_token=sorted(target.tokenizer.eos_ids))
    grammar = Grammar(llguidance.LLMatcher.grammar_from_regex("[0-9a-z_ ]{8,40}"), guidance)
    request = GenerationRequest(prompt_ids=target.tokenizer.encode("def fib(n):\n    # "), max_tokens=24,
                                grammar=grammar)
    held = counting_holds(drafter, monkeypatch)
    reply = drive(target.model, drafter, [request], 1, timed=False)[0]
    assert held and all(held)
    assert reply == drive(target.model, None, [serial(request)], 1, timed=False)[0]


def test_with_the_facts_off_the_same_drafter_waits_for_its_chain_and_gives_host_ids(pair):
    target, drafter = pair
    saved, drafter.facts = drafter.facts, dataclasses.replace(drafter.facts, held_on_target=False)
    try:
        (drafts,) = drafter.propose([DraftAsk(93, target.tokenizer.encode("import os\nimport"), 3, limit=64)])
        assert isinstance(drafts, list) and all(isinstance(t, int) for t in drafts)
    finally:
        drafter.facts = saved
        drafter.release(93)
