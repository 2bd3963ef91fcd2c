"""The lane core's plain rounds: concurrent replies equal solo replies, whoever joins, leaves or is cancelled."""

import random

import pytest

from tensorfold_core.loading import load_model
from tensorfold_core.lanes.types import GenerationRequest
from tensorfold_core.sampling import SamplingParams
from tensorfold_core.testing import Run, serial, solo, tiny_llama_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tiny_llama_checkpoint(tmp_path_factory.mktemp("lanes"), seed=3)
    return load_model(str(path))[0]


def make_requests(n, seed=0):
    rng = random.Random(seed)
    requests = []
    for i in range(n):
        prompt = [rng.randrange(6, 384) for _ in range(rng.randrange(1, 40))]
        sampling = SamplingParams() if i % 2 == 0 else SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i)
        requests.append(GenerationRequest(prompt_ids=prompt, max_tokens=rng.randrange(4, 20), sampling=sampling))
    return requests


@pytest.mark.parametrize("parallel", [1, 2, 4, 8])
def test_every_reply_at_several_concurrent_streams_has_the_token_ids_of_its_solo_run(model, parallel):
    requests = make_requests(8, seed=parallel)
    run = Run(model, parallel)
    for sid, request in enumerate(requests):
        run.submit(sid, request)
    run.finish()
    for sid, request in enumerate(requests):
        assert run.tokens(sid) == solo(model, request), f"stream {sid}"
        assert run.done(sid).finish_reason == "length"
    if parallel > 1:
        assert max(len(rows) for rows in run.round_rows) > 1  # rounds really were shared


def test_streams_joining_between_rounds_and_a_cancelled_neighbour_change_no_reply(model):
    requests = make_requests(5, seed=42)
    run = Run(model, parallel=3)
    run.submit(0, requests[0])
    for _ in range(3):
        run.step()
    run.submit(1, requests[1])
    run.submit(2, requests[2])
    run.step()
    run.submit(3, requests[3])  # queued: the engine is full
    run.step()
    run.engine.cancel(2)
    run.submit(4, requests[4])
    run.finish()
    assert run.done(2).finish_reason == "cancelled"
    for sid in (0, 1, 3, 4):
        assert run.tokens(sid) == solo(model, requests[sid]), f"stream {sid}"


def test_prompt_chunks_interleave_with_decode_rounds(model):
    short = GenerationRequest(prompt_ids=[10, 11], max_tokens=12)
    long = GenerationRequest(prompt_ids=list(range(20, 60)), max_tokens=3)
    run = Run(model, parallel=2, chunk=8)
    run.submit(0, short)
    run.step()
    run.submit(1, long)
    run.finish()
    mixed = [rows for rows in run.round_rows if len(rows) == 2]
    assert any(rows[0] == 1 and rows[1] == 8 for rows in mixed)  # a decode row beside a full prompt chunk
    assert run.tokens(0) == solo(model, short)
    assert run.tokens(1) == solo(model, long)


def test_a_stop_token_ends_the_stream_and_is_not_shown(model):
    request = make_requests(1, seed=5)[0]
    reply = solo(model, request)
    stop = reply[2]
    first = reply.index(stop)
    stopped = GenerationRequest(prompt_ids=request.prompt_ids, max_tokens=request.max_tokens,
                                sampling=request.sampling, stop_token_ids=frozenset({stop}))
    run = Run(model, parallel=1)
    run.submit(0, stopped)
    run.finish()
    assert run.tokens(0) == reply[:first]
    assert run.done(0).finish_reason == "stop"
    assert run.done(0).usage["completion_tokens"] == first + 1


def looping_requests():
    """Prompts that repeat themselves, so copy drafts are offered and some land."""
    base = [[40, 41, 42, 43, 44] * 4, [7, 8, 9] * 6 + [7], [100, 200, 300, 100, 200] * 3]
    requests = []
    for i, prompt in enumerate(base):
        requests.append(GenerationRequest(prompt_ids=prompt, max_tokens=40))
        requests.append(GenerationRequest(prompt_ids=prompt, max_tokens=40,
                                          sampling=SamplingParams(temperature=0.8, seed=i)))
    return requests


@pytest.mark.parametrize("parallel", [1, 2, 4, 8])
def test_copy_drafted_replies_equal_the_serial_reference_for_greedy_and_seeded_sampling(model, parallel):
    requests = looping_requests()
    run = Run(model, parallel)
    for sid, request in enumerate(requests):
        run.submit(sid, request)
    run.finish()
    offered = kept = 0
    for sid, request in enumerate(requests):
        assert run.tokens(sid) == solo(model, serial(request)), f"stream {sid}"
        stats = run.done(sid).usage["tensorfold"]
        offered, kept = offered + stats["drafted"], kept + stats["accepted"]
    assert kept > 0 and offered > kept  # drafts were verified, some landed and some were cut


def test_a_serial_request_carries_no_drafts(model):
    run = Run(model, parallel=1)
    run.submit(0, serial(looping_requests()[0]))
    run.finish()
    assert run.done(0).usage["tensorfold"]["drafted"] == 0
    assert all(rows == [1] for rows in run.round_rows[-5:])
