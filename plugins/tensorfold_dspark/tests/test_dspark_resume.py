"""A kept prompt state holds the drafting stream's lane, so a stream that resumes it drafts from its whole context."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tensorfold_core.checkpoint import Checkpoint
from tensorfold_core.host import Host
from tensorfold_core.lanes.types import DoneEvent, GenerationRequest, TokenEvent
from tensorfold_core.loading import start_drafter
from tensorfold_core.memory.ledger import GIB
from tensorfold_core.options import ServeOptions
from tensorfold_core.specs import DrafterOptions
from tensorfold_dspark.lane import Lane
from tensorfold_lfm2.load import load

PROMPT = [40, 41, 42, 43, 44, 45] * 6  # under the drafter's catch-up bound, so a fresh lane holds all of it


@pytest.fixture(scope="module")
def target(target_dir):
    return load(Checkpoint.open(target_dir))


def make_host(target, target_dir, dspark_dir, prompt_cache_bytes: int) -> Host:
    """A host of its own drafter: lanes kept by one host never reach the other."""
    tokenizer = Checkpoint.open(target_dir).tokenizer()
    drafter = start_drafter(str(dspark_dir), target, tokenizer, DrafterOptions(max_kept=2))
    options = ServeOptions(parallel=2, memory_gib=1.0, prompt_cache_gib=prompt_cache_bytes / GIB, prefill_chunk=16)
    return Host(target, tokenizer, options, model_id="m", context=256, row_invariant=True, start=False,
                drafter=drafter, timed=False)


def serve(host: Host, prompt: list[int], draft: bool = True) -> tuple[list[int], dict]:
    """One greedy request run inline on the host's engine: its token ids and usage."""
    events = []
    host.submit(GenerationRequest(prompt_ids=prompt, max_tokens=16, draft=draft), events.append)
    while not any(isinstance(e, DoneEvent) for e in events):
        host._drain_inbox()
        host._admit()
        host.engine.round()
    done = next(e for e in events if isinstance(e, DoneEvent))
    return [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids], done.usage


def kept_lane(host: Host) -> Lane:
    """The lane of the newest kept prompt state."""
    newest = max(host.admission.prompt_cache.entries.values(), key=lambda e: e.last_used)
    return newest.context.lane


def rows(lane: Lane, n: int) -> list[np.ndarray]:
    return [np.array(a[..., :n, :].astype(mx.float32)) for a in lane.keys + lane.values]


def test_a_kept_prompt_state_holds_its_streams_lane_to_its_last_token_and_the_ledger_counts_it(target, target_dir,
                                                                                              dspark_dir):
    host = make_host(target, target_dir, dspark_dir, GIB // 8)
    try:
        serve(host, PROMPT)
        (entry,) = host.admission.prompt_cache.entries.values()
        lane = entry.context.lane
        assert entry.context.tokens == len(entry.tokens) == lane.n == lane.whole  # the last round's rows too
        assert lane.spans == [(0, lane.n)] and lane.stream is None
        assert entry.nbytes == target.state_bytes(entry.state) + lane.nbytes
        assert host.ledger.by_kind()["kept_state"] == host.admission.prompt_cache.held()
        assert not any(kept.stream is not None and kept.n == lane.n for kept in host.drafter.kept)  # moved, not copied
        serve(host, [7, 8, 9] * 5, draft=False)
        undrafted = max(host.admission.prompt_cache.entries.values(), key=lambda e: e.last_used)
        assert undrafted.context is None  # a stream that never drafted has no lane to keep
    finally:
        host.close()


def test_a_resumed_drafting_stream_starts_from_the_kept_lane_and_ends_with_the_fresh_streams_context(
        target, target_dir, dspark_dir):
    fresh_host = make_host(target, target_dir, dspark_dir, 0)
    resumed_host = make_host(target, target_dir, dspark_dir, GIB // 8)
    try:
        reply, _ = serve(fresh_host, PROMPT)
        assert serve(resumed_host, PROMPT)[0] == reply
        next_turn = PROMPT + reply + [60, 61, 62, 63]
        fresh_host.drafter.shed_kept()  # the fresh stream absorbs its whole prompt itself
        resumed_host.drafter.shed_kept()  # only the prompt state's lane can give the resumed stream its context
        fresh, _ = serve(fresh_host, next_turn)
        resumes = resumed_host.drafter.stats["lane_resumes"]
        resumed, usage = serve(resumed_host, next_turn)
        assert resumed == fresh
        assert usage["prompt_tokens_details"]["cached_tokens"] == len(PROMPT) + len(reply) - 1
        assert resumed_host.drafter.stats["lane_resumes"] == resumes + 1
        (fresh_lane,) = [kept for kept in fresh_host.drafter.kept if kept.n]
        resumed_lane = kept_lane(resumed_host)
        # every position, no cut; the kept one to the state's end, the fresh one to its last hold
        assert resumed_lane.spans == [(0, resumed_lane.n)] and fresh_lane.spans == [(0, fresh_lane.n)]
        assert fresh_lane.n <= resumed_lane.n
        for a, b in zip(rows(resumed_lane, fresh_lane.n), rows(fresh_lane, fresh_lane.n)):
            np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2)  # rows absorbed in other packs
    finally:
        fresh_host.close()
        resumed_host.close()


def test_a_lane_copy_keeps_the_rows_before_a_position_cuts_and_all():
    lane = Lane(1, 1, 2, 32, mx.float32)
    for start, n in ((0, 4), (10, 3), (13, 2)):  # a cut after position 3
        rows_in = mx.arange(start, start + n, dtype=mx.float32).reshape(1, 1, n, 1) * mx.ones((1, 1, n, 2))
        lane.write(0, rows_in, rows_in)
        lane.advance(start, n)
    assert (lane.n, lane.whole, lane.end, lane.spans) == (9, 4, 15, [(0, 4), (10, 5)])
    copy = lane.copy(12, 16, mx.float32)
    assert (copy.n, copy.whole, copy.end, copy.spans) == (6, 4, 12, [(0, 4), (10, 2)])
    assert copy.keys[0][0, 0, :6, 0].tolist() == [0, 1, 2, 3, 10, 11]
    assert lane.copy(3, 16, mx.float32).spans == [(0, 3)] and lane.copy(8, 16, mx.float32).n == 4


def test_a_lane_whose_state_the_prompt_cache_refuses_goes_back_to_the_kept_lanes_and_the_ledger(target, target_dir,
                                                                                                 dspark_dir):
    host = make_host(target, target_dir, dspark_dir, 1)  # a cap no state fits
    try:
        serve(host, PROMPT)
        assert not host.admission.prompt_cache.entries
        (returned,) = [kept for kept in host.drafter.kept if kept.stream is None]
        assert returned.n == returned.whole == len(returned.tokens)  # the copy made for the state, whole
        assert host.ledger.by_kind()["kept_drafter_slots"] == host.drafter.kept_bytes() > 0
    finally:
        host.close()
