"""Chances and grants: a drafter's chances price each stream's verify rows, and each grant sets the next hold."""

from __future__ import annotations

import random

import pytest

from tensorfold_core import hookimpl
from tensorfold_core.checkpoint import Checkpoint
from tensorfold_core.errors import DrafterError
from tensorfold_core.lanes.grants import GrantLane, Held, fit_one_pass, grants
from tensorfold_core.lanes.aside import FIRST_GAP
from tensorfold_core.lanes.guards import SHARED_MEASURE_PLAIN, Ask, DraftPlanner, Verified
from tensorfold_core.lanes.types import GenerationRequest
from tensorfold_core.loading import load_model, start_drafter
from tensorfold_core.plugins import Registry, new_plugin_manager
from tensorfold_core.protocols import DEPTH_RULE, DrafterFacts
from tensorfold_core.sampling import SamplingParams
from tensorfold_core.specs import DrafterKind
from tensorfold_core.testing import Run, solo, tiny_llama_checkpoint

FACTS = DrafterFacts(chances=True, slack=1, hold_rows=32)


def unit_round(rows: int) -> float:
    """The untimed prior line: a plain round is 1, each row a tenth of it."""
    return 0.9 + 0.1 * rows


def settle(planner, stream_id=0, *, facts=FACTS):
    """One lone round of a granting planner: (the hold's depth, a callback granting `chances` of it)."""
    depth = planner.plan([Ask(stream_id, 15, 100)], facts=facts)[0]

    def grant(chances):
        held = Held(len(chances), chances) if chances else None
        got = planner.grant([held], [len(chances)])[0]
        planner.observe([Verified(got, got, got + 1)])
        return got
    return depth, grant


# ---- the grant itself ----

def test_a_lone_grant_verifies_drafts_while_the_rounds_tokens_per_ms_rise():
    # 1 token in 1; +0.9 in 1.1; +0.8 in 1.2 (2.25 a unit); +0.05 in 1.3 would fall to 2.12
    assert grants([[0.9, 0.72, 0.036]], [False], unit_round, rows=1, tokens=1.0) == [2]
    assert grants([[0.05, 0.01]], [False], unit_round, rows=1, tokens=1.0) == [0]


def test_a_shared_rounds_grants_take_the_likeliest_drafts_over_all_streams_first():
    # reaches a: 0.9 0.5 0.2, b: 0.6 0.55 -> taken 0.9 0.6 0.55 0.5 (rate 3.03), then 0.2 would lower it
    assert grants([[0.9, 0.5, 0.2], [0.6, 0.55]], [False, False], unit_round, rows=2, tokens=2.0) == [2, 2]


def test_a_grant_reads_chances_as_a_running_product_that_never_rises():
    # a drafter's second chance above its first is read as its first: the chain needs both drafts to land
    assert grants([[0.3, 0.95]], [False], unit_round, rows=1, tokens=1.0) == grants([[0.3, 0.3]], [False], unit_round,
                                                                                      rows=1, tokens=1.0)


def test_a_drafted_stretchs_first_round_grants_one_draft_whatever_its_chances():
    assert grants([[0.99, 0.98], [0.01]], [True, True], unit_round, rows=2, tokens=2.0) == [1, 1]


# ---- chances kept between holds ----

def test_a_lanes_confidences_are_each_chance_over_the_one_before_and_their_running_product_gives_them_back():
    lane = GrantLane()
    lane.settle([0.9, 0.72, 0.36])
    assert lane.confidences == pytest.approx([0.9, 0.8, 0.5])
    assert lane.last_settled(3) == pytest.approx([0.9, 0.72, 0.36])


def test_a_hold_still_running_is_priced_by_the_last_settled_confidences_the_deepest_repeated_past_them():
    lane = GrantLane()
    assert lane.last_settled(2) is None
    lane.settle([0.9, 0.72])
    assert lane.last_settled(4) == pytest.approx([0.9, 0.72, 0.576, 0.4608])


@pytest.mark.parametrize("settled, granted", [([0.9, 0.09], 1), ([0.05, 0.04], 0)])
def test_a_planner_grants_a_hold_still_running_by_the_streams_last_settled_confidences(settled, granted):
    planner = DraftPlanner(timed=False)
    depth, grant = settle(planner)
    assert depth == 2 and grant(settled) == 1  # the stretch's first round grants one, and its confidences settle
    assert settle(planner)[0] == 1  # a short grant: no slack
    assert planner.grant([Held(1, None)], [1]) == [granted]  # priced by the first settled confidence


# ---- the next hold follows the grant ----

