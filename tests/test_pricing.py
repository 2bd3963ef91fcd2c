"""The depth rule: acceptance per depth, measured costs, and depths with the most expected tokens per ms."""

import itertools
import random

import pytest

from tensorfold_core.lanes.pricing import (PRIOR_ACCEPTANCE, PRIOR_ROW_SHARE, PRIOR_STEP_SHARE, Acceptance, Costs,
                                           lone_depth, shared_depths)


def acceptance_of(rate, windows=40, depth=8, seed=0):
    """An acceptance history whose drafts each land with chance `rate`."""
    rng, acceptance = random.Random(seed), Acceptance()
    for _ in range(windows):
        accepted = 0
        while accepted < depth and rng.random() < rate:
            accepted += 1
        acceptance.observe(depth, accepted)
    return acceptance


def costs_of(fixed, per_row, step=None):
    """Costs timed on a round whose ms is `fixed + per_row * rows`, and chains of `step` ms a step."""
    costs = Costs()
    for rows in range(1, 9):
        for _ in range(4):
            costs.observe_round(rows, fixed + per_row * rows)
    if step is not None:
        costs.observe_steps(4, 4 * step)
    return costs


def round_rate(acceptances, costs, depths, steps, extra_rows=0):
    """The documented price of a round: expected tokens over the fitted round plus the deepest chain."""
    tokens = sum(a.expected_tokens(d) for a, d in zip(acceptances, depths))
    chain = max((d for d, s in zip(depths, steps) if s), default=0) * costs.step_ms()
    return tokens / (costs.round_ms(len(depths) + extra_rows + sum(depths)) + chain)


def test_a_depth_without_verified_drafts_takes_the_prior():
    assert Acceptance().chain(4) == pytest.approx([PRIOR_ACCEPTANCE] * 4)
    assert Acceptance(prior=0.3).chain(2) == pytest.approx([0.3, 0.3])


def test_each_depth_counts_only_windows_whose_earlier_drafts_landed():
    acceptance = Acceptance()
    for _ in range(60):
        acceptance.observe(4, 1)  # the first draft lands, the second never
    p1, p2, p3, p4 = acceptance.chain(4)
    assert p1 > 0.9 and p2 < 0.1
    # no window ever tried a third draft: deeper depths lean on the depth before them
    assert p3 == pytest.approx(p2) and p4 == pytest.approx(p2)


def test_newer_windows_outweigh_older_ones():
    acceptance = Acceptance()
    for _ in range(50):
        acceptance.observe(2, 2)
    for _ in range(50):
        acceptance.observe(2, 0)
    assert acceptance.chain(1)[0] < 0.2


def test_expected_tokens_are_one_plus_the_chained_products():
    acceptance = acceptance_of(0.7)
    p = acceptance.chain(3)
    assert acceptance.expected_tokens(0) == 1.0
    assert acceptance.expected_tokens(3) == pytest.approx(1 + p[0] + p[0] * p[1] + p[0] * p[1] * p[2])


def test_the_cost_line_recovers_a_lone_rounds_time_by_its_rows():
    costs = costs_of(12.0, 3.0)
    assert costs.round_ms(1) == pytest.approx(15.0, rel=0.01)
    assert costs.round_ms(12) == pytest.approx(48.0, rel=0.01)


def test_rounds_of_one_width_lean_on_the_prior_slope():
    costs = Costs()
    for _ in range(20):
        costs.observe_round(1, 20.0)
    assert costs.round_ms(1) == pytest.approx(20.0)
    assert costs.round_ms(2) - costs.round_ms(1) == pytest.approx(PRIOR_ROW_SHARE * 20.0)


def test_a_step_is_the_decayed_mean_of_timed_chains():
    costs = Costs()
    costs.observe_steps(4, 8.0)
    assert costs.step_ms() == pytest.approx(2.0)
    for _ in range(200):
        costs.observe_steps(2, 10.0)
    assert costs.step_ms() == pytest.approx(5.0, rel=0.01)


def test_untimed_costs_are_priors_in_units_of_a_plain_round():
    costs = Costs()
    assert costs.round_ms(1) == pytest.approx(1.0)
    assert costs.round_ms(2) == pytest.approx(1.0 + PRIOR_ROW_SHARE)
    assert costs.step_ms() == pytest.approx(PRIOR_STEP_SHARE)


def test_a_lone_stream_picks_the_depth_with_the_most_expected_tokens_per_ms():
    rng = random.Random(1)
    for case in range(60):
        acceptance = acceptance_of(rng.random(), seed=case)
        costs = costs_of(rng.uniform(5, 50), rng.uniform(0, 10), rng.uniform(0, 10))
        steps = bool(case % 2)
        depth = lone_depth(acceptance, costs, 8, steps)
        best = max(round_rate([acceptance], costs, [k], [steps]) for k in range(9))
        assert round_rate([acceptance], costs, [depth], [steps]) == pytest.approx(best, rel=1e-12)


def test_a_lone_stream_drafts_nothing_when_drafting_costs_more_than_it_lands():
    assert lone_depth(acceptance_of(0.05), costs_of(20.0, 1.0, 2.0), 8) == 0
    # drafts that land well still lose to steps as dear as the round itself
    landing = acceptance_of(0.8)
    assert lone_depth(landing, costs_of(20.0, 1.0, 2.0), 8) > 0
    assert lone_depth(landing, costs_of(20.0, 1.0, 40.0), 8) == 0


