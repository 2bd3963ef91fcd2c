"""Guards that keep drafting honest, and the planner that prices rounds under them, on fake clocks."""

import itertools
import random

import pytest

from tensorfold_core import traces
from tensorfold_core.lanes.aside import FIRST_GAP, MAX_GAP, StandAside
from tensorfold_core.lanes.guards import LONE_PLAIN_SETTLE_ENV, Ask, DraftPlanner, LoneGuard, SharedGuard, Verified

PROBE = 3


def runs(modes):
    """Run-length encoding of a mode sequence: [(mode, rounds), ...]."""
    return [(mode, len(list(group))) for mode, group in itertools.groupby(modes)]


def stand_aside(aside, rounds):
    for _ in range(rounds):
        assert aside.depth(0, PROBE) == 0
        aside.round(0)


def arm(aside):
    stand_aside(aside, aside.gap - aside.count)
    assert aside.depth(0, PROBE) == PROBE and aside.probing


def test_a_stream_stands_aside_for_64_plain_rounds_then_probes():
    aside = StandAside()
    stand_aside(aside, FIRST_GAP)
    assert aside.depth(0, PROBE) == PROBE


def test_a_probe_stays_armed_until_a_round_verifies_its_drafts_then_its_gap_doubles():
    aside = StandAside()
    arm(aside)
    aside.round(0)  # the look-ahead's plain round
    assert aside.probing and aside.depth(0, PROBE) == PROBE
    aside.round(PROBE)
    assert not aside.probing and aside.count == 0 and aside.gap == 2 * FIRST_GAP


def test_a_probe_whose_drafts_are_cut_disarms_after_one_more_plain_round_with_its_gap_doubled():
    aside = StandAside()
    arm(aside)
    aside.round(0)
    assert aside.depth(0, PROBE) == PROBE
    aside.round(0)  # its drafts were cut to nothing again: stop paying for them
    assert not aside.probing and aside.count == 0 and aside.gap == 2 * FIRST_GAP
    assert aside.depth(0, PROBE) == 0


def test_the_gap_between_probes_doubles_up_to_1024():
    aside, gaps = StandAside(), []
    for _ in range(7):
        gaps.append(aside.gap)
        arm(aside)
        aside.round(PROBE)
    assert gaps == [64, 128, 256, 512, 1024, 1024, 1024] and aside.gap == MAX_GAP


def test_a_stream_whose_drafts_pay_again_stands_aside_next_time_from_the_first_gap():
    aside = StandAside()
    arm(aside)
    aside.round(PROBE)
    assert aside.depth(2, PROBE) == 2  # the probe's drafts landed: the depth rule prices drafts again
    aside.round(2)
    assert aside.gap == FIRST_GAP and aside.count == 0
    stand_aside(aside, FIRST_GAP)
    assert aside.depth(0, PROBE) == PROBE


def run_shared(guard, rounds, streams=2, plain=(2, 10.0), drafted=(6, 15.0), first=None):
    """Feeds a shared guard rounds of fixed tokens and ms per mode; `first` replaces a mode's first round."""
    modes = []
    for _ in range(rounds):
        mode = guard.drafted(streams)
        tokens, ms = drafted if mode else plain
        if first is not None and (not modes or modes[-1] != mode):
            tokens, ms = first[mode]
        guard.observe(streams, mode, tokens, ms)
        modes.append(mode)
    return modes


def test_the_shared_guard_measures_16_plain_and_4_drafted_rounds_then_runs_the_faster_mode_for_512():
    guard = SharedGuard()
    # each mode's first round comes before its measured ones
    assert runs(run_shared(guard, 17 + 5 + 512 + 17)) == [(False, 17), (True, 5 + 512), (False, 17)]
    guard = SharedGuard()
    assert runs(run_shared(guard, 17 + 5 + 512 + 5, drafted=(2, 15.0))) == [
        (False, 17), (True, 5), (False, 512), (True, 5)]


