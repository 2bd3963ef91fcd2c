"""A hold as a pass of its own: timed costs by blocks and depth, moved toward settled holds, and the holds a round
keeps for them; the guards switched by a drafter's facts."""

from __future__ import annotations

import dataclasses

import pytest

from tensorfold_core import hookimpl
from tensorfold_core.checkpoint import Checkpoint
from tensorfold_core.errors import DrafterError
from tensorfold_core.hold_costs import HoldCosts
from tensorfold_core.lanes.grants import Held
from tensorfold_core.lanes.aside import FIRST_GAP
from tensorfold_core.lanes.guards import Ask, DraftPlanner, Verified
from tensorfold_core.lanes.holds import HoldOffer, keep_holds
from tensorfold_core.lanes.pricing import Costs
from tensorfold_core.loading import load_model, start_drafter
from tensorfold_core.plugins import Registry, new_plugin_manager
from tensorfold_core.protocols import DrafterFacts
from tensorfold_core.specs import DrafterKind
from tensorfold_core.testing import tiny_llama_checkpoint

TIMED = {(1, 1): 4.0, (1, 4): 10.0, (2, 1): 8.0, (2, 4): 20.0, (4, 1): 12.0, (4, 4): 32.0, (8, 1): 22.0,
         (8, 4): 64.0, (16, 1): 48.0, (16, 2): 88.0}
PRICED = DrafterFacts(chances=True, slack=1, hold_rows=32, hold_costs=True)


def unit_round(rows: int) -> float:
    return 10.0 + rows


# ---- the timed passes ----

def test_a_holds_price_is_its_timed_pass_and_reads_along_lines_between_and_past_them():
    costs = HoldCosts(TIMED)
    assert costs.ms(4, 1) == 12.0 and costs.ms(4, 4) == 32.0
    assert costs.ms(4, 2) == pytest.approx(12.0 + 20.0 / 3)  # between two timed depths
    assert costs.ms(6, 1) == pytest.approx(17.0)  # between 4 and 8 blocks
    assert costs.ms(32, 1) == pytest.approx(48.0 + 26.0 * 2)  # past 16 blocks, along 8-16's line
    assert costs.ms(0, 3) == 0.0 and HoldCosts().ms(4, 4) == 0.0  # no blocks, or nothing timed


def test_a_settled_hold_at_a_timed_count_moves_that_counts_passes_a_tenth_of_the_way_toward_its_own_time():
    costs = HoldCosts(TIMED)
    costs.settle(4, 1, 24.0)  # twice its price
    assert costs.ms(4, 1) == pytest.approx(12.0 + (24.0 - 12.0) / 10)
    assert costs.ms(4, 4) == pytest.approx(32.0 * 1.1)  # the count's other depth by the same share
    assert {k: v for k, v in costs.points().items() if k[0] != 4} == {k: v for k, v in TIMED.items() if k[0] != 4}


def test_a_settled_hold_between_two_timed_counts_moves_both_by_their_weight():
    costs = HoldCosts(TIMED)
    costs.settle(6, 1, 34.0)  # priced 17: twice it
    points = costs.points()
    assert points[4, 1] == pytest.approx(12.0 * 1.05) and points[8, 1] == pytest.approx(22.0 * 1.05)
    assert points[2, 1] == TIMED[2, 1] and points[16, 1] == TIMED[16, 1]


def test_a_hold_that_took_no_time_or_an_untimed_table_teaches_nothing():
    costs = HoldCosts(TIMED)
    costs.settle(4, 1, 0.0)
    assert costs.points() == TIMED
    empty = HoldCosts()
    empty.settle(4, 1, 12.0)
    assert not empty.timed


# ---- which holds a round keeps ----

def test_a_round_keeps_a_hold_only_where_its_drafts_pay_for_their_rows_and_the_pass():
    # plain: 1 token in 11 ms; a 1-draft hold landing 0.9 for 12 ms + a 2 ms pass pays, for a 20 ms pass it doesn't
    offer = [HoldOffer(1, 0.9)]
    assert keep_holds(offer, unit_round, 1, 1.0, lambda b, d: 2.0) == [True]
    assert keep_holds(offer, unit_round, 1, 1.0, lambda b, d: 20.0) == [False]


def test_a_shared_round_keeps_holds_most_expected_drafts_a_row_first_and_the_pass_is_paid_once():
    # plain: 4 tokens in 14 ms; alone neither 1-draft hold pays a 3 ms pass, the two together do; a third of little
    # worth a row does not
    offers = [HoldOffer(1, 0.8), HoldOffer(1, 0.9), None, HoldOffer(4, 0.1)]
    assert keep_holds(offers[:1], unit_round, 4, 4.0, lambda b, d: 3.0) == [False]
    assert keep_holds(offers[1:2], unit_round, 4, 4.0, lambda b, d: 3.0) == [False]
    assert keep_holds(offers, unit_round, 4, 4.0, lambda b, d: 3.0) == [True, True, False, False]


def test_a_probe_is_kept_whatever_its_pass_costs():
    offers = [HoldOffer(1, 0.01, kept=True), HoldOffer(1, 0.01)]
    assert keep_holds(offers, unit_round, 2, 2.0, lambda b, d: 100.0) == [True, False]


# ---- through the planner ----

