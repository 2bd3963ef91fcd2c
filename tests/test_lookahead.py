"""Lookahead: a plain greedy round queues its next step on the device's argmax, and every reply's ids stay those
of rounds run in step, whoever joins, leaves, is cancelled, samples or shares a prompt."""

import inspect
import random

import pytest

import mlx.core as mx

from tensorfold_core.lanes.ahead import LOOKAHEAD_ENV, Lookahead, device_acceptance
from tensorfold_core.lanes.engine import accepted_prefix
from tensorfold_core.lanes.rows import Penalties
from tensorfold_core.lanes.types import GenerationRequest
from tensorfold_core.loading import load_model, start_drafter
from tensorfold_core.protocols import LookaheadModel, Model, can_keep_later, missing_members
from tensorfold_core.sampling import SamplingParams
from tensorfold_core.testing import Run, tiny_llama_checkpoint


@pytest.fixture(scope="module", params=["llama", "tiny-lfm2", "tiny-lfm2-moe-4bit"])
def model(request, tmp_path_factory):
    if request.param == "llama":
        return load_model(str(tiny_llama_checkpoint(tmp_path_factory.mktemp("ahead"), seed=5)))[0]
    return load_model(request.param)[0]  # the hybrid cache: conv states closed unkept, as a rejected draft's


def mixed_requests(n, vocab, seed):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(6, vocab) for _ in range(rng.randrange(1, 30))]
        sampling = SamplingParams(temperature=0.8, seed=7 + i) if i % 4 == 3 else SamplingParams()
        # draft=False: no copy drafts, so plain rounds (the ones that run ahead) are most of the run
        out.append(GenerationRequest(prompt_ids=prompt, max_tokens=rng.randrange(3, 24), sampling=sampling,
                                     draft=False))
    return out


def replies(model, requests, parallel, lookahead, cancel_at=None):
    run = Run(model, parallel, lookahead=lookahead)
    for sid, request in enumerate(requests):
        run.submit(sid, request)
    step = 0
    while run.waiting or not run.engine.idle():
        if step == cancel_at:
            run.engine.cancel(1)
        run.step()
        step += 1
    return [run.tokens(sid) for sid in range(len(requests))], run


def test_a_lone_greedy_stream_runs_ahead_on_almost_every_round_with_the_ids_of_rounds_in_step(model):
    (request,) = mixed_requests(1, 300, seed=1)
    request = GenerationRequest(prompt_ids=request.prompt_ids, max_tokens=20, draft=False)
    (stepped,), _ = replies(model, [request], 1, lookahead=False)
    (ahead,), run = replies(model, [request], 1, lookahead=True)
    assert ahead == stepped and len(ahead) == 20
    assert run.engine.ahead.used >= 17  # all but the first decode round and the one after the last


@pytest.mark.parametrize("parallel", [1, 3, 8])
def test_streams_joining_leaving_sampling_and_cancelled_get_the_ids_of_rounds_in_step(model, parallel):
    requests = mixed_requests(8, 300, seed=parallel)
    stepped, _ = replies(model, requests, parallel, lookahead=False, cancel_at=9)
    ahead, run = replies(model, requests, parallel, lookahead=True, cancel_at=9)
    assert ahead == stepped
    assert run.engine.ahead.used > 0 and run.engine.ahead.launched is None


def test_a_prefill_group_snapshot_taken_while_a_step_is_queued_gives_the_ids_of_rounds_in_step(model):
    prompt = list(range(20, 44))
    requests = [GenerationRequest(prompt_ids=prompt, max_tokens=10 + i, prefill_group="g", draft=False)
                for i in range(3)]
    stepped, _ = replies(model, requests, 3, lookahead=False)
    ahead, _ = replies(model, requests, 3, lookahead=True)
    assert ahead == stepped


def test_seeded_penalised_and_logprob_streams_never_run_ahead(model):
    base = mixed_requests(1, 300, seed=3)[0].prompt_ids
    requests = [GenerationRequest(prompt_ids=base, max_tokens=12, sampling=SamplingParams(temperature=1.0, seed=1),
                                  draft=False),
                GenerationRequest(prompt_ids=base, max_tokens=12, penalties=Penalties(repetition=1.3), draft=False),
                GenerationRequest(prompt_ids=base, max_tokens=12, logprobs=2, draft=False)]
    for request in requests:
        _, run = replies(model, [request], 1, lookahead=True)
        assert run.engine.ahead.used == 0