def test_a_band_running_plain_counts_down_its_rounds_left_and_none_while_it_measures_or_drafts():
    guard = SharedGuard()
    run_shared(guard, 17)  # plain measured: 0 left (measuring drafted now)
    assert guard.plain_rounds_left(2) == 0
    run_shared(guard, 5, drafted=(2, 15.0))  # drafting loses: plain runs 512 rounds
    assert guard.plain_rounds_left(2) == 512 and guard.plain_rounds_left(3) == 0  # another band: its own state
    run_shared(guard, 100)
    assert guard.plain_rounds_left(2) == 512 - 100
    guard = SharedGuard()
    run_shared(guard, 17 + 5)  # drafting wins its measure: a drafted run leaves no plain rounds
    assert guard.drafted(2) and guard.plain_rounds_left(2) == 0


def test_a_mode_that_keeps_winning_runs_twice_as_long_each_time_up_to_64_times():
    guard = SharedGuard()
    spans = runs(run_shared(guard, 120_000))
    drafted = [n for mode, n in spans if mode][1:-1]
    assert drafted == [1024, 2048, 4096, 8192, 16384, 32768, 32768]
    assert all(n == 17 for mode, n in spans[:-1] if not mode)
    assert guard.run_length(2) == 512 * 64


def test_when_the_other_mode_wins_its_run_starts_again_from_512():
    guard = SharedGuard()
    run_shared(guard, 17 + 517 + 17 + 1024)
    assert guard.run_length(2) == 1024 and not guard.drafted(2)  # drafted won twice; plain is measured again
    # plain rounds turn cheap: plain wins, and its run starts from the first length
    spans = runs(run_shared(guard, 17 + 512 + 5, plain=(2, 2.0)))
    assert spans == [(False, 17 + 512), (True, 5)]
    assert guard.run_length(2) == 1024  # and plain won again


def test_a_drafted_run_that_falls_below_the_plain_rate_stops_after_16_rounds_and_both_are_measured_again():
    guard = SharedGuard()
    run_shared(guard, 17 + 5)  # drafting wins its 4-round measure
    assert guard.drafted(2)
    # then its rounds turn dear: a run of 512 would pay for them; it stops after 16 measured rounds instead, plain
    # is measured again, and against the run's own rate plain wins and runs
    spans = runs(run_shared(guard, 16 + 17 + 5, drafted=(2, 15.0)))
    assert spans == [(True, 16), (False, 17 + 5)]
    assert not guard.drafted(2) and guard.run_length(2) == 512


def test_a_drafted_run_above_the_plain_rate_runs_its_whole_length():
    guard = SharedGuard()
    run_shared(guard, 17 + 5)
    spans = runs(run_shared(guard, 512, drafted=(3, 14.0)))  # dearer than it was measured, still above plain
    assert spans == [(True, 512)]


@pytest.mark.parametrize("speedup, drafts", [(1.04, False), (1.06, True)])
def test_drafted_rounds_must_beat_plain_ones_by_5_percent(speedup, drafts):
    guard = SharedGuard()
    run_shared(guard, 17 + 5, plain=(1, 10.0), drafted=(2, 20.0 / speedup))
    assert guard.drafted(2) is drafts


def test_a_modes_first_round_is_not_measured():
    guard = SharedGuard()
    # the first round of each mode carries the other mode's costs; measured, it would make plain win
    first = {False: (200, 1.0), True: (1, 1000.0)}
    run_shared(guard, 17 + 5, first=first)
    assert guard.drafted(2)


def test_a_measuring_stretch_leaves_out_the_drafters_catch_up_and_a_run_pays_it_and_stops():
    guard, modes = SharedGuard(), []
    for _ in range(17 + 5 + 512 + 17 + 3):
        mode = guard.drafted(2)
        # every drafted round spends 100 ms feeding the drafter: 6 tokens in 115 ms lose to 2 in 10
        guard.observe(2, mode, *((6, 115.0, 100.0) if mode else (2, 10.0, 0.0)))
        modes.append(mode)
    # measured, drafting wins without the catch-up; its run pays it and falls below plain, so after 16 rounds plain
    # is measured again and runs
    assert runs(modes) == [(False, 17), (True, 5 + 16), (False, 17 + 512 - 16 + 3)]


