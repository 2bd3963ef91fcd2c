"""Through the lane engine, DSpark-drafted replies equal their serial solo runs; lanes absorb, hold and are kept."""

from __future__ import annotations

import dataclasses
import random

import mlx.core as mx
import pytest

from dspark_helpers import bigrams_of, dspark_config, dspark_weights, tiny_dspark_checkpoint, write_dspark
from lfm2_helpers import solo
from tensorfold_core.checkpoint import Checkpoint
from tensorfold_core.lanes.types import GenerationRequest
from tensorfold_core.loading import start_drafter
from tensorfold_core.protocols import DEPTH_RULE, DraftAsk
from tensorfold_core.sampling import SamplingParams
from tensorfold_core.testing import PROMPT, Run
from tensorfold_dspark.drafter import CATCH_UP_ROWS, HOLD_ROWS
from tensorfold_dspark.lane import Lane
from tensorfold_dspark.model import Block, Span
from tensorfold_lfm2.load import load


def requests():
    """Prompts that repeat themselves and one that does not; even greedy, odd seeded."""
    rng = random.Random(0)
    prompts = [[40, 41, 42, 43, 44] * 4, [7, 8, 9] * 6 + [7], [100, 200, 300, 100, 200] * 3,
               [rng.randrange(6, 384) for _ in range(23)]]
    out = []
    for i, prompt in enumerate(prompts):
        out.append(GenerationRequest(prompt_ids=prompt, max_tokens=20 + 4 * i))
        out.append(GenerationRequest(prompt_ids=prompt, max_tokens=24,
                                     sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=i)))
    return out


@pytest.fixture(scope="module")
def target(target_dir):
    """A target of this module's own: a drafter switches its taps on."""
    return load(Checkpoint.open(target_dir))


@pytest.fixture(scope="module")
def references(target):
    return [solo(target, request) for request in requests()]


@pytest.fixture(scope="module")
def taught_dir(tmp_path_factory, target_dir, references):
    """A drafter whose Markov head knows the references' bigrams, so its drafts land."""
    seen = [r.prompt_ids + ref for r, ref in zip(requests(), references)]
    return tiny_dspark_checkpoint(tmp_path_factory.mktemp("taught") / "taught", target_dir, bigrams=bigrams_of(seen))


@pytest.fixture(scope="module", params=["random", "taught"])
def drafter(request, target, target_dir, dspark_dir, taught_dir):
    path = dspark_dir if request.param == "random" else taught_dir
    started = start_drafter(str(path), target, Checkpoint.open(target_dir).tokenizer())
    started.kind = request.param
    yield started
    started.close()


def drafted_run(target, drafter, parallel):
    run = Run(target, parallel)
    run.engine.drafter = drafter
    return run


@pytest.mark.parametrize("parallel", [1, 4])
def test_dspark_drafted_replies_equal_the_serial_solo_runs_for_greedy_and_seeded_sampling(target, drafter,
                                                                                         references, parallel):
    run = drafted_run(target, drafter, parallel)
    for sid, request in enumerate(requests()):
        run.submit(sid, request)
    run.finish()
    stats = [run.done(sid).usage["tensorfold"] for sid in range(len(references))]
    assert [run.tokens(sid) for sid in range(len(references))] == references
    assert sum(s["drafted"] for s in stats) > 0
    if drafter.kind == "taught":
        assert sum(s["accepted"] for s in stats) > 0
    if parallel > 1:
        assert max(len(rows) for rows in run.round_rows) > 1  # rounds really were shared


def test_streams_joining_between_rounds_and_a_cancelled_neighbour_change_no_reply(target, drafter, references):
    reqs = requests()
    run = drafted_run(target, drafter, 3)
    run.submit(0, reqs[0])
    for _ in range(3):
        run.step()
    run.submit(1, reqs[1])
    run.submit(2, reqs[2])
    run.step()
    run.submit(3, reqs[3])
    run.step()
    run.engine.cancel(2)
    run.submit(4, reqs[4])
    run.submit(5, reqs[7])
    run.finish()
    assert run.done(2).finish_reason == "cancelled"
    for sid, ref in [(0, 0), (1, 1), (3, 3), (4, 4), (5, 7)]:
        assert run.tokens(sid) == references[ref], f"stream {sid}"


def committed_cache(target, tokens):
    """A target cache holding `tokens` (their tapped rows staged), as the lane core leaves one before a round."""
    cache = target.new_cache(64)
    target.forward([cache], [tokens], [0])
    target.keep(cache, len(tokens))
    return cache