def test_a_drafting_stream_runs_ahead_only_after_rounds_without_drafts_with_the_ids_of_rounds_in_step(model):
    # a prompt that repeats: copies land in some rounds and find nothing in others
    if getattr(getattr(model, "args", None), "model_type", "") == "lfm2_moe":
        pytest.skip("tiny-lfm2-moe-4bit's greedy reply here repeats nothing, so no copy is ever drafted")
    rng = random.Random(4)
    phrase = [rng.randrange(6, 300) for _ in range(7)]
    request = GenerationRequest(prompt_ids=[rng.randrange(6, 300) for _ in range(9)] + phrase * 3, max_tokens=40)
    (stepped,), _ = replies(model, [request], 1, lookahead=False)
    runs = {}
    for after in (None, 1):  # None: a stream that may draft never runs ahead; 1: after one round without drafts
        run = runs[after] = Run(model, 1, lookahead=True)
        run.engine.ahead_after_undrafted = after
        run.submit(0, request)
        run.finish()
        assert run.tokens(0) == stepped and len(stepped) == 40
    assert runs[None].engine.ahead.used == 0
    # rounds ran ahead between drafted ones (and a queued step a copy then replaced was closed unkept)
    assert runs[1].engine.ahead.used > 0 and runs[1].engine.counters.draft_tokens > 0


def test_a_stream_one_round_past_its_last_drafts_holds_a_shared_round_back_no_longer_while_alone_it_waits_three():
    from tensorfold_core.lanes.engine import AHEAD_AFTER_UNDRAFTED, AHEAD_AFTER_UNDRAFTED_SHARED

    model = load_model("tiny-llama")[0]
    run = Run(model, 1, lookahead=True)
    # its copies land in some rounds and find nothing in others (five rounds in a row hold none in this reply)
    run.submit(0, GenerationRequest(prompt_ids=list(range(40, 60)), max_tokens=40))
    run.step()
    engine = run.engine
    (stream,) = engine.streams.values()
    assert (AHEAD_AFTER_UNDRAFTED, AHEAD_AFTER_UNDRAFTED_SHARED) == (3, 1)
    undrafted, met = None, set()  # its rounds in a row without drafts, counted from its first drafted round
    while engine.streams:
        if undrafted is not None:
            assert engine._drafts_next(stream) == (undrafted < 3)
            assert engine._drafts_next(stream, shared=True) == (undrafted < 1)
            met.add(min(undrafted, 3))
        before = engine.counters.draft_tokens
        run.step()
        if engine.counters.draft_tokens > before:
            undrafted = 0
        elif undrafted is not None:
            undrafted += 1
    assert met == {0, 1, 2, 3}  # the rule was read on both sides of both thresholds


def test_the_environment_switch_turns_lookahead_off(model, monkeypatch):
    monkeypatch.setenv(LOOKAHEAD_ENV, "0")
    assert not Lookahead(model).on
    monkeypatch.setenv(LOOKAHEAD_ENV, "1")
    assert Lookahead(model).on


def test_a_drafting_request_runs_ahead_on_an_engine_with_nothing_to_draft_with(model):
    request = GenerationRequest(prompt_ids=list(range(40, 60)), max_tokens=12)
    runs = []
    for lookahead in (False, True):
        run = Run(model, 1, lookahead=lookahead)
        run.engine.copy_drafts = False  # no drafter, no copies: every window is a plain one
        run.submit(0, request)
        run.finish()
        runs.append(run)
    assert runs[1].tokens(0) == runs[0].tokens(0) and runs[1].engine.ahead.used >= 9


def test_a_stream_whose_drafter_misses_runs_ahead_while_it_stands_aside_with_the_ids_of_rounds_in_step(tmp_path):
    target = load_model(str(tiny_llama_checkpoint(tmp_path / "target", seed=5)))
    drafter = start_drafter(str(tiny_llama_checkpoint(tmp_path / "drafter", seed=6)), target[0], target[1])
    request = GenerationRequest(prompt_ids=list(range(30, 58)), max_tokens=90)
    runs = []
    for lookahead in (False, True):
        run = Run(target[0], 1, lookahead=lookahead)
        run.engine.drafter, run.engine.copy_drafts = drafter, False  # a drafter whose drafts its target refuses
        run.submit(0, request)
        run.finish()
        runs.append(run)
    assert runs[1].tokens(0) == runs[0].tokens(0) and len(runs[0].tokens(0)) == 90
    assert runs[1].engine.counters.draft_tokens > 0  # it drafted, then stood aside (and probed)
    assert runs[1].engine.ahead.used >= 40  # and ran ahead while aside


