"""The DSpark drafter's op table: MLX's ops on the CPU, the Markov pick and block attention records where the table
(or TENSORFOLD_KERNELS=records) names them, the same drafts either way, and `capabilities` showing which serves."""

from __future__ import annotations

import pytest

from tensorfold_core.capabilities import capabilities
from tensorfold_core.kernels import DRAFTER_BUILTIN_ENV, KERNELS_ENV, missing_records
from tensorfold_core.loading import load_target, start_drafter
from tensorfold_core.options import ServeOptions
from tensorfold_core.protocols import DraftAsk
from tensorfold_dspark.kernels import records
from tensorfold_dspark.ops import OPS

from dspark_helpers import NAME, TARGET

PROMPTS = ["def fib(n):\n    return", "for i in range(10):\n", "class Stack:\n    def push(self, x):", "import os\n"]


@pytest.fixture(scope="module")
def target():
    return load_target(TARGET, ServeOptions(dtype="float32"))


def drafter_with(target, env: dict[str, str]):
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        return start_drafter(NAME, target.model, target.tokenizer)


def drafts_of(target, drafter) -> list[list[int]]:
    """Each prompt's block of drafts from one hold over its committed cache (a stream of its own each)."""
    out = []
    for i, text in enumerate(PROMPTS):
        prompt = target.tokenizer.encode(text)
        cache = target.model.new_cache(64)
        target.model.forward([cache], [prompt], [0])
        target.model.keep(cache, len(prompt))
        (drafts,) = drafter.propose([DraftAsk(200 + i, prompt + [prompt[-1]], drafter.block_size, limit=64,
                                              cache=cache)])
        drafter.release(200 + i)
        out.append(list(drafts))
    return out


def test_every_op_in_the_drafters_table_has_a_record_implementing_it_on_each_backend():
    assert missing_records(OPS, records()) == []


def test_capabilities_show_the_drafters_table_beside_the_families():
    table = capabilities(ServeOptions())["drafter_kernels"]["dspark"]
    assert table["backend"] == "cpu" and table["serving"] == {"markov pick": "mlx", "block attention": "mlx",
                                                              "block attention streams": "mlx"}
    assert table["table"]["markov pick"] == {"cpu": "mlx", "cuda": "dspark markov pick", "metal": "dspark markov pick"}
    assert table["table"]["block attention"]["cuda"] == "dspark block attention"


def test_the_records_served_draft_what_mlxs_ops_draft(target):
    builtin = drafter_with(target, {})
    try:
        assert builtin.kernels == {"markov pick": "mlx", "block attention": "mlx", "block attention streams": "mlx"}
        assert builtin.model.layers[0].self_attn.attend is None
        want = drafts_of(target, builtin)
    finally:
        builtin.close()
    served = drafter_with(target, {KERNELS_ENV: "records"})
    try:
        assert served.kernels == {"markov pick": "dspark markov pick (mlx)",
                                  "block attention": "dspark block attention (mlx)",
                                  "block attention streams": "dspark block attention streams (mlx)"}
        assert all(layer.self_attn.attend is not None for layer in served.model.layers)
        got = drafts_of(target, served)
    finally:
        served.close()
    assert all(len(d) >= 2 for d in want) and got == want


def test_the_drafter_builtin_knob_keeps_mlxs_ops_whatever_the_table_says(target):
    drafter = drafter_with(target, {KERNELS_ENV: "records", DRAFTER_BUILTIN_ENV: "1"})
    try:
        assert drafter.kernels == {"markov pick": "mlx", "block attention": "mlx", "block attention streams": "mlx"}
    finally:
        drafter.close()


def drafts_together(target, drafter, streams: int) -> list[list[int]]:
    """One hold over `streams` streams at once (the prompts in turn, each cut a token shorter than the last): each
    stream's block of drafts."""
    asks, caches = [], []
    for i in range(streams):
        prompt = target.tokenizer.encode(PROMPTS[i % len(PROMPTS)])[:max(2, 12 - i)]
        cache = target.model.new_cache(64)
        target.model.forward([cache], [prompt], [0])
        target.model.keep(cache, len(prompt))
        caches.append(cache)
        asks.append(DraftAsk(300 + i, prompt + [prompt[-1]], drafter.block_size - i % 3, limit=64, cache=cache))
    out = [list(drafts) for drafts in drafter.propose(asks)]
    for i in range(streams):
        drafter.release(300 + i)
    return out


def test_a_hold_s_blocks_in_one_launch_a_layer_draft_what_a_launch_a_block_drafts(target):
    from tensorfold_core.kernels import STREAMS_ENV

    apart = drafter_with(target, {KERNELS_ENV: "records", STREAMS_ENV: "0"})
    try:
        assert apart.kernels["block attention streams"] == (
            f"mlx (dspark block attention streams (mlx) unused: {STREAMS_ENV}=0)")
        assert apart.model.streams_rowmap is None
        want = drafts_together(target, apart, 10)
    finally:
        apart.close()
    packed = drafter_with(target, {KERNELS_ENV: "records"})
    try:
        assert all(layer.self_attn.attend_streams is not None for layer in packed.model.layers)
        got = drafts_together(target, packed, 10)  # ten blocks: launches of eight and two
    finally:
        packed.close()
    assert sum(len(d) >= 2 for d in want) >= 8 and got == want