def test_after_a_full_grant_the_next_hold_drafts_one_more_and_after_a_short_grant_none_more():
    planner = DraftPlanner(timed=False)
    depth, grant = settle(planner)
    assert depth == 2 and grant([0.9, 0.8]) == 1  # first round: one draft and its slack held, one granted
    depth, grant = settle(planner)
    assert depth == 1 and grant([0.9]) == 1  # short: no slack; this grant is full
    depth, grant = settle(planner)
    assert depth == 2 and grant([0.9, 0.85]) == 2  # full: one more
    depth, grant = settle(planner)
    assert depth == 3 and grant([0.9, 0.85, 0.01]) == 2  # short
    depth, _ = settle(planner)
    assert depth == 2


def test_after_a_grant_of_none_a_stream_stands_aside_and_probes_the_slack_at_the_depth_rules_interval():
    planner = DraftPlanner(timed=False)
    depth, grant = settle(planner)
    grant([0.9, 0.8])
    depth, grant = settle(planner)
    assert grant([0.02]) == 0
    depths = []
    for _ in range(FIRST_GAP + 1):
        depth, grant = settle(planner)
        depths.append(depth)
        grant([0.02] * depth)
    assert depths[:FIRST_GAP] == [0] * FIRST_GAP and depths[FIRST_GAP] == FACTS.slack


def test_a_probe_whose_drafts_are_granted_brings_the_stream_back_to_holding():
    planner = DraftPlanner(timed=False)
    settle(planner)[1]([0.9])
    settle(planner)[1]([0.01])
    for _ in range(FIRST_GAP):
        settle(planner)[1]([])
    depth, grant = settle(planner)
    assert depth == 1 and grant([0.9]) == 1
    assert settle(planner)[0] == 2


def test_a_shared_rounds_holds_are_cut_deepest_and_latest_first_to_fit_one_hold_pass():
    assert fit_one_pass([9, 9, 9, 9, 9], [True] * 5, 32) == [7, 7, 6, 6, 6]
    assert fit_one_pass([4, 9, 3], [True, False, True], 5) == [3, 9, 2]  # a copy window is no block of the pass
    assert fit_one_pass([1] * 5, [True] * 5, 3) == [1, 1, 1, 0, 0]
    assert fit_one_pass([9, 9], [True, True], 0) == [9, 9]  # no bound


def test_a_shared_rounds_grants_grow_no_hold_past_one_pass():
    planner, streams = DraftPlanner(timed=False), 12
    for _ in range(8):
        depths = planner.plan([Ask(i, 15, 100) for i in range(streams)], facts=FACTS)
        assert sum(depths) <= FACTS.hold_rows
        held = [Held(d, [0.99] * d) if d else None for d in depths]
        got = planner.grant(held, depths)
        planner.observe([Verified(g, g, g + 1) for g in got])
    assert sum(depths) == FACTS.hold_rows  # full grants kept asking for more


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_when_the_shared_guard_starts_a_drafted_stretch_its_first_round_grants_every_stream_one_draft():
    clock = Clock()
    planner = DraftPlanner(clock=clock)
    firsts = []
    for r in range(SHARED_MEASURE_PLAIN + 4):
        depths = planner.plan([Ask(0, 15, 100), Ask(1, 15, 100)], facts=FACTS)
        held = [Held(d, [0.99] * d) if d else None for d in depths]
        got = planner.grant(held, depths)
        if any(depths) and not firsts:
            firsts = [depths, got]
        clock.now += 0.01
        planner.observe([Verified(g, g, g + 1) for g in got])
    assert firsts == [[2, 2], [1, 1]]


def test_without_chances_a_drafters_depths_follow_the_depth_rule():
    rule, plain = DraftPlanner(timed=False), DraftPlanner(timed=False)
    rng = random.Random(1)
    for _ in range(40):
        asks = [Ask(i, 15, 100) for i in range(3)]
        depths = rule.plan(asks, facts=DEPTH_RULE)
        assert depths == plain.plan(asks)
        verified = [Verified(d, a := rng.randrange(d + 1), a + 1) for d in depths]
        rule.observe(verified)
        plain.observe(verified)


# ---- through the round loop: grants change how many drafts a window verifies, never the reply ----

