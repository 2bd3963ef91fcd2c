"""Through the lane engine, copy-drafted replies of both families equal their serial solo runs, whatever runs beside."""

from __future__ import annotations

import random

import pytest

from lfm2_helpers import Spy, solo
from tensorfold_core.checkpoint import Checkpoint
from tensorfold_core.lanes.types import GenerationRequest
from tensorfold_core.sampling import SamplingParams
from tensorfold_core.testing import Run
from tensorfold_lfm2.load import load

KINDS = [("lfm2", "auto"), ("moe", "auto"), ("moe", "4-bit")]


@pytest.fixture(scope="module", params=KINDS, ids=["-".join(kind) for kind in KINDS])
def model(request, checkpoints, converted):
    family, dtype = request.param
    moe = family == "moe"
    path = converted(family, moe=moe) if dtype == "4-bit" else checkpoints(family, moe=moe)
    return Spy(load(Checkpoint.open(path)))


def looping_requests(seed=0):
    """Prompts that repeat themselves, so copy drafts are offered and some land; even greedy, odd seeded."""
    rng = random.Random(seed)
    base = [[40, 41, 42, 43, 44] * 4, [7, 8, 9] * 6 + [7], [100, 200, 300, 100, 200] * 3,
            [rng.randrange(6, 384) for _ in range(9)] * 2]
    requests = []
    for i, prompt in enumerate(base):
        requests.append(GenerationRequest(prompt_ids=prompt, max_tokens=24 + 4 * i))
        requests.append(GenerationRequest(prompt_ids=prompt, max_tokens=30,
                                          sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=i)))
    return requests


@pytest.fixture(scope="module")
def references(model):
    return [solo(model, request) for request in looping_requests()]


@pytest.mark.parametrize("parallel", [1, 2, 4, 8])
def test_copy_drafted_replies_equal_the_serial_solo_runs_for_greedy_and_seeded_sampling(model, references, parallel):
    requests = looping_requests()
    model.keeps.clear()
    run = Run(model, parallel)
    for sid, request in enumerate(requests):
        run.submit(sid, request)
    run.finish()
    offered = kept = 0
    for sid, request in enumerate(requests):
        assert run.tokens(sid) == references[sid], f"stream {sid}"
        assert run.done(sid).finish_reason == "length"
        stats = run.done(sid).usage["tensorfold"]
        offered, kept = offered + stats["drafted"], kept + stats["accepted"]
    assert kept > 0 and offered > kept  # drafts were verified, some landed and some were cut
    assert any(rows < window for rows, window in model.keeps)  # conv states were kept inside a window
    if parallel > 1:
        assert max(len(rows) for rows in run.round_rows) > 1  # rounds really were shared


def test_streams_joining_between_rounds_and_a_cancelled_neighbour_change_no_reply(model, references):
    requests = looping_requests()
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
    run.submit(5, requests[7])
    run.finish()
    assert run.done(2).finish_reason == "cancelled"
    for sid, ref in ((0, 0), (1, 1), (3, 3), (4, 4), (5, 7)):
        assert run.tokens(sid) == references[ref], f"stream {sid}"


def test_prompt_chunks_beside_drafted_windows_change_no_reply(model, references):
    requests = looping_requests()
    long = GenerationRequest(prompt_ids=list(range(20, 180)), max_tokens=6)  # chunks for 20 rounds
    run = Run(model, parallel=2, chunk=8)
    run.submit(0, requests[0])
    run.step()
    run.submit(1, long)
    run.finish()
    assert any(len(rows) == 2 and rows[0] > 1 and rows[1] == 8 for rows in run.round_rows)
    assert run.tokens(0) == references[0]
    assert run.tokens(1) == solo(model, long)