def test_a_model_whose_forward_reads_on_the_host_never_runs_ahead(model, monkeypatch):
    monkeypatch.setattr(model, "reads_on_host", True, raising=False)  # a served MoE reading its picks mid-forward
    request = GenerationRequest(prompt_ids=list(range(40, 60)), max_tokens=8, draft=False)
    _, run = replies(model, [request], 1, lookahead=True)
    assert not run.engine.ahead.on and run.engine.ahead.used == 0


def test_the_lookahead_finds_a_family_model_whose_attributes_live_in_its_module_dict(model):
    with pytest.raises(AttributeError):  # what Python 3.12's isinstance on a runtime protocol reads: it misses them
        inspect.getattr_static(model, "kernels")
    assert can_keep_later(model) and Lookahead(model, True).on


def test_missing_members_counts_a_module_dict_member_and_names_what_an_object_lacks(model):
    assert missing_members(model, LookaheadModel) == []  # its `kernels` lives in the module's dict
    stripped = type("Stripped", (), {name: getattr(model, name) for name in ("forward", "keep", "vocab_size")})()
    lacking = missing_members(stripped, Model)
    assert "kernels" in lacking and "new_cache" in lacking and "forward" not in lacking and "keep" not in lacking
    assert "keep_later" in missing_members(stripped, LookaheadModel)  # a protocol's own members and its bases'


def test_rounds_in_step_commit_every_window_in_one_evaluation_not_a_keep_a_stream(model, monkeypatch):
    # a keep of its own waits on the device a stream; the commits wait together for the next round instead
    keeps = []
    monkeypatch.setattr(model, "keep", lambda cache, rows: keeps.append(rows))
    requests = mixed_requests(4, 300, seed=3)
    got, run = replies(model, requests, 4, lookahead=False)
    assert keeps == [] and run.engine.ahead.used == 0
    assert [len(ids) for ids in got] == [request.max_tokens for request in requests]


def test_a_lone_stream_the_lone_guard_runs_plain_still_looks_up_copies_and_each_starts_its_undrafted_count_over():
    from tensorfold_core.lanes.engine import Engine
    from tensorfold_core.lanes.stream import Stream
    from tensorfold_core.lanes.types import TokenEvent

    model, tokenizer, _ = load_model("tiny-llama")
    engine = Engine(model, shared_rounds=True, drafter=start_drafter("tiny-llama-drafter", model, tokenizer),
                    timed=True)
    engine.planner.lone.drafted = lambda stream, band: False  # the lone guard's verdict in every band: plain
    rng = random.Random(4)
    phrase = [rng.randrange(6, 300) for _ in range(7)]
    prompt = [rng.randrange(6, 300) for _ in range(9)] + phrase * 3  # it repeats: copies land where looked up
    got = []
    for request in (GenerationRequest(prompt_ids=prompt, max_tokens=40),
                    GenerationRequest(prompt_ids=prompt, max_tokens=40, draft=False)):
        events, limit = [], len(prompt) + 40
        engine.add(Stream(id=len(got), request=request, cache=model.new_cache(limit), on_event=events.append,
                          limit=limit))
        used = engine.ahead.used
        while not engine.idle():
            engine.round()
        got.append([t for e in events if isinstance(e, TokenEvent) for t in e.token_ids])
        if len(got) == 1:
            sources, ahead = set(engine.counters.by_source), engine.ahead.used - used
    assert got[0] == got[1] and len(got[0]) == 40
    assert engine.drafter.name not in engine.counters.by_source  # the drafter is never asked
    assert sources == {"copy"} and ahead < 20  # copies land, and each one starts the undrafted count over


def test_the_devices_acceptance_and_bonus_draw_are_the_hosts_for_every_window():
    rng = random.Random(5)
    cases = [([], [7]), ([3, 4], [3, 4, 9]), ([3, 4], [5, 4, 9]), ([3, 4, 6], [3, 8, 6, 1])]
    cases += [([rng.randrange(4) for _ in range(d)], [rng.randrange(4) for _ in range(d + 1)])
              for d in range(16) for _ in range(8)]
    for drafts, draws in cases:
        accepted, pending = device_acceptance(mx.array(drafts, mx.uint32), mx.array(draws, mx.uint32))
        a = accepted_prefix(drafts, draws)
        assert (accepted.item(), pending.item()) == (a, draws[a]), (drafts, draws)
