"""The llama drafter in the lane core: a probe after a stand-aside catches up a bounded tail, and stays exact."""

from __future__ import annotations

import pytest

from tensorfold_core.checkpoint import Checkpoint
from tensorfold_core.lanes.aside import FIRST_GAP
from tensorfold_core.lanes.guards import PROBE_CATCH_UP
from tensorfold_core.protocols import MAX_DRAFT_DEPTH
from tensorfold_core.lanes.types import GenerationRequest
from tensorfold_core.sampling import SamplingParams
from tensorfold_core.specs import DrafterOptions
from tensorfold_core.testing import PROMPT, Run, serial, solo
from tensorfold_llama.drafter import start
from tensorfold_llama.load import load


@pytest.fixture(scope="module")
def pair(checkpoints):
    """A target and a drafter of another seed: its drafts rarely land, so streams stand aside and probe."""
    target = load(Checkpoint.open(checkpoints("gqa-tied")))
    return target, Checkpoint.open(checkpoints("drafter-448", seed=1, vocab_size=448))


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, seed=3)])
def test_a_probe_after_a_stand_aside_feeds_the_drafter_a_bounded_tail_and_the_reply_stays_exact(pair, sampling):
    target, drafter_ckpt = pair
    drafter = start(target, drafter_ckpt, DrafterOptions(eos_ids=[]))
    request = GenerationRequest(prompt_ids=PROMPT * 3, max_tokens=FIRST_GAP + 40, sampling=sampling)
    run = Run(target, parallel=1, chunk=64)
    run.engine.drafter, run.engine.copy_drafts = drafter, False  # copy drafts would stand in for the probes
    run.submit(0, request)
    fed = []
    while not run.engine.idle() or run.waiting:
        before = drafter.stats["rows"]
        run.step()
        fed.append(drafter.stats["rows"] - before)
    first = next(i for i, rows in enumerate(fed) if rows)  # the first drafted round reads the whole prompt
    assert fed[first] >= len(request.prompt_ids)
    probes = [rows for rows in fed[first + FIRST_GAP:] if rows]
    assert probes and max(probes) <= PROBE_CATCH_UP + MAX_DRAFT_DEPTH  # not the 64 tokens it stood aside for
    assert run.tokens(0) == solo(target, serial(request))
