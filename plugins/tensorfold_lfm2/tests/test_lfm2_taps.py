"""Taps: the lfm2 families hand a drafter the named layers' rows of every row a cache commits, once each."""

from __future__ import annotations

import mlx.core as mx
import pytest

from lfm2_helpers import DRAFTS
from tensorfold_core.checkpoint import Checkpoint
from tensorfold_core.protocols import TappedModel, missing_members
from tensorfold_core.testing import PROMPT
from tensorfold_lfm2.load import load


@pytest.fixture(params=[False, True], ids=["lfm2", "moe"])
def model(request, checkpoints):
    """A model of its own: taps change what every cache of it keeps."""
    loaded = load(Checkpoint.open(checkpoints("moe" if request.param else "lfm2", moe=request.param)))
    yield loaded
    loaded.features([])


def committed(model, windows, marks=0):
    """A cache fed (ids, rows kept) windows in turn."""
    cache = model.new_cache(64, marks)
    for ids, kept in windows:
        model.forward([cache], [ids], [len(ids)])
        model.keep(cache, kept)
    return cache


def test_an_lfm2_model_is_a_tapped_model_of_as_many_taps_as_layers(model):
    assert not missing_members(model, TappedModel) and model.taps == model.args.num_hidden_layers
    assert model.hidden_size == model.args.hidden_size


def test_tapped_rows_are_the_named_layers_rows_of_every_committed_row_however_the_windows_were_cut(model):
    layers, width = [0, 2, model.taps - 1], model.hidden_size
    model.features(layers)
    cache = committed(model, [(PROMPT, len(PROMPT))])
    whole = model.take_features(cache)
    assert whole.start == 0 and whole.rows.shape == (len(PROMPT), len(layers) * width)
    assert model.take_features(cache) is None  # handed over once
    # a prompt chunk, a verify window whose last two drafts were cut, the rest
    cache = committed(model, [(PROMPT[:7], 7), (PROMPT[7:12] + DRAFTS[:2], 5)])
    first = model.take_features(cache)
    model.forward([cache], [PROMPT[12:]], [1])
    model.keep(cache, len(PROMPT) - 12)
    rest = model.take_features(cache)
    assert (first.start, first.rows.shape[0], rest.start) == (0, 12, 12)
    assert mx.array_equal(mx.concatenate([first.rows, rest.rows]), whole.rows)


def test_the_last_layers_tapped_rows_through_the_final_norm_and_head_are_the_forwards_logits(model):
    model.features([model.taps - 1])
    logits = model.forward([model.new_cache(64)], [PROMPT], [len(PROMPT)])
    rows = model.take_features(committed(model, [(PROMPT, len(PROMPT))])).rows
    assert mx.array_equal(model.head(model.model.embedding_norm(rows)), logits)
    assert model.head(model.embed(mx.array(PROMPT[:1]))).shape == (1, model.vocab_size)


def test_without_taps_nothing_is_staged_and_taps_are_priced_in_each_caches_bytes(model):
    plain = model.cache_bytes(100)
    assert model.take_features(committed(model, [(PROMPT, len(PROMPT))])) is None
    model.features([1, 3])
    assert model.cache_bytes(100) - plain == (100 + 16) * 2 * model.hidden_size * model.dtype.size
    model.features([])
    assert model.cache_bytes(100) == plain and model.take_features(committed(model, [(PROMPT, 4)])) is None


def test_features_refuses_a_layer_the_model_lacks_and_a_second_drafters_layers(model):
    with pytest.raises(ValueError, match=f"distinct layer ids in 0..{model.taps - 1}"):
        model.features([0, model.taps])
    model.features([0, 1])
    model.features([0, 1])  # the same drafter again
    with pytest.raises(ValueError, match=r"layers \[0, 1\] are tapped already"):
        model.features([2])


def test_a_kept_state_holds_no_tapped_rows_and_a_restored_cache_stages_from_where_it_resumes(model):
    model.features([1])
    cache = committed(model, [(PROMPT[:8], 8), (PROMPT[8:12], 4)], marks=4)
    state = model.snapshot(cache)
    restored = model.restore(state, 64, 8, marks=4)
    model.forward([restored], [PROMPT[8:14]], [1])
    model.keep(restored, 6)
    taken = model.take_features(restored)
    assert taken.start == 8 and taken.rows.shape[0] == 6
    fresh = model.take_features(committed(model, [(PROMPT[:14], 14)]))
    assert mx.array_equal(taken.rows, fresh.rows[8:])


def test_windows_ending_before_the_tap_bound_keep_no_rows_and_the_rest_keep_the_rows_a_whole_tap_keeps(model):
    model.features([1, model.taps - 1])
    whole = model.take_features(committed(model, [(PROMPT, len(PROMPT))]))
    cache = model.new_cache(64)
    model.tap_from(cache, 9)  # windows [0, 4) and [4, 8) end before it; [8, 12) reaches it
    for start in range(0, len(PROMPT), 4):
        window = PROMPT[start:start + 4]
        model.forward([cache], [window], [0])
        model.keep(cache, len(window))
    bounded = model.take_features(cache)
    assert bounded.start == 8 and mx.array_equal(bounded.rows, whole.rows[8:])
    never = model.new_cache(64)
    model.tap_from(never, 64)
    model.forward([never], [PROMPT], [1])
    model.keep(never, len(PROMPT))
    assert model.take_features(never) is None
