"""The per-row logits stage: each row processed from its own context, so a window draws what plain rounds draw."""

from __future__ import annotations

import llguidance
import numpy as np
import pytest

from tensorfold_core.lanes.constraints import Grammar
from tensorfold_core.lanes.rows import Penalties, RowStage
from tensorfold_core.lanes.types import GenerationRequest
from tensorfold_core.loading import load_model
from tensorfold_core.sampling import SamplingParams, draw
from tensorfold_core.testing import PROMPT, Run, serial, solo, tiny_llama_checkpoint

VOCAB = 384
PENALTIES = Penalties(presence=0.5, frequency=0.7, repetition=1.4, bias=((7, 3.0), (9, -100.0)))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_llama_checkpoint(tmp_path_factory.mktemp("rows"), seed=7)


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(str(checkpoint))[0]


@pytest.fixture(scope="module")
def digits(checkpoint):
    """A grammar of 3 to 40 digits, on the checkpoint's own tokenizer."""
    tokenizer = load_model(str(checkpoint))[1]
    guidance = llguidance.LLTokenizer(tokenizer.backend.to_str(), eos_token=sorted(tokenizer.eos_ids))
    return Grammar(llguidance.LLMatcher.grammar_from_regex("[0-9]{3,40}"), guidance), tokenizer


def test_a_window_s_draws_equal_each_row_drawn_alone_from_its_own_context():
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(6, VOCAB)).astype(np.float32) * 3
    params = SamplingParams(temperature=0.9, seed=5)
    window = RowStage(PROMPT, VOCAB, PENALTIES, logprobs=2)
    plain = RowStage(PROMPT, VOCAB, PENALTIES, logprobs=2)
    alone = []
    for i, row in enumerate(rows):  # plain rounds: one row each, its draw committed before the next
        token = draw(plain.process(row), params, seed=5, position=40 + i)
        alone.append(token)
        plain.commit([token])
    draws, logprobs = window.verify(rows, alone[:5], params, seed=5, position=40)
    assert draws == alone and [e.token for e in logprobs] == alone
    cut, _ = window.verify(rows, alone[:2] + [(alone[2] + 1) % VOCAB, alone[3]], params, seed=5, position=40)
    assert cut == alone[:3]  # up to and including the first draw that differs from its draft


def test_a_repetition_penalty_near_zero_sends_a_seen_positive_logit_to_inf_without_a_warning():
    import warnings

    stage = RowStage([5], VOCAB, Penalties(repetition=1e-308))
    row = np.zeros(VOCAB, np.float32)
    row[5] = 3.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = stage.process(row)
    assert out[5] == np.inf and np.isfinite(np.delete(out, 5)).all()
    assert draw(out, SamplingParams(), seed=None, position=0) == 5


def test_penalties_and_bias_follow_the_openai_and_vllm_rules():
    row = np.linspace(-2, 2, VOCAB).astype(np.float32)
    stage = RowStage([20, 21], VOCAB, PENALTIES)
    stage.commit([30, 30, 300])
    out = stage.process(row)
    assert out[7] == pytest.approx(row[7] + 3.0) and out[9] == pytest.approx(row[9] - 100.0)
    assert out[20] == pytest.approx(row[20] * 1.4)  # negative prompt logit: times the repetition penalty
    assert out[30] == pytest.approx(row[30] * 1.4 - 2 * 0.7 - 0.5)
    assert out[300] == pytest.approx(row[300] / 1.4 - 0.7 - 0.5)  # positive: divided
    assert out[100] == row[100]
    assert np.array_equal(stage.process(row, [300]), RowStage([20, 21], VOCAB, PENALTIES).process(row, [30, 30, 300, 300]))


def test_a_stage_without_penalties_keeps_no_counts_and_each_penalty_alone_counts_the_prompt_and_commits():
    row = np.linspace(-2, 2, VOCAB).astype(np.float32)
    bias_only = RowStage([20, 21], VOCAB, Penalties(bias=((7, 3.0),)))
    bias_only.commit([30, 30, 300])
    assert bias_only.counts.size == bias_only.seen.size == 0  # a plain stream's commit touches no vocabulary array
    out = bias_only.process(row)
    assert out[7] == pytest.approx(row[7] + 3.0) and np.array_equal(np.delete(out, 7), np.delete(row, 7))
    for penalty, at_30 in ((Penalties(frequency=0.7), row[30] - 2 * 0.7), (Penalties(presence=0.5), row[30] - 0.5),
                           (Penalties(repetition=1.4), row[30] * 1.4)):
        stage = RowStage([20, 21], VOCAB, penalty)
        stage.commit([30, 30, 300])
        assert stage.process(row)[30] == pytest.approx(at_30)
        assert stage.seen[20] and stage.counts[20] == 0  # the prompt is seen, never counted


def test_a_grammar_masks_each_row_and_cuts_the_drafts_it_refuses(digits):
    grammar, tokenizer = digits
    stage = RowStage(PROMPT, VOCAB, grammar=grammar)
    allowed = np.isfinite(stage.process(np.zeros(VOCAB, dtype=np.float32)))
    assert allowed.any() and all(tokenizer.decode([t]).isdigit() for t in np.nonzero(allowed)[0])
    one, two = tokenizer.encode("1"), tokenizer.encode("2")
    letter = tokenizer.encode("a")
    assert stage.legal(one + two + letter + one) == one + two
    assert stage.legal(letter) == []


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, seed=9)])
def test_constrained_penalised_streams_with_copy_drafts_equal_their_serial_runs(model, digits, sampling):
    grammar = digits[0]
    prompt = PROMPT + PROMPT[:8]  # a repeat, so copy drafts are offered
    requests = [GenerationRequest(prompt_ids=prompt, max_tokens=24, sampling=sampling, penalties=PENALTIES,
                                  logprobs=3),
                GenerationRequest(prompt_ids=prompt, max_tokens=24, sampling=sampling, grammar=grammar),
                GenerationRequest(prompt_ids=prompt, max_tokens=24, sampling=sampling)]
    run = Run(model, parallel=3)
    for sid, request in enumerate(requests):
        run.submit(sid, request)
    run.finish()
    for sid, request in enumerate(requests):
        assert run.tokens(sid) == solo(model, serial(request)), f"stream {sid}"
    assert sum(run.done(sid).usage["tensorfold"]["drafted"] for sid in range(3)) > 0


def test_a_prefill_group_reads_its_prompt_once_and_each_stream_equals_its_solo_run(model):
    prompt = PROMPT * 2
    requests = [GenerationRequest(prompt_ids=prompt, max_tokens=12, prefill_group="g",
                                  sampling=SamplingParams(temperature=1.0, seed=3 + i)) for i in range(3)]
    run = Run(model, parallel=3, chunk=8)
    for sid, request in enumerate(requests):
        run.submit(sid, request)
    run.finish()
    assert [run.done(sid).usage["prompt_tokens_details"]["cached_tokens"] for sid in range(3)] \
        == [0, len(prompt) - 1, len(prompt) - 1]
    for sid, request in enumerate(requests):
        alone = GenerationRequest(prompt_ids=prompt, max_tokens=12, sampling=request.sampling)
        assert run.tokens(sid) == solo(model, alone), f"stream {sid}"