def test_stream_counts_share_a_verdict_by_bands_1_2_3_to_4_5_to_8_9_to_16():
    bands = [[n for n in range(1, 33) if SharedGuard.band(n) == band] for band in sorted(
        {SharedGuard.band(n) for n in range(1, 33)})]
    assert bands == [[1], [2], [3, 4], list(range(5, 9)), list(range(9, 17)), list(range(17, 33))]


@pytest.mark.parametrize("drafted, wins", [((24, 15.0), True), ((12, 15.0), False)])
def test_rounds_at_7_and_6_streams_run_the_verdict_measured_at_8(drafted, wins):
    guard = SharedGuard()
    run_shared(guard, 17 + 5, streams=8, plain=(8, 10.0), drafted=drafted)
    assert guard.drafted(8) is wins
    # as streams finish the count walks down within the band, and the winner's run goes on where it was
    rates = {"plain": (8, 10.0), "drafted": drafted}  # as measured: a run at the rates it won by runs its length
    modes = run_shared(guard, 200, streams=7, **rates) + run_shared(guard, 312 - 1, streams=6, **rates)
    assert modes == [wins] * 511 and guard.drafted(5) is wins
    run_shared(guard, 1, streams=6, **rates)
    assert guard.drafted(6) is not wins  # the run of 512 is over: the other mode is measured again


def test_2_and_3_streams_keep_apart_verdicts():
    guard = SharedGuard()
    for _ in range(30):
        run_shared(guard, 3, streams=2)
        run_shared(guard, 3, streams=3, drafted=(6, 60.0))
    assert guard.drafted(2) and not guard.drafted(3) and not guard.drafted(4)


def test_a_stream_leaving_is_no_modes_first_round_but_a_stream_joining_is():
    def plain_rounds(counts):
        guard = SharedGuard()
        for n, streams in enumerate(counts, start=1):
            guard.observe(streams, False, streams, 10.0)
            if guard.drafted(streams):  # the plain stretch is measured: the guard moves on to drafted rounds
                return n
        return None

    # a mode's first round is left out; after it, 16 measured rounds whether or not a stream left
    assert plain_rounds([8] + [7] * 20) == 17
    # a stream joining at round 6 makes the next round a first round again
    assert plain_rounds([7] * 5 + [8] * 20) == 18


BAND = LoneGuard.band(True, 1000)


def run_lone(guard, rounds, stream=1, band=BAND, plain=(1, 10.0), drafted=(3, 20.0)):
    """Feeds a lone guard rounds of fixed tokens and ms per mode; returns each round's mode."""
    modes = []
    for _ in range(rounds):
        mode = guard.drafted(stream, band)
        tokens, ms = drafted if mode else plain
        guard.observe(stream, band, mode, tokens, ms)
        modes.append(mode)
    return modes


def test_bands_part_sampling_modes_and_powers_of_two_of_the_context():
    assert LoneGuard.band(True, 1000) == LoneGuard.band(True, 600) != LoneGuard.band(True, 1024)
    assert LoneGuard.band(False, 1000) != LoneGuard.band(True, 1000)


def test_a_lone_stream_keeps_drafting_while_its_stretches_beat_plain_by_5_percent():
    guard = LoneGuard()
    # its first drafted stretch meets a band with no plain rate yet: one plain stretch is taken to compare
    assert runs(run_lone(guard, 17 + 17 + 500)) == [(True, 17), (False, 17), (True, 500)]
    assert not guard.losing(BAND)