def test_prompt_rows_are_absorbed_before_the_chain_and_a_rounds_verified_rows_by_the_next_hold(target, drafter):
    drafter.shed_kept()
    tokens = PROMPT + [9]
    cache = committed_cache(target, PROMPT)
    assert drafter.catch_up([DraftAsk(11, tokens, 3, cache=cache)]) == len(PROMPT) > CATCH_UP_ROWS
    lane = drafter.lanes[11]
    drafts = drafter.propose([DraftAsk(11, tokens, 3, cache=cache)])[0]
    # the round verifies the pending token and one draft
    target.forward([cache], [[9] + drafts], [0])
    target.keep(cache, 2)
    tokens = tokens + [drafts[0] if drafts else 9, 17]
    assert drafter.catch_up([DraftAsk(11, tokens, 3, cache=cache)]) == 0 and lane.n == len(PROMPT)
    drafter.propose([DraftAsk(11, tokens, 3, cache=cache)])
    assert lane.n == lane.whole == len(tokens) - 1 == cache.offset
    drafter.release(11)


def test_the_engine_taps_a_drafting_streams_prompt_from_its_catch_up_bound_and_a_plain_stream_not_at_all(
        target, drafter, monkeypatch):
    monkeypatch.setattr(drafter, "facts", dataclasses.replace(drafter.facts, catch_up=6))
    run = drafted_run(target, drafter, 2)
    run.submit(0, GenerationRequest(prompt_ids=PROMPT, max_tokens=6))
    run.submit(1, GenerationRequest(prompt_ids=PROMPT, max_tokens=6, draft=False))
    run.admit()
    drafting, plain = (run.engine.streams[sid].cache for sid in (0, 1))
    assert (drafting.taps_from, plain.taps_from) == (len(PROMPT) - 6, len(PROMPT) + 6)
    run.finish()
    assert run.tokens(0) == run.tokens(1)  # what a drafter reads never changes a reply
    monkeypatch.setattr(drafter, "facts", dataclasses.replace(drafter.facts, catch_up=0))
    unbounded = drafted_run(target, drafter, 1)
    unbounded.submit(2, GenerationRequest(prompt_ids=PROMPT, max_tokens=2))
    unbounded.admit()
    assert unbounded.engine.streams[2].cache.taps_from == 0
    unbounded.finish()


def test_a_band_running_plain_taps_only_the_rows_its_next_drafted_round_catches_up(target, drafter, monkeypatch):
    monkeypatch.setattr(drafter, "facts", dataclasses.replace(drafter.facts, catch_up=6))
    run = drafted_run(target, drafter, 2)
    run.engine.planner.timed = True
    for sid in (0, 1):
        run.submit(sid, GenerationRequest(prompt_ids=PROMPT, max_tokens=12))
    run.admit()
    band = run.engine.planner.shared._band(2)
    band.drafted, band.running, band.run = False, True, 40  # drafting lost: plain runs 40 rounds
    while any(run.engine.streams[sid].prefilling for sid in (0, 1)):
        run.step()
    run.step()  # a plain round: taps start 6 rows before the run's end
    for sid in (0, 1):
        stream = run.engine.streams[sid]
        left = 40 - band.stretch.rounds
        # tokens and rounds left move together, so the bound set as the round began still holds
        assert stream.cache.taps_from == len(stream.tokens) + left - 6 > stream.cache.offset
    band.run = 4  # a run shorter than the catch-up bound moves nothing
    before = [run.engine.streams[sid].cache.taps_from for sid in (0, 1)]
    run.step()
    assert [run.engine.streams[sid].cache.taps_from for sid in (0, 1)] == before
    run.finish()
    assert run.tokens(0) == run.tokens(1)  # what a drafter reads never changes a reply


def test_a_band_running_plain_looks_up_no_copies_and_one_measuring_drafts_looks_them_up(target, drafter,
                                                                                       monkeypatch):
    run = drafted_run(target, drafter, 2)
    run.engine.planner.timed = True
    looked_up = []
    propose = run.engine.copy.propose
    monkeypatch.setattr(run.engine.copy, "propose", lambda asks: looked_up.append(len(asks)) or propose(asks))
    for sid in (0, 1):
        run.submit(sid, GenerationRequest(prompt_ids=PROMPT * 2, max_tokens=12))
    run.admit()
    band = run.engine.planner.shared._band(2)
    band.drafted, band.running, band.run = False, True, 40  # drafting lost: plain runs 40 rounds
    while any(run.engine.streams[sid].prefilling for sid in (0, 1)):
        run.step()
    looked_up.clear()
    run.step()
    run.step()
    assert looked_up == []
    band.drafted = True  # measuring (or running) drafted: copies go first again
    run.step()
    assert looked_up and all(n >= 1 for n in looked_up)
    run.finish()
    assert run.tokens(0) == run.tokens(1)  # what a drafter reads never changes a reply


