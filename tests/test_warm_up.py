"""A server's warm-up at load: throwaway requests that build the kernels, and leave no other trace."""

from __future__ import annotations

import mlx.core as mx
import pytest

from tensorfold_core.host import Host
from tensorfold_core.lanes.types import GenerationRequest, SpecCounters
from tensorfold_core.lanes.warm_up import PERIOD, REPLY_TOKENS, WARM_UP_ENV, warm_up, warm_up_prompts, warms_up
from tensorfold_core.loading import start_drafter
from tensorfold_core.options import ServeOptions
from tensorfold_core.sampling import SamplingParams
from tensorfold_core.testing import loaded_tiny_pair, served_by_thread

CHUNK = 16
PROMPT = [5, 9, 13, 17, 5, 9, 13, 17, 21, 25]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return loaded_tiny_pair(tmp_path_factory.mktemp("warm_up"))


def started_host(pair, monkeypatch, warm: bool) -> Host:
    """A host whose engine thread runs, as a server's does, warmed up or not."""
    model, tokenizer, drafter_path = pair
    monkeypatch.setenv(WARM_UP_ENV, "1" if warm else "0")
    drafter = start_drafter(str(drafter_path), model, tokenizer)
    options = ServeOptions(parallel=4, memory_gib=1.0, prompt_cache_gib=0.25, prefill_chunk=CHUNK)
    return Host(model, tokenizer, options, model_id="m", context=512, drafter=drafter, row_invariant=True)


def test_a_server_warms_up_on_a_gpu_and_elsewhere_only_when_told(monkeypatch):
    monkeypatch.delenv(WARM_UP_ENV, raising=False)
    assert warms_up() == (mx.default_device().type == mx.DeviceType.gpu)
    monkeypatch.setenv(WARM_UP_ENV, "1")
    assert warms_up()
    monkeypatch.setenv(WARM_UP_ENV, "0")
    assert not warms_up()


def test_the_long_warm_up_prompt_reads_a_full_chunk_and_part_of_the_next_and_repeats_so_copies_draft():
    long, short = warm_up_prompts(CHUNK, vocab_size=448, context=512)
    assert len(long) == CHUNK + PERIOD
    assert long[PERIOD:] == long[:len(long) - PERIOD]
    assert all(0 < t < 448 for t in long + short)
    assert 0 < len(short) < CHUNK
    tight, _ = warm_up_prompts(CHUNK, vocab_size=448, context=30)
    assert len(tight) + REPLY_TOKENS < 30


def test_each_warm_up_pass_serves_the_rounds_the_first_did_so_the_second_meets_its_shapes_again(pair):
    model, tokenizer, drafter_path = pair
    drafter = start_drafter(str(drafter_path), model, tokenizer)
    try:
        one, two = (warm_up(model, prefill_chunk=CHUNK, context=512, shared_rounds=True, drafter=drafter,
                            passes=passes) for passes in (1, 2))
    finally:
        drafter.close()
    assert one.rounds > 0 and sum(one.drafted.values()) > 0
    assert two.rounds == 2 * one.rounds
    assert two.drafted == {source: 2 * n for source, n in one.drafted.items()}


def test_a_warmed_host_drafted_in_its_warm_up_and_kept_nothing_from_it(pair, monkeypatch):
    host = started_host(pair, monkeypatch, warm=True)
    try:
        report = host.warmed_up
        assert report is not None and report.rounds > 0
        assert sum(report.drafted.values()) > 0, f"the warm-up never verified a draft: {report}"
        assert host.engine.rounds == 0 and host.engine.idle()
        assert host.engine.counters.snapshot() == SpecCounters().snapshot()
        assert host.admission.ledger.held() == 0
        assert not host.admission.prompt_cache.entries and host.drafter.kept_bytes() == 0
        assert host.capabilities()["warm_up_seconds"] == round(report.seconds, 3)
    finally:
        host.close()


def test_a_warmed_host_serves_the_ids_an_unwarmed_one_does_greedy_and_seeded(pair, monkeypatch):
    requests = [GenerationRequest(prompt_ids=PROMPT * 3, max_tokens=24),
                GenerationRequest(prompt_ids=PROMPT, max_tokens=24, sampling=SamplingParams(temperature=0.8, seed=3))]
    replies = {}
    for warm in (False, True):
        host = started_host(pair, monkeypatch, warm)
        try:
            assert (host.warmed_up is not None) == warm
            replies[warm] = [served_by_thread(host, r) for r in requests]
        finally:
            host.close()
    assert replies[True] == replies[False]
    assert all(len(ids) == 24 for ids in replies[True])


def test_an_unwarmed_host_reports_no_warm_up(pair, monkeypatch):
    host = started_host(pair, monkeypatch, warm=False)
    try:
        assert host.warmed_up is None and host.capabilities()["warm_up_seconds"] is None
    finally:
        host.close()