def test_a_winning_band_reads_its_plain_rate_again_after_1024_drafted_rounds_and_then_twice_as_long():
    guard = LoneGuard()
    # its plain rate read once in slow rounds (a cold start): 0.05 tokens a ms, drafting's 0.15 beats it
    spans = runs(run_lone(guard, 3200, plain=(1, 20.0)))
    assert [mode for mode, _ in spans[:6]] == [True, False, True, False, True, False] and spans[3][1] == 16
    # the first drafted stretch, judged once plain was read, counts too; judged every 16 rounds, so up to 16 past
    assert 1024 <= 17 + spans[2][1] < 1024 + 17 and 2048 <= spans[4][1] < 2048 + 17
    # plain rounds now run at 0.2 tokens a ms: the next read finds it, and drafting's next stretch loses to it
    guard = LoneGuard()
    first = runs(run_lone(guard, 17 + 17 + 900, plain=(1, 20.0)))[2][1]
    spans = runs(run_lone(guard, 1024 - 17 - first + 16 + 16 + 17 + 16, plain=(2, 10.0)))
    assert [mode for mode, _ in spans][:4] == [True, False, True, False] and spans[1][1] == 16 and guard.losing(BAND)


def test_a_settled_plain_stretch_is_judged_on_its_rounds_run_ahead_not_the_slow_ones_before(monkeypatch):
    def judged(settle):
        monkeypatch.setenv(LONE_PLAIN_SETTLE_ENV, str(settle))
        guard, modes, plain_rounds = LoneGuard(), [], 0
        for _ in range(17 + 20 + 40):
            mode = guard.drafted(1, BAND)
            plain_rounds = 0 if mode else plain_rounds + 1
            # a plain stretch's first 3 rounds wait on the device (nothing runs ahead yet): 1 token in 40 ms
            tokens, ms = (5, 40.0) if mode else ((1, 40.0) if plain_rounds <= 3 else (1, 7.0))
            guard.observe(1, BAND, mode, tokens, ms)
            modes.append(mode)
        return runs(modes), guard.losing(BAND)

    # drafting (0.125 tokens a ms) beats plain measured with its 2 slow rounds (16 tokens in 178 ms)...
    assert judged(1) == ([(True, 17), (False, 17), (True, 43)], False)
    # ...and loses to plain's steady 0.143 when those are left out: the stretch and the wait plain, a probe lost
    assert judged(4) == ([(True, 17), (False, 20 + 16), (True, 17), (False, 7)], True)


def test_a_lone_stream_whose_stretch_loses_runs_16_plain_rounds_then_measures_drafting_again():
    guard = LoneGuard()
    run_lone(guard, 17 + 17)
    modes = run_lone(guard, 17 + 16 + 17, drafted=(2, 20.0))  # 0.1 tokens a ms: no 5% over plain
    assert runs(modes) == [(True, 17), (False, 16), (True, 17)]
    assert guard.losing(BAND)


def test_the_plain_wait_doubles_to_512_while_plain_keeps_winning():
    guard = LoneGuard()
    # drafting loses by little, so what a probe costs never sets the wait
    spans = runs(run_lone(guard, 4000, drafted=(2, 20.4)))
    assert [n for mode, n in spans if not mode][:7] == [17 + 16, 32, 64, 128, 256, 512, 512]
    assert all(n == 17 for mode, n in spans[:-1] if mode)


def test_after_two_losses_in_a_row_a_probe_costs_at_most_3_percent_of_the_plain_time():
    plain, drafted = (1, 10.0), (2, 40.0)  # drafted rounds commit at half the plain rate
    modes = run_lone(LoneGuard(), 20_000, plain=plain, drafted=drafted)
    spans = runs(modes)[:-1]
    lost_per_round = drafted[1] - drafted[0] * plain[1] / plain[0]
    # the probes after two losses in a row
    probes = [(spans[i - 1][1], n) for i, (mode, n) in enumerate(spans) if mode and i >= 4]
    assert len(probes) >= 5
    for plain_rounds, probe_rounds in probes:
        assert probe_rounds * lost_per_round <= 0.03 * plain_rounds * plain[1]
    # before the second loss the wait was the first one, and a probe cost far more than that
    assert spans[1][1] == 17 + 16 and spans[2][1] * lost_per_round > 0.03 * 16 * plain[1]