def test_a_probe_absorbs_only_its_bound_of_rows_and_still_drafts(target, drafter):
    drafter.shed_kept()  # no kept lane to start from
    cache = committed_cache(target, PROMPT)
    drafts = drafter.propose([DraftAsk(12, PROMPT + [9], 3, catch_up=4, cache=cache)])[0]
    lane = drafter.lanes[12]
    assert (lane.n, lane.end, lane.whole) == (4, len(PROMPT), 0) and 1 <= len(drafts) <= 3
    drafter.release(12)
    assert drafter.kept[-1] is lane  # for the prompt state the host may keep of its stream
    drafter.propose([DraftAsk(13, PROMPT + [9], 1, cache=committed_cache(target, PROMPT))])
    drafter.release(13)
    assert all(kept is not lane for kept in drafter.kept)  # a cut lane has no prefix to share: the next release drops it


def test_a_released_lane_is_taken_over_by_a_stream_sharing_its_prefix_and_gives_way_when_shed(target, drafter):
    drafter.shed_kept()
    drafter.propose([DraftAsk(13, PROMPT + [9], 2, cache=committed_cache(target, PROMPT))])
    drafter.release(13)
    assert drafter.kept_bytes() > 0
    reuses = drafter.stats["lane_reuses"]
    drafter.propose([DraftAsk(14, PROMPT[:12] + [5], 2, cache=committed_cache(target, PROMPT[:12]))])
    assert drafter.stats["lane_reuses"] == reuses + 1 and drafter.lanes[14].n == 12
    drafter.release(14)
    assert drafter.shed_kept() > 0 and drafter.kept_bytes() == 0


@pytest.fixture(scope="module")
def markov_only(tmp_path_factory, target, target_dir):
    """A drafter whose final norm is zero, so the target's head gives zeros and the Markov head alone decides:
    after token 50 it scores ids 70 and 60 equally, after any other token every id ties."""
    config = dspark_config(target_dir)
    weights = dspark_weights(config)
    weights["norm.weight"][:] = 0
    w1, w2 = weights["markov_head.markov_w1.weight"], weights["markov_head.markov_w2.weight"]
    w1[:], w2[:] = 0, 0
    w1[50, 0], w2[70, 0], w2[60, 0] = 8.0, 8.0, 8.0
    path = write_dspark(tmp_path_factory.mktemp("markov") / "markov", target_dir, config, weights)
    started = start_drafter(str(path), target, Checkpoint.open(target_dir).tokenizer())
    yield started
    started.close()


def test_the_markov_head_picks_each_draft_after_the_one_before_it_ties_going_to_the_lowest_id(target, markov_only):
    tokens = PROMPT + [50]
    drafts = markov_only.propose([DraftAsk(21, tokens, 4, cache=committed_cache(target, PROMPT))])[0]
    assert drafts == [60, 0]  # 60 over 70; then every id ties: 0, the eos, which ends the chain
    chances = markov_only.chances(21)
    assert len(chances) == 2 and 1 >= chances[0] >= chances[1] > 0  # a running product of sigmoids
    markov_only.release(21)


def test_each_block_row_sees_the_whole_context_and_every_row_of_its_block(drafter):
    model, rng = drafter.model, mx.random.key(3)
    lane = Lane(*drafter.shape, 64, drafter.dtype)
    context = model.context_rows(mx.random.normal((6, 3 * 64), key=rng))
    for layer, per_span in enumerate(model.context(context, [(0, 6, 0)])):
        lane.write(layer, *per_span[0])
    lane.advance(0, 6)
    h = mx.random.normal((4, 64), key=mx.random.key(4))
    four = model.blocks(h, [Block(0, 4, 6, lane)])
    one = model.blocks(h[:1], [Block(0, 1, 6, lane)])
    assert not mx.allclose(four[0], one[0])  # row 0 read the rows after it: the block is not causal
    lane.n = 3
    assert not mx.allclose(model.blocks(h, [Block(0, 4, 6, lane)])[0], four[0])  # and it read the context


