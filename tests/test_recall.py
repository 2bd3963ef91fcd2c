"""Recall: copies from kept prompt states after the stream's own context; copy windows priced by the stream's own
history of each source."""

from __future__ import annotations

import random

import pytest

from tensorfold_core.lanes.copy import CONTEXT, RECALL, CopyProposer, Recall
from tensorfold_core.lanes.engine import Engine
from tensorfold_core.lanes.guards import Ask, DraftPlanner, Verified
from tensorfold_core.lanes.types import GenerationRequest
from tensorfold_core.loading import load_model
from tensorfold_core.protocols import DraftAsk
from tensorfold_core.sampling import SamplingParams
from tensorfold_core.testing import Run, serial, solo, tiny_llama_checkpoint


def test_recall_copies_the_continuation_of_the_contexts_suffix_from_a_kept_states_tokens():
    kept = [(1, 2, 3, 4, 5, 6, 7, 8)]
    recall = Recall(lambda: kept)
    assert recall.lookup([9, 9, 3, 4], 3) == [5, 6, 7]
    assert recall.lookup([9, 9, 9, 8], 3) == []  # a state's last token has no continuation
    assert recall.lookup([40, 41], 3) == []


def test_recall_takes_the_longest_match_first_then_the_newest_state():
    kept = [(1, 2, 3, 4, 50), (7, 3, 4, 60), (8, 3, 4, 70)]
    recall = Recall(lambda: kept)
    assert recall.lookup([2, 3, 4], 1) == [50]  # a 3-token match in the oldest beats 2-token ones
    assert recall.lookup([9, 3, 4], 1) == [70]  # 2-token matches: the newest state's
    kept.pop()  # a state given up is no longer searched
    assert recall.lookup([9, 3, 4], 1) == [60]


def test_the_copy_proposer_copies_from_the_streams_own_context_first_then_recalls():
    kept = [(5, 6, 7, 8, 9)]
    proposer = CopyProposer(lambda: kept)
    own = proposer.propose([DraftAsk(0, [5, 6, 30, 31, 5, 6], 2)])
    assert own == [[30, 31]] and proposer.source(0) == CONTEXT
    recalled = proposer.propose([DraftAsk(1, [40, 41, 6, 7], 2)])
    assert recalled == [[8, 9]] and proposer.source(1) == RECALL
    assert CopyProposer().propose([DraftAsk(1, [40, 41, 6, 7], 2)]) == [[]]  # without kept states: none


def test_the_copy_proposer_lists_the_kept_states_once_a_round_whatever_its_streams():
    listed = []
    kept = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6]]
    proposer = CopyProposer(lambda: listed.append(1) or kept)
    asks = [DraftAsk(i, [20 + i, 21 + i, 3, 4], 3) for i in range(8)]  # no stream's own context holds its suffix
    assert proposer.propose(asks) == [[5, 6, 7]] * 8 and len(listed) == 1
    assert proposer.propose([DraftAsk(9, [3, 4, 40, 3, 4], 2)]) == [[40, 3]] and len(listed) == 1  # its own first


def test_a_streams_copy_windows_are_priced_by_its_own_history_of_each_source():
    planner = DraftPlanner(timed=False)
    recall, context = Ask(0, 7, 100, copy=True, source=RECALL), Ask(0, 7, 100, copy=True, source=CONTEXT)
    first = planner.plan([recall])[0]
    planner.observe([Verified(first, 0, 1)])
    for _ in range(6):  # its recalled copies break at the first row
        depth = planner.plan([recall])[0]
        planner.observe([Verified(depth, 0, 1)])
    assert planner.plan([recall])[0] < first
    planner.observe([Verified(0, 0, 1)])
    assert planner.plan([context])[0] == first  # its own context's copies keep the prior's price
    planner.observe([Verified(0, 0, 1)])
    other = DraftPlanner(timed=False)
    assert other.plan([Ask(1, 7, 100, copy=True, source=RECALL)])[0] == first  # and another stream's recall too


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tiny_llama_checkpoint(tmp_path_factory.mktemp("recall"), seed=5)
    return load_model(str(path))[0]


def test_a_repeated_request_recalls_the_earlier_reply_and_its_replies_equal_the_serial_ones(model):
    rng = random.Random(7)
    prompt = [rng.randrange(6, 384) for _ in range(12)]
    greedy = GenerationRequest(prompt_ids=prompt, max_tokens=24)
    requests = [greedy, greedy, GenerationRequest(prompt_ids=prompt, max_tokens=24,
                                                  sampling=SamplingParams(temperature=0.9, seed=3))]
    kept, sources, rounds = [], [], []
    for request in requests:
        run = Run(model, 1)
        run.engine = Engine(model, prefill_chunk=8, recall=lambda: kept)
        run.submit(0, request)
        while run.waiting or not run.engine.idle():
            run.admit()
            run.engine.round()
            sources += [(t.source, len(t.drafts)) for t in run.engine._asked if t.drafts]
        assert run.tokens(0) == solo(model, serial(request))
        rounds.append(run.done(0).usage["tensorfold"]["rounds"])
        kept.append(tuple(prompt + run.tokens(0)))  # the host keeps a finished stream's tokens with its state
    # the repeated reply's first drafts came from the first one's kept tokens (then its own context's loop took over)
    assert sum(n for source, n in sources if source == "recall") >= 3 and rounds[1] < rounds[0]