class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def lone_holds(pass_ms: float, confidence: float, facts: DrafterFacts = PRICED, rounds: int = 12) -> list[int]:
    """A timed planner's holds for a lone stream whose drafts each land with `confidence`: rounds of 10 ms and 1 ms a
    row, holds of `pass_ms`."""
    clock = Clock()
    planner, depths = DraftPlanner(clock=clock), []
    for _ in range(rounds):
        depth = planner.plan([Ask(0, 15, 100)], facts=facts, hold_ms=lambda blocks, d: pass_ms)[0]
        depths.append(depth)
        clock.now += pass_ms / 1000.0 if depth else 0.0
        planner.proposed()
        chances = [confidence ** (k + 1) for k in range(depth)]
        got = planner.grant([Held(depth, chances) if depth else None], [depth])[0]
        clock.now += (10.0 + 1 + got) / 1000.0
        planner.observe([Verified(got, got, got + 1)])
    return depths


def test_a_timed_planner_keeps_a_granted_hold_only_while_it_pays_for_its_pass():
    dear = lone_holds(50.0, 0.5)
    # the first round is not priced (no round was timed: the line is in units of a plain round), then not even a
    # stretch's first hold is kept: the stream stands aside
    assert dear[0] == 2 and dear[1:] == [0] * 11
    assert all(lone_holds(2.0, 0.5))  # a cheap pass: it keeps holding
    assert all(lone_holds(50.0, 0.5, dataclasses.replace(PRICED, hold_costs=False)))  # unpriced: only rows cost


def test_a_hold_that_stops_paying_stands_its_stream_aside_and_its_probe_keeps_its_hold():
    holds = lone_holds(50.0, 0.5, rounds=FIRST_GAP + 3)
    assert holds[1:FIRST_GAP + 1] == [0] * FIRST_GAP and holds[FIRST_GAP + 1] == PRICED.slack  # 64 aside, a probe


def test_an_untimed_planner_never_prices_a_hold():
    planner = DraftPlanner(timed=False)
    assert planner.plan([Ask(0, 15, 100)], facts=PRICED, hold_ms=lambda b, d: 1e9) == [2]


# ---- the guards, switched by the facts ----

def test_the_shared_guard_runs_shared_rounds_only_where_the_facts_switch_it_on():
    asks = [Ask(0, 15, 100), Ask(1, 15, 100)]
    on, off = DraftPlanner(clock=Clock()), DraftPlanner(clock=Clock())
    assert on.plan(asks, facts=PRICED) == [0, 0]  # the guard starts a band plain, to measure it
    assert off.plan(asks, facts=dataclasses.replace(PRICED, shared_guard=False)) == [2, 2]


def test_the_lone_guard_runs_a_lone_stream_only_where_the_facts_switch_it_on():
    for lone_guard, depth in ((True, 0), (False, 2)):
        planner = DraftPlanner(clock=Clock())
        planner.lone.drafted = lambda stream, band: False  # the lone guard's verdict: plain
        assert planner.plan([Ask(0, 15, 100)], facts=dataclasses.replace(PRICED, lone_guard=lone_guard)) == [depth]


# ---- admission ----

class SaysPriced:
    """A drafter whose facts price its hold but which has no `hold_ms`."""

    name, facts = "says-priced", PRICED
    catch_up = propose = release = slot_bytes_for = kept_bytes = shed_kept = close = chances = \
        staticmethod(lambda *a: 0)


class SaysPricedPlugin:
    @hookimpl
    def tensorfold_drafters(self):
        return [DrafterKind(name="says-priced", matches=lambda ckpt: True, admit=lambda *a: None,
                            start=lambda *a: SaysPriced())]


def test_a_drafter_whose_facts_price_its_hold_without_a_hold_ms_method_is_refused_at_start(tmp_path_factory):
    target = tiny_llama_checkpoint(tmp_path_factory.mktemp("priced-target"), seed=3)
    path = tiny_llama_checkpoint(tmp_path_factory.mktemp("says-priced"), seed=4)
    pm = new_plugin_manager(entry_points=False)
    pm.register(SaysPricedPlugin(), name="says-priced")
    with pytest.raises(DrafterError, match="its facts say its hold is priced, but its SaysPriced has no hold_ms"):
        start_drafter(str(path), load_model(str(target))[0], Checkpoint.open(path).tokenizer(), registry=Registry(pm))


def test_eight_streams_rounds_timed_at_one_width_keep_holds_only_where_a_primed_line_prices_their_rows():
    """Plain shared rounds of 8 rows say nothing of a row's cost: the prior's (a tenth of a round a row) cuts every
    hold, where forwards timed at start (40 rows about the cost of 8, as on a GPU) keep them."""
    from tensorfold_core.lanes.guards import SharedGuard

    asks, facts = [Ask(i, 15, 100) for i in range(8)], dataclasses.replace(PRICED, shared_guard=False)
    held = {}
    for primed in (False, True):
        planner = DraftPlanner(clock=Clock())
        line = planner.shared_costs.setdefault(SharedGuard.band(8), Costs())
        if primed:
            line.prime({8: 18.0, 40: 22.0})
        for _ in range(20):
            line.observe_round(8, 20.0)
        held[primed] = planner.plan(asks, facts=facts, hold_ms=lambda blocks, depth: 3.0)
    assert held[False] == [0] * 8 and all(held[True])