def test_a_bands_losing_verdict_starts_the_next_stream_in_that_band_plain():
    guard = LoneGuard()
    run_lone(guard, 17 + 17 + 5, stream=1, drafted=(1, 20.0))
    assert guard.losing(BAND)
    assert not guard.drafted(2, BAND)
    other = LoneGuard.band(False, 1000)
    assert guard.drafted(3, other)


def test_short_replies_in_one_band_carry_its_stretch_until_it_is_judged():
    guard = LoneGuard()
    # six rounds a reply, the first of each unmeasured: the band's 16 measured drafted rounds span four replies
    modes = [mode for stream in range(1, 5) for mode in run_lone(guard, 6, stream=stream)]
    assert modes == [True] * 20 + [False] * 4  # the fourth reply's last rounds take the plain stretch to compare
    # a reply that began its own stretch each time would have drafted all 24 rounds, its band never judged; here
    # the plain stretch goes on through the next replies (each one's first round unmeasured), and drafting wins
    modes = [mode for stream in range(5, 8) for mode in run_lone(guard, 6, stream=stream)]
    assert runs(modes) == [(False, 16), (True, 2)] and not guard.losing(BAND)


def test_a_win_clears_the_bands_losing_verdict():
    guard = LoneGuard()
    run_lone(guard, 17 + 17 + 5, stream=1, drafted=(1, 20.0))
    # the next stream waits out what the last one left of the band's plain wait, probes, and its drafts win
    spans = runs(run_lone(guard, guard.wait(BAND) - 5 + 17 + 10, stream=2))
    assert spans == [(False, guard.wait(BAND) - 5), (True, 17 + 10)]
    assert not guard.losing(BAND) and guard.drafted(4, BAND)


class FakeClock:
    """Seconds that move only when a test says; counts its reads."""

    def __init__(self):
        self.now, self.reads = 0.0, 0

    def __call__(self):
        self.reads += 1
        return self.now

    def advance(self, ms):
        self.now += ms / 1000.0


def drive(planner, clock, rounds, rates, *, round_ms, step_ms, max_depth=6, seed=0, copy=False, greedy=True,
          catch_up_ms=0.0, first_id=0):
    """Runs rounds of streams whose drafts land with `rates[i]`; returns each round's depths. A drafter round
    after an undrafted one first pays `catch_up_ms` feeding the drafter what it missed."""
    rng, log, last = random.Random(seed), [], ()
    for r in range(rounds):
        asks = [Ask(first_id + i, max_depth, context=500 + r, greedy=greedy, copy=copy) for i in range(len(rates))]
        depths = planner.plan(asks)
        if catch_up_ms and not copy and any(d and not (last and last[i]) for i, d in enumerate(depths)):
            clock.advance(catch_up_ms)
        planner.caught_up()
        last = depths
        clock.advance(0.0 if copy else step_ms * max(depths))
        planner.proposed()
        clock.advance(round_ms(depths))
        verified = []
        for rate, depth in zip(rates, depths):
            accepted = 0
            while accepted < depth and rng.random() < rate:
                accepted += 1
            verified.append(Verified(depth, accepted, accepted + 1))
        planner.observe(verified)
        log.append(tuple(depths))
    return log


def fast(depths):
    return 10.0 + 0.1 * sum(d + 1 for d in depths)


def slow(depths):
    return 10.0 + 30.0 * sum(depths) + 0.1 * len(depths)


@pytest.mark.parametrize("rates", [[0.8], [0.8, 0.3, 0.05]])
def test_an_untimed_planner_decides_the_same_on_a_fast_and_a_slow_clock(rates):
    logs = []
    for round_ms, step_ms in [(fast, 0.5), (slow, 40.0)]:
        clock = FakeClock()
        logs.append(drive(DraftPlanner(timed=False, clock=clock), clock, 600, rates,
                          round_ms=round_ms, step_ms=step_ms))
        assert clock.reads == 0
    assert logs[0] == logs[1]
    assert any(sum(depths) for depths in logs[0])