class OracleChances:
    """A `ChanceDrafter` that drafts each stream's reference reply with every fifth draft wrong, and tells the
    wrong ones apart by their confidences (0.95 right, 0.05 wrong); every third hold leaves its chances unsettled."""

    name = "oracle"
    facts = FACTS

    def __init__(self, references: dict[tuple[int, ...], list[int]]):
        self.references, self._chances, self.holds, self.asked = references, {}, 0, []

    def catch_up(self, asks):
        return 0

    def propose(self, asks):
        out = []
        self.holds += 1
        for ask in asks:
            self.asked.append(ask.depth)
            full = next(ref for prompt, ref in self.references.items() if list(ask.tokens[:len(prompt)]) == list(prompt))
            at = len(ask.tokens)
            drafts, chances, running = [], [], 1.0
            for pos in range(at, min(at + ask.depth, len(full))):
                wrong = pos % 5 == 3
                drafts.append((full[pos] + 1) % 384 if wrong else full[pos])
                running *= 0.05 if wrong else 0.95
                chances.append(running)
            self._chances[ask.stream_id] = None if self.holds % 3 == 0 else chances
            out.append(drafts)
        return out

    def chances(self, stream_id):
        return self._chances.get(stream_id)

    def release(self, stream_id):
        self._chances.pop(stream_id, None)

    def slot_bytes_for(self, tokens):
        return 0

    def kept_bytes(self):
        return 0

    def shed_kept(self, wanted_bytes=None):
        return 0

    def close(self):
        pass


class OneRun(Run):
    """Run, planning each round once (Run.step plans once to record the windows, then the round plans again)."""

    def step(self):
        self.admit()
        return self.engine.round()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(str(tiny_llama_checkpoint(tmp_path_factory.mktemp("grants"), seed=3)))[0]


def requests(n=6):
    rng = random.Random(7)
    out = []
    for i in range(n):
        prompt = [rng.randrange(6, 384) for _ in range(rng.randrange(3, 20))]
        sampling = SamplingParams() if i % 2 == 0 else SamplingParams(temperature=0.9, top_p=0.95, seed=40 + i)
        out.append(GenerationRequest(prompt_ids=prompt, max_tokens=24, sampling=sampling))
    return out


@pytest.mark.parametrize("parallel", [1, 4])
def test_replies_drafted_with_grants_equal_the_serial_solo_runs_greedy_and_seeded(model, parallel):
    reqs = requests()
    refs = [solo(model, r) for r in reqs]
    drafter = OracleChances({tuple(r.prompt_ids): r.prompt_ids + ref for r, ref in zip(reqs, refs)})
    run = OneRun(model, parallel)
    run.engine.drafter = drafter
    run.engine.copy_drafts = False
    for sid, request in enumerate(reqs):
        run.submit(sid, request)
    run.finish()
    assert [run.tokens(sid) for sid in range(len(reqs))] == refs
    stats = [run.done(sid).usage["tensorfold"] for sid in range(len(reqs))]
    assert sum(s["accepted"] for s in stats) > 0
    # grants cut the wrong drafts out: nearly every verified draft lands, and holds grew past one draft
    assert sum(s["accepted"] for s in stats) >= 0.8 * sum(s["drafted"] for s in stats)
    assert max(drafter.asked) > 2


def test_a_stream_joining_a_granted_round_changes_no_reply(model):
    reqs = requests()
    refs = [solo(model, r) for r in reqs]
    run = OneRun(model, 3)
    run.engine.drafter = OracleChances({tuple(r.prompt_ids): r.prompt_ids + ref for r, ref in zip(reqs, refs)})
    run.submit(0, reqs[0])
    for _ in range(4):
        run.step()
    for sid in range(1, len(reqs)):
        run.submit(sid, reqs[sid])
    run.finish()
    assert [run.tokens(sid) for sid in range(len(reqs))] == refs



class SaysChances:
    """A drafter whose facts give chances but which has no `chances`."""

    name, facts = "says-chances", FACTS
    catch_up = propose = release = slot_bytes_for = kept_bytes = shed_kept = close = staticmethod(lambda *a: 0)


class SaysChancesPlugin:
    @hookimpl
    def tensorfold_drafters(self):
        return [DrafterKind(name="says-chances", matches=lambda ckpt: True, admit=lambda *a: None,
                            start=lambda *a: SaysChances())]


def test_a_drafter_whose_facts_give_chances_without_a_chances_method_is_refused_at_start(model, tmp_path_factory):
    path = tiny_llama_checkpoint(tmp_path_factory.mktemp("says-chances"), seed=4)
    pm = new_plugin_manager(entry_points=False)
    pm.register(SaysChancesPlugin(), name="says-chances")
    with pytest.raises(DrafterError, match="its facts say it gives chances, but its SaysChances has no chances"):
        start_drafter(str(path), model, Checkpoint.open(path).tokenizer(), registry=Registry(pm))
