"""A hold as a pass of its own: timed costs by blocks and depth, moved toward settled holds, and the holds a round
keeps for them; the guards switched by a drafter's facts."""

from __future__ import annotations

import dataclasses

import pytest

from tensorfold_core.lanes.grants import Held
from tensorfold_core.lanes.guards import FIRST_GAP, Ask, DraftPlanner, Verified
from tensorfold_core.lanes.holds import HoldCosts, HoldOffer, keep_holds
from tensorfold_core.protocols import DrafterFacts

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


def test_a_probe_or_a_stretchs_first_hold_is_kept_whatever_its_pass_costs():
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
    assert dear[0] == 2 and dear[1:] == [0] * 11  # the stretch's first hold, then the stream stands aside
    assert all(lone_holds(2.0, 0.5))  # a cheap pass: it keeps holding
    assert all(lone_holds(50.0, 0.5, dataclasses.replace(PRICED, hold_costs=False)))  # unpriced: only rows cost


def test_a_stream_whose_hold_does_not_pay_probes_after_the_gap_and_the_probe_keeps_its_hold():
    holds = lone_holds(50.0, 0.5, rounds=FIRST_GAP + 3)
    assert holds[FIRST_GAP + 1] == PRICED.slack  # the first round's hold, then 64 aside, then the probe


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
