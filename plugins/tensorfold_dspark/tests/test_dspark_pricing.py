"""The shipped pair with its hold priced as a pass of its own: timed holds, copies first, guards from the facts, and
replies equal to plain decoding on a timed engine."""

from __future__ import annotations

import inspect
import textwrap

import pytest

from tensorfold_core.hold_costs import HOLD_BLOCKS, HoldCosts
from tensorfold_core.lanes.types import GenerationRequest
from tensorfold_core.protocols import DraftAsk
from tensorfold_core.testing import drive, serial
from tensorfold_dspark.drafter import HOLD_CATCH_UP, HOLD_ROWS

from dspark_helpers import requests


def test_the_drafter_times_hold_passes_of_1_to_16_blocks_after_warm_up_and_its_facts_price_them(pair):
    _, drafter = pair
    facts = drafter.facts
    assert facts.chances and facts.hold_costs and facts.shared_guard and facts.lone_guard
    points = drafter.holds.points()
    assert sorted({blocks for blocks, _ in points}) == list(HOLD_BLOCKS)
    assert all(blocks * depth <= HOLD_ROWS and ms > 0 for (blocks, depth), ms in points.items())
    assert drafter.hold_ms(1, 1) == points[1, 1]
    assert facts.catch_up == HOLD_CATCH_UP


def test_a_long_prompts_first_hold_catches_up_only_its_last_rows_and_the_reply_stays_exact(pair):
    target, drafter = pair
    prompt = target.tokenizer.encode(inspect.getsource(textwrap))[:700]
    request = GenerationRequest(prompt_ids=prompt, max_tokens=16)
    absorbed = drafter.stats["absorbed"]
    reply = drive(target.model, drafter, [request], 1, timed=False)[0]
    assert reply == drive(target.model, None, [serial(request)], 1, timed=False)[0]
    # the lane holds the prompt's last rows and the reply's, with a cut: not the 700 rows it lacked
    assert 0 < drafter.stats["absorbed"] - absorbed <= HOLD_CATCH_UP + 16


def test_a_settled_hold_moves_its_price_a_tenth_of_the_way_toward_its_own_time(pair):
    target, drafter = pair
    saved = HoldCosts(drafter.holds.points())
    try:
        before, others = drafter.hold_ms(1, 1), {k: v for k, v in drafter.holds.points().items() if k[0] != 1}
        drafter.propose([DraftAsk(900, target.tokenizer.encode("def fib(n):\n"), 1, limit=64)])
        blocks, depth, ms = drafter.last_hold
        assert (blocks, depth) == (1, 1)
        assert drafter.hold_ms(1, 1) == pytest.approx(before + (ms - before) / 10)
        assert {k: v for k, v in drafter.holds.points().items() if k[0] != 1} == others
    finally:
        drafter.release(900)
        drafter.holds = saved


def test_a_stream_with_a_copy_ahead_verifies_the_copy_and_asks_no_hold_that_round(pair, plain):
    target, drafter = pair
    asked, rounds = [], []
    propose = drafter.propose

    def recorded(asks):
        asked[-1].update(a.stream_id for a in asks)
        return propose(asks)

    def seen(engine):
        rounds.append([(t.stream.id, t.source) for t in engine._asked])
        asked.append(set())
    drafter.propose = recorded
    try:
        asked.append(set())
        replies = drive(target.model, drafter, requests(target, False), 4, timed=False, each_round=seen)
    finally:
        del drafter.propose
    assert replies == plain[False]
    copies = [(sid, r) for r, turns in enumerate(rounds) for sid, source in turns if source == "copy"]
    assert copies and any(source == "dspark" for turns in rounds for _, source in turns)
    assert all(sid not in asked[r] for sid, r in copies)


@pytest.mark.parametrize("parallel", [1, 4, 8])
@pytest.mark.parametrize("seeded", [False, True])
def test_replies_with_priced_holds_on_a_timed_engine_equal_plain_decoding(pair, plain, parallel, seeded):
    target, drafter = pair
    assert drive(target.model, drafter, requests(target, seeded), parallel) == plain[seeded]


def test_a_hold_that_cannot_pay_for_its_pass_is_not_run_and_the_replies_stay_exact(pair, plain):
    target, drafter = pair
    saved, holds = drafter.holds, []
    drafter.holds = HoldCosts({(blocks, 1): 1e6 for blocks in HOLD_BLOCKS})  # a pass no draft can pay for
    drafter.stats["holds"] = 0
    try:
        reqs = requests(target, False)[:1]
        assert drive(target.model, drafter, reqs, 1, each_round=lambda e: holds.append(drafter.stats["holds"]))[0] \
            == plain[False][0]
    finally:
        drafter.holds = saved
    # a fresh engine's first drafted round holds (no round is timed yet to weigh a pass against); then the stream
    # stands aside (64 rounds before a probe)
    assert len(holds) >= 10 and holds[-1] <= 1