def test_copy_drafts_cost_no_steps_so_they_go_deeper():
    acceptance, costs = acceptance_of(0.6), costs_of(20.0, 0.5, 8.0)
    assert lone_depth(acceptance, costs, 8, step_cost=False) > lone_depth(acceptance, costs, 8, step_cost=True)


def test_a_lone_stream_priced_as_a_shared_round_gets_its_lone_depth():
    rng = random.Random(2)
    for case in range(40):
        acceptance = acceptance_of(rng.random(), seed=case)
        costs = costs_of(rng.uniform(5, 50), rng.uniform(0, 10), rng.uniform(0, 10))
        assert shared_depths([acceptance], costs, [8]) == [lone_depth(acceptance, costs, 8)]


@pytest.mark.parametrize("seed", range(12))
def test_shared_rounds_are_priced_as_a_whole_for_the_most_tokens_per_ms(seed):
    rng = random.Random(seed)
    acceptances = [acceptance_of(rng.random(), seed=seed * 10 + i) for i in range(3)]
    costs = costs_of(rng.uniform(5, 50), rng.uniform(0, 10), rng.uniform(0, 10))
    limits, steps, extra = [4, rng.randrange(5), 4], [True, True, seed % 3 != 0], seed % 2 * 16
    depths = shared_depths(acceptances, costs, limits, steps, extra)
    assert all(0 <= d <= m for d, m in zip(depths, limits))
    best = max(round_rate(acceptances, costs, list(v), steps, extra)
               for v in itertools.product(*(range(m + 1) for m in limits)))
    assert round_rate(acceptances, costs, depths, steps, extra) == pytest.approx(best, rel=1e-12)


def test_in_a_shared_round_a_stream_drafts_nothing_only_where_its_drafts_do_not_pay():
    costs = costs_of(20.0, 1.0, 1.0)
    good, poor = acceptance_of(0.9), acceptance_of(0.05)
    assert shared_depths([good, good], costs, [8, 8]) == [lone_depth(good, costs, 8)] * 2
    depths = shared_depths([good, poor], costs, [8, 8])
    assert depths[0] > 0 and depths[1] == 0


def test_a_stream_whose_drafts_pay_alone_may_cost_a_shared_round_more_than_they_land():
    # rows are dear and its drafts land half the time: alone the round's fixed cost carries them
    costs, middling = costs_of(20.0, 6.0, 0.5), acceptance_of(0.5)
    assert lone_depth(middling, costs, 8) > 0
    assert shared_depths([middling] * 4, costs, [8] * 4) == [0] * 4


def test_a_stream_rides_a_neighbours_chain_because_chains_run_side_by_side():
    costs, good, middling = costs_of(20.0, 0.2, 10.0), acceptance_of(0.95), acceptance_of(0.45)
    # alone its steps cost more than its drafts land; beside a deep chain its steps are already paid for
    assert lone_depth(middling, costs, 8) == 0
    assert shared_depths([good, middling], costs, [8, 8])[1] > 0


def test_a_shared_round_is_timed_by_a_line_of_rounds_like_it_where_one_was_timed():
    acceptances, depths = [acceptance_of(0.8, seed=s) for s in range(4)], [6] * 4
    lone = costs_of(10.0, 20.0, step=0.5)  # rows look dear to the lone line
    assert sum(shared_depths(acceptances, lone, depths)) == 0
    assert shared_depths(acceptances, lone, depths, rounds=Costs()) == shared_depths(acceptances, lone, depths)
    assert sum(shared_depths(acceptances, lone, depths, rounds=costs_of(10.0, 0.1))) > 8


def test_a_primed_line_prices_rounds_by_its_timed_forwards_until_a_round_is_timed():
    costs = Costs()
    costs.prime({8: 20.0, 40: 24.0})
    assert costs.timed
    assert costs.round_ms(8) == pytest.approx(20.0) and costs.round_ms(40) == pytest.approx(24.0)


def test_rounds_of_one_width_lean_on_the_primed_slope_not_the_priors():
    primed, unprimed = Costs(), Costs()
    primed.prime({8: 10.0, 40: 14.0})
    for costs in (primed, unprimed):
        for _ in range(50):
            costs.observe_round(8, 20.0)
    assert primed.round_ms(8) == pytest.approx(20.0) and unprimed.round_ms(8) == pytest.approx(20.0)
    assert primed.round_ms(40) - primed.round_ms(8) == pytest.approx(4.0)  # 32 rows at the timed forwards' slope
    assert unprimed.round_ms(40) - unprimed.round_ms(8) == pytest.approx(32 * PRIOR_ROW_SHARE * 20.0 / 1.7)


def test_rounds_of_many_widths_outweigh_the_primed_slope():
    costs = costs_of(12.0, 3.0)
    costs.prime({1: 10.0, 5: 10.0})
    assert costs.round_ms(12) - costs.round_ms(1) == pytest.approx(33.0, rel=0.01)


def test_priming_takes_forwards_of_two_widths_or_more():
    with pytest.raises(ValueError, match="two widths"):
        Costs().prime({8: 20.0})