def test_a_timed_planner_drafts_where_drafts_pay_and_not_where_the_clock_says_they_cost_more():
    drafted = {}
    for name, round_ms, step_ms in [("fast", fast, 0.5), ("slow", slow, 40.0)]:
        clock = FakeClock()
        log = drive(DraftPlanner(clock=clock), clock, 600, [0.8], round_ms=round_ms, step_ms=step_ms)
        drafted[name] = sum(1 for depths in log if depths[0])
    assert drafted["fast"] > 550 and drafted["slow"] < 60


def test_shared_rounds_do_not_feed_the_cost_line():
    clock = FakeClock()
    planner = DraftPlanner(clock=clock)
    drive(planner, clock, 50, [0.8], round_ms=fast, step_ms=0.5)
    line = planner.costs.line()
    drive(planner, clock, 50, [0.8, 0.8], round_ms=lambda depths: 500.0, step_ms=0.5)
    assert planner.costs.line() == line


@pytest.mark.parametrize("copy", [False, True])
def test_a_shared_round_dearer_than_the_lone_line_prices_its_drafts_out_by_its_own_line(copy):
    def shared_dear(depths):  # drafted shared rounds pay per stream what no lone round shows
        return fast(depths) + (25.0 * len(depths) if len(depths) > 1 and sum(depths) else 0.0)

    clock = FakeClock()
    planner = DraftPlanner(clock=clock)
    drive(planner, clock, 100, [0.9], round_ms=shared_dear, step_ms=0.5, copy=copy)
    log = drive(planner, clock, 600, [0.9, 0.9, 0.9], round_ms=shared_dear, step_ms=0.5, copy=copy)
    # 16 plain rounds measured, one drafted round teaches the band's line, then only ever rarer probes draft
    spans = runs([sum(depths) > 0 for depths in log])
    assert spans[:2] == [(False, 17), (True, 1)] and sum(n for drafted, n in spans if drafted) <= 8
    log = drive(planner, clock, 600, [0.9, 0.9], round_ms=fast, step_ms=0.5, copy=copy)
    assert sum(1 for depths in log if sum(depths)) > 550


def test_shared_rounds_whose_rows_cost_little_draft_though_lone_rounds_say_rows_are_dear():
    def lone_dear(depths):  # a lone round's second row looks dear (a noisy fit on one- and two-row rounds)
        return 10.0 + (20.0 * sum(depths) if len(depths) == 1 else 0.1 * sum(d + 1 for d in depths))

    clock = FakeClock()
    planner = DraftPlanner(clock=clock)
    drive(planner, clock, 100, [0.9], round_ms=lone_dear, step_ms=0.5)
    assert planner.costs.line()[1] > 10.0
    log = drive(planner, clock, 600, [0.9, 0.9, 0.9], round_ms=lone_dear, step_ms=0.5)
    assert runs([sum(depths) > 0 for depths in log])[:2] == [(False, 17), (True, 5 + 512)]
    assert planner.shared_costs[SharedGuard.band(3)].line()[1] < 1.0 and planner.costs.line()[1] > 10.0


def test_a_stream_that_stood_aside_comes_back_to_drafting_when_its_probe_lands():
    planner, rates = DraftPlanner(timed=False), [0.02]
    clock = FakeClock()
    first = drive(planner, clock, 300, rates, round_ms=fast, step_ms=0.5)
    assert sum(1 for depths in first[100:] if depths[0]) <= 4  # standing aside, probing now and then
    rates[0] = 0.95
    later = drive(planner, clock, 300, rates, round_ms=fast, step_ms=0.5, seed=1)
    assert sum(1 for depths in later[200:] if depths[0]) == 100


def test_copy_rounds_are_left_out_of_the_lone_guard(monkeypatch):
    clock, seen = FakeClock(), []
    planner = DraftPlanner(clock=clock)
    monkeypatch.setattr(planner.lone, "observe", lambda *args: seen.append(args))
    interrupted = []
    monkeypatch.setattr(planner.lone, "interrupt", lambda: interrupted.append(True))
    drive(planner, clock, 40, [0.9], round_ms=fast, step_ms=0.5, copy=True)
    # nor interrupt it: a copy round runs in either mode, so the lone round after it is measured as any other
    assert not seen and not interrupted
    drive(planner, clock, 40, [0.9], round_ms=fast, step_ms=0.5)
    assert seen


