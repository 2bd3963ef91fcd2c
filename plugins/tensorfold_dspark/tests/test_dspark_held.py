"""held_on_target: a hold launched and not waited on, its drafts read by the verify's window on the device and by the
host only with the verify's logits; replies equal to plain decoding, a grammar's stream given host drafts."""

from __future__ import annotations

import dataclasses

import llguidance
import mlx.core as mx
import pytest

from tensorfold_core.lanes.constraints import Grammar
from tensorfold_core.lanes.types import GenerationRequest
from tensorfold_core.loading import start_drafter
from tensorfold_core.protocols import HELD_ENV, DraftAsk, HeldDrafts, held_on_target_wanted
from tensorfold_core.testing import drive, serial
from tensorfold_core.errors import DrafterError

from dspark_helpers import NAME, plain_replies, requests, shipped_pair


@pytest.fixture(scope="module")
def held_pair():
    with shipped_pair(**{HELD_ENV: "1"}) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def plain(held_pair):
    return plain_replies(held_pair[0])


def test_the_knob_switches_the_facts_on_and_a_hold_gives_drafts_that_stay_on_the_device(held_pair):
    target, drafter = held_pair
    assert drafter.facts.held_on_target and drafter.holds.points()  # the warm-up still timed its holds, waited
    cache = target.model.new_cache(64)
    prompt = target.tokenizer.encode("def fib(n):\n    return")
    target.model.forward([cache], [prompt], [0])
    target.model.keep(cache, len(prompt))
    (drafts,) = drafter.propose([DraftAsk(90, prompt + [prompt[-1]], 4, limit=64, cache=cache)])
    try:
        assert isinstance(drafts, HeldDrafts) and len(drafts) == 4 and len(drafts[:2]) == 2
        host = drafts.read()
        assert len(host) == 4 and host[:2] == drafts[:2].read() and drafts.ids.tolist() == host
        assert drafter.chances(90) is not None and len(drafter.chances(90)) == 4  # settled by the read
    finally:
        drafter.release(90)


@pytest.mark.parametrize("parallel", [1, 4])
@pytest.mark.parametrize("seeded", [False, True])
def test_replies_with_held_drafts_equal_plain_decoding(held_pair, plain, parallel, seeded):
    target, drafter = held_pair
    before = drafter.stats["held"]
    # an untimed engine: its holds do not hang on the guards' clocks, so every run holds
    assert drive(target.model, drafter, requests(target, seeded), parallel, timed=False) == plain[seeded]
    assert drafter.stats["held"] > before  # the holds ran held, not read back before their verify


def test_a_stream_with_a_grammar_reads_its_held_drafts_back_and_its_reply_equals_plain(held_pair):
    target, drafter = held_pair
    guidance = llguidance.LLTokenizer(target.tokenizer.backend.to_str(), eos_token=sorted(target.tokenizer.eos_ids))
    grammar = Grammar(llguidance.LLMatcher.grammar_from_regex("[0-9a-z_ ]{8,40}"), guidance)
    request = GenerationRequest(prompt_ids=target.tokenizer.encode("def fib(n):\n    # "), max_tokens=24,
                                grammar=grammar)
    before = drafter.stats["held"]
    reply = drive(target.model, drafter, [request], 1, timed=False)[0]
    assert drafter.stats["held"] > before
    assert reply == drive(target.model, None, [serial(request)], 1, timed=False)[0]


def test_with_the_facts_off_a_hold_is_waited_on_and_its_drafts_come_back_as_host_ids(held_pair):
    target, drafter = held_pair
    cache = target.model.new_cache(64)
    prompt = target.tokenizer.encode("import os\nimport")
    target.model.forward([cache], [prompt], [0])
    target.model.keep(cache, len(prompt))
    saved, drafter.facts = drafter.facts, dataclasses.replace(drafter.facts, held_on_target=False)
    try:
        (drafts,) = drafter.propose([DraftAsk(91, prompt + [prompt[-1]], 3, limit=64, cache=cache)])
        assert isinstance(drafts, list) and all(isinstance(t, int) for t in drafts)
    finally:
        drafter.facts = saved
        drafter.release(91)


@pytest.mark.parametrize("seeded", [False, True])
def test_replies_with_held_drafts_on_a_timed_engine_equal_plain_decoding(held_pair, plain, seeded):
    target, drafter = held_pair
    assert drive(target.model, drafter, requests(target, seeded), 4) == plain[seeded]


def test_held_drafts_are_off_on_the_cpu_by_default_and_the_knob_decides_either_way(monkeypatch):
    monkeypatch.delenv(HELD_ENV, raising=False)
    assert not held_on_target_wanted()  # this suite runs on the CPU; a GPU holds by default
    monkeypatch.setenv(HELD_ENV, "1")
    assert held_on_target_wanted()
    monkeypatch.setenv(HELD_ENV, "0")
    assert not held_on_target_wanted()
    monkeypatch.setenv(HELD_ENV, "yes")
    with pytest.raises(DrafterError, match="TENSORFOLD_HELD_ON_TARGET='yes'"):
        held_on_target_wanted()


class CountedEvals:
    """mlx.core with its `eval` calls counted: what a module under test waits on."""

    def __init__(self):
        self.evals = 0

    def __getattr__(self, name):
        return getattr(mx, name)

    def eval(self, *arrays):
        self.evals += 1
        return mx.eval(*arrays)


@pytest.mark.parametrize("lazy", [False, True])
def test_a_lazy_catch_up_leaves_a_prompts_absorb_to_the_hold_where_holds_stay_on_the_device(held_pair, monkeypatch,
                                                                                             lazy):
    import tensorfold_dspark.drafter as drafter_module

    target, drafter = held_pair
    monkeypatch.setattr(drafter, "lazy_catch_up", lazy)
    counted = CountedEvals()
    monkeypatch.setattr(drafter_module, "mx", counted)
    cache = target.model.new_cache(96)
    # a prompt no kept lane shares a prefix with, longer than a round's rows: caught up before the chain
    text = f"{'lazy' if lazy else 'eager'} = True\nsquares = [x * x for x in range(10)]\nprint(sum(squares))\n"
    prompt = target.tokenizer.encode(text)
    assert len(prompt) > drafter_module.CATCH_UP_ROWS
    target.model.forward([cache], [prompt], [0])
    target.model.keep(cache, len(prompt))
    ask = DraftAsk(92, prompt + [prompt[-1]], 4, limit=96, cache=cache)
    try:
        assert drafter.catch_up([ask]) == len(prompt)
        assert counted.evals == (0 if lazy else 1)  # lazy: nothing waited on until the hold's own async eval
        (drafts,) = drafter.propose([ask])
        assert isinstance(drafts, HeldDrafts) and len(drafts.read()) == 4
    finally:
        drafter.release(92)


@pytest.mark.parametrize("seeded", [False, True])
def test_replies_with_a_lazy_catch_up_equal_plain_decoding(held_pair, plain, monkeypatch, seeded):
    from tensorfold_dspark.drafter import LAZY_CATCH_UP_ENV

    target, drafter = held_pair
    monkeypatch.setenv(LAZY_CATCH_UP_ENV, "1")
    lazy = start_drafter(NAME, target.model, target.tokenizer)
    try:
        assert lazy.lazy_catch_up and not drafter.lazy_catch_up  # read at start; off by default
        assert drive(target.model, lazy, requests(target, seeded), 4) == plain[seeded]
    finally:
        lazy.close()