def test_every_span_s_rows_roped_in_one_call_give_the_bits_of_a_rope_a_span(drafter):
    from tensorfold_dspark.model import block_attention

    model = drafter.model
    attn = model.layers[0].self_attn
    lanes = [Lane(*drafter.shape, 64, drafter.dtype) for _ in range(3)]
    context = model.context_rows(mx.random.normal((9, 3 * 64), key=mx.random.key(5)))
    spans = [Span(0, 4, 0), Span(4, 2, 17), Span(6, 3, 40)]  # three lanes' fresh rows at their own positions
    keys, values = attn.keys_values(context)
    for (start, n, offset), (k, v) in zip(spans, attn.context(context, spans)):
        assert mx.array_equal(k, attn.rope(keys[start:start + n][None].transpose(0, 2, 1, 3), offset)).item()
        assert mx.array_equal(v, values[start:start + n][None].transpose(0, 2, 1, 3)).item()
    per_layer = model.context(context, spans)
    for j, (lane, span) in enumerate(zip(lanes, spans)):
        for layer, per_span in enumerate(per_layer):
            lane.write(layer, *per_span[j])
        lane.advance(span.offset, span.n)
    h = mx.random.normal((7, 64), key=mx.random.key(6))
    blocks = [Block(0, 4, 4, lanes[0]), Block(4, 1, 19, lanes[1]), Block(5, 2, 43, lanes[2])]
    at_once = attn(h, blocks, 0)
    # an `attend` set takes the rope a block path; this one is MLX's own block attention in the record's layout
    attn.attend = lambda q, ck, cv, n, k, v, scale: block_attention(
        q.transpose(1, 0, 2)[None], ck, cv, n, k, v, scale)[0].transpose(1, 0, 2)
    try:
        assert mx.array_equal(at_once, attn(h, blocks, 0)).item()
    finally:
        attn.attend = None


# ---- chances and grants (the test drafters' confidence heads are random: they say little of what lands) ----

def test_a_streams_chances_are_the_running_product_of_its_drafts_confidences(target, drafter):
    drafter.shed_kept()
    tokens = PROMPT + [9]
    drafts = drafter.propose([DraftAsk(15, tokens, 6, cache=committed_cache(target, PROMPT))])[0]
    model, lane = drafter.model, drafter.lanes[15]
    ids = mx.array([9] + [drafter.mask_id] * (len(drafts) - 1), dtype=mx.uint32)
    final = model.blocks(target.embed(ids), [Block(0, len(drafts), len(PROMPT), lane)])
    previous = mx.array([9] + drafts[:-1], dtype=mx.uint32)
    confidences = model.confidence(final, previous).tolist()
    running, want = 1.0, []
    for confidence in confidences:
        running *= confidence
        want.append(running)
    assert len(drafts) >= 2 and drafter.chances(15) == pytest.approx(want, rel=1e-5)
    drafter.release(15)
    assert drafter.chances(15) is None


def granted_run(target, drafter, parallel):
    """A run whose planner records each round's grants: (drafts held, drafts granted) per held window."""
    run = drafted_run(target, drafter, parallel)
    planner, grants = run.engine.planner, []
    grant = planner.grant

    def recorded(held, other):
        out = grant(held, other)
        grants.extend((h.drafts, g) for h, g in zip(held, out) if h is not None)
        return out
    planner.grant = recorded
    return run, grants


@pytest.mark.parametrize("parallel", [1, 4])
def test_with_the_confidence_head_the_lane_core_grants_verify_rows_and_replies_stay_exact(target, drafter, references,
                                                                                          parallel):
    assert drafter.facts.chances and drafter.facts.hold_rows == HOLD_ROWS
    run, grants = granted_run(target, drafter, parallel)
    for sid, request in enumerate(requests()):
        run.submit(sid, request)
    run.finish()
    assert [run.tokens(sid) for sid in range(len(references))] == references
    assert grants and all(0 <= granted <= held for held, granted in grants)
    assert any(held > 1 for held, _ in grants)  # holds grew past a stretch's first one


@pytest.fixture(scope="module")
def headless(tmp_path_factory, target, target_dir):
    """A drafter checkpoint without the confidence head."""
    path = tiny_dspark_checkpoint(tmp_path_factory.mktemp("headless") / "headless", target_dir, confidence=False)
    started = start_drafter(str(path), target, Checkpoint.open(target_dir).tokenizer())
    yield started
    started.close()


@pytest.mark.parametrize("parallel", [1, 4])
def test_a_checkpoint_without_the_confidence_head_verifies_by_the_depth_rule(target, headless, references, parallel):
    assert headless.facts == dataclasses.replace(DEPTH_RULE, kept_context=True, hold_ahead=True)
    run, grants = granted_run(target, headless, parallel)
    for sid, request in enumerate(requests()):
        run.submit(sid, request)
    run.finish()
    assert [run.tokens(sid) for sid in range(len(references))] == references
    assert grants == [] and sum(run.done(sid).usage["tensorfold"]["drafted"] for sid in range(len(references))) > 0