def test_a_planner_gives_each_stream_at_most_its_room_and_nothing_where_it_has_none():
    clock, rng = FakeClock(), random.Random(5)
    planner = DraftPlanner(clock=clock)
    for _ in range(300):
        asks = [Ask(i, rng.randrange(5), context=rng.randrange(1, 5000), greedy=rng.random() < 0.5,
                    copy=rng.random() < 0.3) for i in range(rng.randrange(1, 5))]
        depths = planner.plan(asks, extra_rows=rng.choice([0, 0, 32]))
        assert all(0 <= d <= a.max_depth for d, a in zip(depths, asks))
        clock.advance(rng.uniform(1, 30))
        planner.proposed()
        clock.advance(rng.uniform(1, 30))
        planner.observe([Verified(d, rng.randrange(d + 1), 1) for d in depths])


def test_a_drafters_catch_up_is_timed_apart_from_its_chain_steps():
    clock = FakeClock()
    planner = DraftPlanner(clock=clock)
    log = drive(planner, clock, 3, [0.8], round_ms=fast, step_ms=0.5, catch_up_ms=80.0)
    assert log[0][0] > 0 and planner.costs.step_ms() == pytest.approx(0.5)


def test_a_new_stream_starts_from_how_often_drafter_drafts_landed_lately():
    clock = FakeClock()
    planner = DraftPlanner(timed=False)
    drive(planner, clock, 300, [0.02], round_ms=fast, step_ms=0.5)
    assert planner.plan([Ask(7, 6, context=10)]) == [0]  # it stands aside from its first round
    planner.observe([Verified(0, 0, 1)])
    assert planner.plan([Ask(8, 6, context=10, copy=True)])[0] > 0  # copy drafts keep the fixed prior
    planner.observe([Verified(0, 0, 1)])
    drive(planner, clock, 300, [0.95], round_ms=fast, step_ms=0.5, first_id=1)
    assert planner.plan([Ask(9, 6, context=10)])[0] > 0
    assert DraftPlanner(timed=False).plan([Ask(0, 6, context=10)])[0] > 0  # with nothing landed yet: the prior


def test_a_stream_is_probing_exactly_while_its_probe_is_armed():
    planner, probing, depths = DraftPlanner(timed=False), [], []
    for r in range(400):
        (depth,) = planner.plan([Ask(0, 6, context=10 + r)])
        probing.append(planner.probing(0))
        depths.append(depth > 0)
        planner.observe([Verified(depth, 0, 1)])
    # it drafts its first round, stands aside 64 rounds, probes, stands aside 128, probes; 256 is past the end
    assert probing == [d and r > FIRST_GAP for r, d in enumerate(depths)]
    assert sum(probing) == 2 and depths[0] and not planner.probing(99)


@pytest.mark.parametrize("shared", [False, True])
def test_a_round_that_traced_a_new_shape_teaches_the_planner_no_cost_and_no_rate(shared):
    def traced(depths):  # a compile of a new window's shape: a one-off cost its like never pays again
        traces.note()
        return 500.0

    def taught(planner):
        return (planner.costs.line(), planner.costs.step_ms(),
                {band: line.line() for band, line in planner.shared_costs.items()})

    clock = FakeClock()
    planner = DraftPlanner(clock=clock)
    rates = [0.8, 0.8] if shared else [0.8]
    drive(planner, clock, 50, rates, round_ms=fast, step_ms=0.5)
    before = taught(planner)
    log = drive(planner, clock, 40, rates, round_ms=traced, step_ms=40.0)
    assert taught(planner) == before
    assert all(sum(depths) for depths in log)  # no guard took the traced rounds' rate for drafting's

