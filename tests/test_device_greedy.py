"""A round whose every draw is plain greedy reads the device's greedy ids instead of its logits rows, and every
reply's ids stay those drawn from the rows on the host: ties, NaNs and infinities included."""

import random

import mlx.core as mx
import numpy as np
import pytest

from tensorfold_core.lanes.ahead import DEVICE_GREEDY_ENV, greedy_ids
from tensorfold_core.lanes.rows import Penalties
from tensorfold_core.lanes.types import GenerationRequest, TokenEvent
from tensorfold_core.loading import load_model
from tensorfold_core.sampling import SamplingParams, draw_greedy
from tensorfold_core.testing import Run


def planted_rows(rows: int, vocab: int, seed: int) -> np.ndarray:
    """Random logits with a planted case per row: a tie for the top, NaNs, only NaN, only -inf, +inf twice, the top
    first or last."""
    rng = np.random.default_rng(seed)
    x = (3 * rng.standard_normal((rows, vocab))).astype(np.float32)
    for r in range(rows):
        top = float(x[r].max()) + 1.0
        i, j = sorted(rng.choice(vocab, 2, replace=False))
        kind = r % 7
        if kind == 0:
            x[r, i] = x[r, j] = top
        elif kind == 1:
            x[r, rng.choice(vocab, vocab // 5)] = np.nan
        elif kind == 2:
            x[r] = np.nan
        elif kind == 3:
            x[r] = -np.inf
        elif kind == 4:
            x[r, i] = x[r, j] = np.inf
        elif kind == 5:
            x[r, 0] = top
        else:
            x[r, -1] = top
    return x


def test_the_device_s_greedy_ids_are_the_host_s_greedy_draws_ties_nans_and_infinities_included():
    for vocab, seed in ((5, 0), (300, 1), (8192, 2)):
        rows = planted_rows(70, vocab, seed)
        assert np.array(greedy_ids(mx.array(rows))).tolist() == draw_greedy(rows)


def mixed(vocab: int, seed: int) -> list[GenerationRequest]:
    """Greedy requests drafted and not, and others whose rows the host must read: seeded, penalised, with logprobs."""
    rng = random.Random(seed)
    out = []
    for i in range(8):
        prompt = [rng.randrange(6, vocab) for _ in range(rng.randrange(2, 20))]
        kind = {3: dict(sampling=SamplingParams(temperature=0.8, seed=11 + i)),
                5: dict(penalties=Penalties(repetition=1.3)), 6: dict(logprobs=2)}.get(i, {})
        out.append(GenerationRequest(prompt_ids=prompt, max_tokens=rng.randrange(4, 20), draft=i % 2 == 0, **kind))
    return out


def replies(model, requests, parallel):
    """Each reply's ids and its logprobs (each token's, where asked), and the engine that drew them."""
    run = Run(model, parallel)
    for sid, request in enumerate(requests):
        run.submit(sid, request)
    while run.waiting or not run.engine.idle():
        run.step()
    logprobs = [[p for e in run.events[sid] if isinstance(e, TokenEvent) for p in e.logprobs or ()]
                for sid in range(len(requests))]
    return [run.tokens(sid) for sid in range(len(requests))], logprobs, run.engine


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-lfm2"])
def test_replies_read_as_greedy_ids_are_those_drawn_from_the_rows_alone_and_beside_others(name, monkeypatch):
    model = load_model(name)[0]
    requests = mixed(300, seed=4)
    monkeypatch.setenv(DEVICE_GREEDY_ENV, "0")
    from_rows, logprobs, engine = replies(model, requests, 1)
    assert engine.id_rounds == 0 and len(logprobs[6]) == len(from_rows[6]) > 0
    monkeypatch.delenv(DEVICE_GREEDY_ENV)
    for parallel in (1, 8):
        from_ids, with_ids, engine = replies(model, requests, parallel)
        assert from_ids == from_rows and with_ids == logprobs  # the rows still read where logprobs are asked
        assert engine.id_rounds > 0  # the greedy streams' rounds (alone, or with only greedy neighbours)
