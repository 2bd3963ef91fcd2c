"""Kept states: a snapshot restores at its own length and at each chunk mark it passed, and resumes like a fresh run."""

from __future__ import annotations

import mlx.core as mx
import pytest

from lfm2_helpers import DRAFTS
from tensorfold_core.checkpoint import Checkpoint
from tensorfold_core.testing import PROMPT
from tensorfold_lfm2.load import load

MARKS = 4


@pytest.fixture(scope="module", params=[False, True], ids=["lfm2", "moe"])
def model(request, checkpoints):
    return load(Checkpoint.open(checkpoints("moe" if request.param else "lfm2", moe=request.param)))


def fed(model, tokens, windows, marks=MARKS, capacity=64):
    """A cache fed `tokens` in windows of the given sizes, each window kept whole."""
    cache, at = model.new_cache(capacity, marks), 0
    for size in windows:
        model.forward([cache], [tokens[at:at + size]], [0])
        model.keep(cache, size)
        at += size
    return cache


def next_rows(model, cache):
    rows = model.forward([cache], [DRAFTS[:3]], [3])
    model.keep(cache, 3)
    return rows


def test_a_snapshot_resumes_at_every_chunk_mark_it_passed_and_at_its_end_like_a_fresh_run(model):
    # windows that straddle marks: the states at 4, 8, 12, 16 lie inside them
    state = fed(model, PROMPT[:18], [3, 7, 1, 7]).snapshot()
    assert state.tokens == 18 and state.points == [4, 8, 12, 16, 18]
    for point in state.points:
        resumed = model.restore(state, 64, point)
        assert resumed.offset == point
        assert mx.array_equal(next_rows(model, resumed), next_rows(model, fed(model, PROMPT[:point], [point])))


def test_a_draft_window_crossing_a_mark_keeps_the_state_at_the_mark_only_if_its_row_is_accepted(model):
    cache = fed(model, PROMPT[:6], [6])
    model.forward([cache], [DRAFTS[:5]], [5])  # rows 6..10: the mark at 8 is the third row, rejected
    model.keep(cache, 1)
    assert cache.snapshot().points == [4, 7]
    model.forward([cache], [DRAFTS[:5]], [5])  # rows 7..11: the mark at 8 is the second row, accepted
    model.keep(cache, 2)
    state = cache.snapshot()
    assert state.points == [4, 8, 9]
    fresh = fed(model, PROMPT[:6] + DRAFTS[:1] + DRAFTS[:1], [8])
    assert mx.array_equal(next_rows(model, model.restore(state, 64, 8)), next_rows(model, fresh))


def test_a_point_asked_for_is_kept_even_inside_a_window_so_a_repeated_prompt_resumes_whole(model):
    prompt = PROMPT[:11]
    cache = model.new_cache(64)
    cache.mark(len(prompt) - 1)  # a repeat of the prompt resumes all but its last token
    model.forward([cache], [prompt], [1])
    model.keep(cache, len(prompt))
    state = cache.snapshot()
    assert state.points == [10, 11] and state.resume_point(len(prompt) - 1) == 10
    fresh = fed(model, prompt[:10], [10])
    assert mx.array_equal(next_rows(model, model.restore(state, 64, 10)), next_rows(model, fresh))


def test_the_resume_point_is_the_longest_restorable_prefix_within_the_limit(model):
    state = fed(model, PROMPT[:14], [14]).snapshot()
    assert [state.resume_point(n) for n in (3, 4, 11, 13, 14, 99)] == [0, 4, 8, 12, 14, 14]
    with pytest.raises(ValueError, match=r"resumes at \[4, 8, 12, 14\], not at 10"):
        model.restore(state, 64, 10)
    with pytest.raises(ValueError, match="capacity 8"):
        model.restore(state, 8, 12)


def test_a_restored_cache_keeps_passing_marks_and_snapshots_again(model):
    state = fed(model, PROMPT[:10], [10]).snapshot()
    resumed = model.restore(state, 64, 8, marks=MARKS)
    model.forward([resumed], [PROMPT[8:18]], [0])
    model.keep(resumed, 10)
    again = resumed.snapshot()
    assert again.points == [4, 8, 12, 16, 18]
    assert mx.array_equal(next_rows(model, model.restore(again, 64, 12)),
                          next_rows(model, fed(model, PROMPT[:12], [12])))


def test_a_snapshot_is_a_copy_the_live_cache_no_longer_changes(model):
    cache = fed(model, PROMPT[:8], [8])
    state = model.snapshot(cache)
    before = [mx.array(a) for a in (*state.keys, *state.conv[8])]
    next_rows(model, cache)
    assert all(mx.array_equal(a, b) for a, b in zip(before, (*state.keys, *state.conv[8])))
    assert model.state_bytes(state) == sum(a.nbytes for a in (*state.keys, *state.values)) + \
        sum(a.nbytes for states in state.conv.values() for a in states)
    assert model.restore(state, 16).offset == 8  # all of its tokens by default
    assert state.keys[0].shape[2] == 8  # trimmed to its tokens, not the cache's capacity


def test_a_kept_state_restores_only_into_the_model_shape_it_came_from(model, checkpoints):
    state = fed(model, PROMPT[:8], [8]).snapshot()
    other = load(Checkpoint.open(checkpoints("lfm2-attention-first", layer_types=["full_attention"] + ["conv"] * 3)))
    with pytest.raises(ValueError, match="cannot restore into a cache of"):
        other.restore(state, 64, 8)


def test_a_snapshot_waits_for_the_window_to_be_kept(model):
    cache = model.new_cache(16)
    model.forward([cache], [[1, 2]], [1])
    with pytest.raises(ValueError, match="keep"):
        cache.snapshot()
