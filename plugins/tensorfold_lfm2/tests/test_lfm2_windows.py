"""Rows are exact however they are windowed: k-row windows, ragged streams, conv states kept at accepted rows."""

from __future__ import annotations

import mlx.core as mx
import pytest

from lfm2_helpers import DRAFTS
from tensorfold_core.checkpoint import Checkpoint
from tensorfold_core.probe import row_invariance
from tensorfold_core.specs import LoadOptions
from tensorfold_core.testing import PROMPT, window_logits as run
from tensorfold_lfm2.load import load

KINDS = [("lfm2", "float32"), ("lfm2", "bfloat16"), ("lfm2", "4-bit"),
         ("moe", "float32"), ("moe", "bfloat16"), ("moe", "4-bit")]


@pytest.fixture(scope="module", params=KINDS, ids=["-".join(kind) for kind in KINDS])
def model(request, checkpoints, converted):
    family, dtype = request.param
    moe = family == "moe"
    if dtype == "4-bit":
        return load(Checkpoint.open(converted(family, moe=moe)), LoadOptions(dtype="bfloat16"))
    return load(Checkpoint.open(checkpoints(family, moe=moe)), LoadOptions(dtype=dtype))


def prefilled(model, tokens=PROMPT[:12], capacity=64, marks=0):
    cache = model.new_cache(capacity, marks)
    model.forward([cache], [tokens], [0])
    model.keep(cache, len(tokens))
    return cache


def steps(model, cache, tokens):
    rows = []
    for token in tokens:
        rows.append(model.forward([cache], [[token]], [1]))
        model.keep(cache, 1)
    return mx.concatenate(rows)


@pytest.mark.parametrize("k", range(1, 9))
def test_a_k_row_window_gives_the_rows_of_k_one_row_steps_bit_for_bit(model, k):
    window = model.forward([prefilled(model)], [DRAFTS[:k]], [k])
    assert mx.array_equal(window, steps(model, prefilled(model), DRAFTS[:k]))


def test_ragged_windows_of_several_streams_give_each_stream_the_rows_it_gets_alone(model):
    streams = [(PROMPT[:12], DRAFTS[:5]), (PROMPT[3:5], DRAFTS[2:3]), (PROMPT[:17], DRAFTS[1:8]), (PROMPT[9:], [9, 9])]
    alone = [model.forward([prefilled(model, p)], [w], [len(w)]) for p, w in streams]
    shared = model.forward([prefilled(model, p) for p, _ in streams], [w for _, w in streams],
                           [len(w) for _, w in streams])
    assert mx.array_equal(shared, mx.concatenate(alone))
    some = model.forward([prefilled(model, p) for p, _ in streams], [w for _, w in streams], [2, 0, 1, 2])
    assert mx.array_equal(some, mx.concatenate([alone[0][-2:], alone[2][-1:], alone[3]]))


@pytest.mark.parametrize("accepted", [0, 1, 2, 5, 6])
def test_keep_leaves_each_conv_state_at_the_last_accepted_row_with_no_second_pass(model, accepted):
    cache = prefilled(model)
    model.forward([cache], [DRAFTS[:6]], [6])
    model.keep(cache, accepted)
    assert cache.offset == 12 + accepted
    after = model.forward([cache], [[11, 12, 13]], [3])
    model.keep(cache, 3)
    fresh = prefilled(model, PROMPT[:12] + DRAFTS[:accepted])
    assert mx.array_equal(after, model.forward([fresh], [[11, 12, 13]], [3]))
    assert all(mx.array_equal(a, b) for a, b in zip(cache.conv, steps_state(model, PROMPT[:12] + DRAFTS[:accepted] +
                                                                            [11, 12, 13])))


def steps_state(model, tokens):
    """The conv states after feeding `tokens` one row at a time."""
    cache = model.new_cache(64)
    steps(model, cache, tokens)
    return cache.conv


def test_chunked_prefill_gives_the_one_shot_last_row_and_the_same_next_step(model):
    one_shot = model.new_cache(64)
    whole = model.forward([one_shot], [PROMPT], [1])
    model.keep(one_shot, len(PROMPT))
    chunked = model.new_cache(64)
    for at, size in ((0, 8), (8, 7)):
        assert model.forward([chunked], [PROMPT[at:at + size]], [0]).shape == (0, model.vocab_size)
        model.keep(chunked, size)
    last = model.forward([chunked], [PROMPT[15:]], [1])
    model.keep(chunked, len(PROMPT) - 15)
    assert mx.array_equal(last, whole)
    next_rows = [model.forward([c], [DRAFTS[:3]], [3]) for c in (one_shot, chunked)]
    assert mx.array_equal(*next_rows)


