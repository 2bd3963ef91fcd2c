"""On the CPU a float32 target's DSpark hold runs on the host (NumPy): the drafts and confidences of MLX's ops, NaN
rows flagged the same way, and MLX's ops wherever the host cannot or should not hold."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from tensorfold_core.kernels import DRAFTER_BUILTIN_ENV, KERNELS_ENV
from tensorfold_core.loading import load_target, start_drafter
from tensorfold_core.options import ServeOptions
from tensorfold_core.protocols import DraftAsk
from tensorfold_dspark.host_hold import HOST_HOLD_ENV, HOST_LABEL

from test_dspark_pricing import NAME, TARGET

PROMPTS = ["def fib(n):\n    return", "for i in range(10):\n    total += i\n", "class Stack:\n    def push(self, x):",
           "import os\nimport sys\n\n\ndef main():\n"]


@pytest.fixture(scope="module")
def target():
    return load_target(TARGET, ServeOptions(dtype="float32"))


def drafter_with(target, env: dict[str, str]):
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        return start_drafter(NAME, target.model, target.tokenizer)


@pytest.fixture(scope="module")
def drafters(target):
    """The drafter holding on the host, and the same one holding with MLX's ops."""
    host, ops = drafter_with(target, {}), drafter_with(target, {HOST_HOLD_ENV: "0"})
    yield host, ops
    host.close()
    ops.close()


def holds(target, drafter, depths: list[int]) -> tuple[list[list[int]], list[list[float] | None]]:
    """One hold over every prompt's committed cache at once (a stream each, `depths[i]` drafts): drafts, chances."""
    asks = []
    for i, (text, depth) in enumerate(zip(PROMPTS, depths)):
        prompt = target.tokenizer.encode(text)
        cache = target.model.new_cache(64)
        target.model.forward([cache], [prompt], [0])
        target.model.keep(cache, len(prompt))
        asks.append(DraftAsk(300 + i, prompt + [prompt[-1]], depth, limit=64, cache=cache))
    try:
        drafts = [list(d) for d in drafter.propose(asks)]
        return drafts, [drafter.chances(ask.stream_id) for ask in asks]
    finally:
        for ask in asks:
            drafter.release(ask.stream_id)


def test_on_the_cpu_a_float32_targets_drafter_holds_on_the_host(drafters):
    host, ops = drafters
    assert host.host is not None and host.kernels == {"markov pick": HOST_LABEL, "block attention": HOST_LABEL}
    assert ops.host is None and ops.kernels == {"markov pick": "mlx", "block attention": "mlx"}


@pytest.mark.parametrize("depths", [[8, 8, 8, 8], [6, 3, 1, 2], [1, 1, 1, 1]], ids=["full", "mixed", "ones"])
def test_the_hosts_hold_drafts_what_mlxs_ops_draft_with_the_same_confidences(target, drafters, depths):
    host, ops = drafters
    got_drafts, got_chances = holds(target, host, depths)
    want_drafts, want_chances = holds(target, ops, depths)
    assert got_drafts == want_drafts and sum(map(len, want_drafts)) >= len(PROMPTS)
    for got, want in zip(got_chances, want_chances):
        assert len(got) == len(want) and all(math.isclose(g, w, abs_tol=1e-5) for g, w in zip(got, want))


def test_a_nan_row_ends_the_hosts_drafts_where_it_ends_mlxs(target, drafters):
    host, ops = drafters
    norm = ops.model.norm.weight
    ops.model.norm.weight = mx.array(np.where(np.arange(norm.shape[0]) == 3, np.nan, np.array(norm)))
    saved = host.host.norm
    host.host.norm = np.where(np.arange(saved.shape[0]) == 3, np.nan, saved).astype(np.float32)
    try:
        assert holds(target, ops, [4] * 4)[0] == [[]] * 4
        assert holds(target, host, [4] * 4)[0] == [[]] * 4
    finally:
        ops.model.norm.weight, host.host.norm = norm, saved


@pytest.mark.parametrize("env", [{HOST_HOLD_ENV: "0"}, {KERNELS_ENV: "records"}, {DRAFTER_BUILTIN_ENV: "1"}],
                         ids=["knob-off", "records-asked", "drafter-builtin"])
def test_the_knob_a_record_asked_for_or_the_builtin_knob_keep_the_hold_in_mlx(target, env):
    drafter = drafter_with(target, env)
    try:
        assert drafter.host is None and HOST_LABEL not in drafter.kernels.values()
    finally:
        drafter.close()


def test_a_bfloat16_target_holds_with_mlxs_ops():
    target = load_target(TARGET, ServeOptions(dtype="bfloat16"))
    drafter = start_drafter(NAME, target.model, target.tokenizer)
    try:
        assert drafter.host is None and drafter.kernels == {"markov pick": "mlx", "block attention": "mlx"}
    finally:
        drafter.close()
