"""Keyed sampling: each draw a fixed function of seed, position and logits."""

import numpy as np
import pytest

from tensorfold_core.sampling import (SamplingParams, draw, draw_rows, filtered_logprobs, greedy_token,
                                      keyed_gumbel, seed_from_prompt)


@pytest.fixture
def logits():
    return np.random.default_rng(0).normal(size=512).astype(np.float32) * 3


def test_greedy_ties_go_to_the_lowest_id():
    row = np.array([0.0, 2.0, 5.0, 5.0, 1.0], dtype=np.float32)
    assert greedy_token(row) == 2
    assert draw_rows(np.stack([row, row[::-1]]), SamplingParams(), 0, 0) == [2, 1]


def test_a_nan_never_wins_the_greedy_draw():
    row = np.array([1.0, np.nan, 0.5], dtype=np.float32)
    assert greedy_token(row) == 0


def test_rows_with_nans_draw_as_if_the_nans_were_minus_infinity_and_rows_without_are_untouched():
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((5, 300)).astype(np.float32)
    rows[1, 7] = np.nan  # a NaN ahead of the maximum: NumPy's own argmax would pick it
    rows[2, :] = np.nan  # nothing but NaN: the lowest id
    rows[3, 40] = rows[3, 90] = rows[3].max() + 1  # a tie after a NaN
    rows[3, 5] = np.nan
    clean = np.where(np.isnan(rows), -np.inf, rows)
    assert draw_rows(rows, SamplingParams(), 0, 0) == [int(t) for t in np.argmax(clean, axis=-1)]
    assert draw_rows(rows, SamplingParams(), 0, 0)[2:4] == [0, 40]


def test_a_seeded_draw_repeats_exactly_and_depends_on_seed_and_position(logits):
    params = SamplingParams(temperature=1.0, seed=7)
    first = [draw(logits, params, 7, p) for p in range(64)]
    assert first == [draw(logits, params, 7, p) for p in range(64)]
    assert first != [draw(logits, params, 8, p) for p in range(64)]
    assert len(set(first)) > 1  # the position moves the noise


def test_a_draw_ignores_everything_but_its_key(logits):
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=3)
    rows = np.stack([logits, logits * 0.5, logits])
    drawn = draw_rows(rows, params, 3, 100)
    assert drawn[0] == draw(logits, params, 3, 100)
    assert drawn[2] == draw(logits, params, 3, 102)


def test_the_noise_of_a_token_does_not_depend_on_the_vocabulary_size():
    small = keyed_gumbel(5, 9, np.arange(100))
    large = keyed_gumbel(5, 9, np.arange(1000))
    assert np.array_equal(small, large[:100])


def test_top_k_keeps_exactly_k_tokens_and_ties_keep_lower_ids():
    row = np.array([1.0, 3.0, 3.0, 3.0, 0.0])
    kept = np.isfinite(filtered_logprobs(row, SamplingParams(temperature=1.0, top_k=2)))
    assert kept.tolist() == [False, True, True, False, False]


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    kept = np.isfinite(filtered_logprobs(np.log(probs), SamplingParams(temperature=1.0, top_p=0.75)))
    assert kept.tolist() == [True, True, False, False]


def test_min_p_drops_tokens_below_the_fraction_of_the_best():
    probs = np.array([0.6, 0.3, 0.07, 0.03])
    kept = np.isfinite(filtered_logprobs(np.log(probs), SamplingParams(temperature=1.0, min_p=0.1)))
    assert kept.tolist() == [True, True, True, False]


def test_sampled_draws_follow_the_distribution(logits):
    params = SamplingParams(temperature=1.0)
    probs = np.exp(filtered_logprobs(logits[:8], params))
    counts = np.bincount([draw(logits[:8], params, 11, p) for p in range(4000)], minlength=8) / 4000
    assert np.abs(counts - probs).max() < 0.03


def test_a_request_without_seed_gets_one_derived_from_its_prompt():
    assert seed_from_prompt([1, 2, 3]) == seed_from_prompt([1, 2, 3])
    assert seed_from_prompt([1, 2, 3]) != seed_from_prompt([1, 2, 4])
