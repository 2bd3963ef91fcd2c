"""MLX's MoE experts on the CPU: every expert over a wide window's rows gives each row's picks the bits of one product a
pick, so replies are unchanged whichever way a window runs; the load times which is faster and the knob overrides."""

from __future__ import annotations

import mlx.core as mx
import pytest

from lfm2_helpers import solo
from tensorfold_core.checkpoint import Checkpoint
from tensorfold_core.errors import CheckpointError
from tensorfold_core.lanes.types import GenerationRequest
from tensorfold_core.sampling import SamplingParams
from tensorfold_core.specs import LoadOptions
from tensorfold_core.testing import Run
from tensorfold_lfm2 import lfm2_moe
from tensorfold_lfm2.load import load
from tensorfold_lfm2.lfm2_moe import ALL_EXPERTS_ENV, ALL_EXPERTS_ROWS, SparseMoeBlock


def glus(model) -> list:
    return [layer.feed_forward.switch_mlp for layer in model.model.layers
            if isinstance(layer.feed_forward, SparseMoeBlock)]


def loaded(path, monkeypatch, knob: str | None):
    if knob is None:
        monkeypatch.delenv(ALL_EXPERTS_ENV, raising=False)
    else:
        monkeypatch.setenv(ALL_EXPERTS_ENV, knob)
    return load(Checkpoint.open(path))


@pytest.fixture(scope="module")
def moe_path(checkpoints):
    return checkpoints("moe", moe=True)


@pytest.mark.parametrize("rows", [1, 3, 8, 17])
def test_every_expert_over_every_row_gives_each_picks_bits_of_one_product_a_pick(moe_path, monkeypatch, rows):
    glu = glus(loaded(moe_path, monkeypatch, "0"))[0]
    count, _, dims = glu.gate_proj.weight.shape
    x = mx.random.normal((rows, dims), key=mx.random.key(7))
    experts = mx.random.randint(0, count, (rows, 2), key=mx.random.key(8)).astype(mx.uint32)
    picked, every = glu.picked(x, experts), glu.all_experts(x, experts)
    assert picked.shape == every.shape == (rows, 2, dims)
    assert mx.array_equal(picked, every).item()


def test_the_knob_sets_the_rows_from_which_every_expert_runs_and_refuses_what_is_not_a_count(moe_path, monkeypatch):
    assert {g.all_experts_from for g in glus(loaded(moe_path, monkeypatch, "2"))} == {2}
    assert {g.all_experts_from for g in glus(loaded(moe_path, monkeypatch, "0"))} == {None}
    with pytest.raises(CheckpointError, match=f"{ALL_EXPERTS_ENV}='some'"):
        loaded(moe_path, monkeypatch, "some")


def test_unset_the_load_times_both_ways_and_picks_a_tried_row_count_or_none(moe_path, monkeypatch):
    chosen = {g.all_experts_from for g in glus(loaded(moe_path, monkeypatch, None))}
    assert len(chosen) == 1 and chosen <= {None, *ALL_EXPERTS_ROWS}


def test_packed_or_bfloat16_experts_never_run_every_expert_whatever_the_knob_says(converted, checkpoints,
                                                                                    monkeypatch):
    monkeypatch.setenv(ALL_EXPERTS_ENV, "2")
    for path, dtype in ((converted("moe", moe=True), "auto"), (checkpoints("moe-bf16", moe=True), "bfloat16")):
        model = load(Checkpoint.open(path), LoadOptions(dtype=dtype))
        assert glus(model) and all(g.all_experts_from is None for g in glus(model))


def test_where_the_ways_part_the_load_never_runs_every_expert(moe_path, monkeypatch):
    model = loaded(moe_path, monkeypatch, "0")
    monkeypatch.setattr(lfm2_moe.SwitchGLU, "all_experts", lambda self, x, e: self.picked(x, e) + 1e-3)
    assert lfm2_moe._timed_rows(glus(model)[0], 2) is None


def requests() -> list[GenerationRequest]:
    """Prompts that repeat themselves (copy drafts widen the windows), greedy and seeded."""
    prompts = [[40, 41, 42, 43, 44] * 4, [7, 8, 9] * 6 + [7], [100, 200, 300, 100, 200] * 3, list(range(50, 75))]
    return [GenerationRequest(prompt_ids=p, max_tokens=24, sampling=SamplingParams(temperature=0.8, seed=i)
                              if i % 2 else SamplingParams()) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("parallel", [1, 4])
def test_replies_with_every_expert_over_wide_windows_equal_those_with_one_product_a_pick(moe_path, monkeypatch,
                                                                                         parallel):
    reference = [solo(loaded(moe_path, monkeypatch, "0"), r) for r in requests()]
    model = loaded(moe_path, monkeypatch, "2")  # every window of two rows or more, prefill chunks included
    run = Run(model, parallel)
    for sid, request in enumerate(requests()):
        run.submit(sid, request)
    run.finish()
    assert [run.tokens(sid) for sid in range(len(reference))] == reference
    assert sum(run.done(sid).usage["tensorfold"]["drafted"] for sid in range(len(reference))) > 0