def test_a_window_past_the_preallocated_rows_grows_the_cache_and_stays_exact(model):
    tokens = (PROMPT * 3)[:60]
    cache = model.new_cache(40)
    model.forward([cache], [tokens[:30]], [0])
    model.keep(cache, 30)
    window = model.forward([cache], [tokens[30:]], [30])  # 30 rows: past capacity and slack
    model.keep(cache, 10)
    assert mx.array_equal(window, run(model, tokens, [1] * 60)[30:])
    model.forward([cache], [[1]], [1])
    with pytest.raises(ValueError, match="capacity 40"):
        model.keep(cache, 1)


def test_a_cache_must_be_kept_before_its_next_forward_and_appear_once(model):
    cache = model.new_cache(16)
    with pytest.raises(ValueError, match="twice"):
        model.forward([cache, cache], [[1], [2]], [1, 1])
    model.forward([cache], [[1, 2]], [1])
    with pytest.raises(ValueError, match="keep"):
        model.forward([cache], [[3]], [1])
    with pytest.raises(ValueError, match="cannot keep 3 rows"):
        model.keep(cache, 3)


def test_forward_ids_with_commit_gives_the_rows_and_the_state_of_forward_and_keep(model):
    streams = [(PROMPT[:12], DRAFTS[:5]), (PROMPT[3:5], DRAFTS[2:3]), (PROMPT[:17], DRAFTS[1:8])]
    kept = [prefilled(model, p) for p, _ in streams]
    rows = model.forward(kept, [w for _, w in streams], [2, 1, 3])
    for cache, (_, window) in zip(kept, streams):
        model.keep(cache, len(window))
    committed = [prefilled(model, p) for p, _ in streams]
    ids = mx.array([t for _, w in streams for t in w], dtype=mx.uint32)
    lazy = model.forward_ids(committed, ids, [len(w) for _, w in streams], [2, 1, 3], commit=True)
    assert mx.array_equal(lazy, rows)
    assert [c.offset for c in committed] == [c.offset for c in kept] and all(c.window is None for c in committed)
    for a, b in zip(committed, kept):
        assert all(mx.array_equal(x, y) for x, y in zip(a.conv, b.conv))
        assert mx.array_equal(model.forward([a], [[11, 12]], [2]), model.forward([b], [[11, 12]], [2]))


def test_a_lazy_chain_of_one_row_forward_ids_gives_the_rows_of_kept_one_row_steps(model):
    chained, stepped = prefilled(model), prefilled(model)
    token, chain = mx.array([DRAFTS[0]], dtype=mx.uint32), []
    for _ in range(4):  # a drafter's chain: each step's argmax feeds the next, nothing evaluated in between
        logits = model.forward_ids([chained], token, [1], [1], commit=True)
        token = mx.argmax(logits, axis=-1).astype(mx.uint32)
        chain.append(logits)
    fed = [DRAFTS[0]] + [int(mx.argmax(rows, axis=-1).item()) for rows in chain[:-1]]
    assert mx.array_equal(mx.concatenate(chain), steps(model, stepped, fed))
    assert chained.offset == stepped.offset == 16


def test_forward_ids_refuses_ids_that_do_not_fill_the_windows(model):
    cache = model.new_cache(16)
    with pytest.raises(ValueError, match="3 ids for windows of 2 rows"):
        model.forward_ids([cache], mx.array([1, 2, 3], dtype=mx.uint32), [2], [1])
    assert cache.window is None and cache.offset == 0


def test_cache_bytes_price_the_keys_values_and_conv_states_a_cache_holds(model):
    cache = model.new_cache(100)
    held = sum(a.nbytes for a in cache.keys + cache.values + cache.conv)
    assert model.cache_bytes(100) == held and cache.conv


def test_the_row_invariance_probe_passes_on_this_backend(model):
    verdict = row_invariance(model)
    assert verdict["row_invariant"], verdict["detail"]
