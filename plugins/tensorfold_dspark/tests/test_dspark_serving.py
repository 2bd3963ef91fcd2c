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

from test_dspark_pricing import NAME, TARGET

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
    assert table["backend"] == "cpu" and table["serving"] == {"markov pick": "mlx", "block attention": "mlx"}
    assert table["table"]["markov pick"] == {"cpu": "mlx", "cuda": "dspark markov pick", "metal": "dspark markov pick"}
    assert table["table"]["block attention"]["cuda"] == "dspark block attention"


def test_the_records_served_draft_what_mlxs_ops_draft(target):
    builtin = drafter_with(target, {})
    try:
        assert builtin.kernels == {"markov pick": "mlx", "block attention": "mlx"}
        assert builtin.model.layers[0].self_attn.attend is None
        want = drafts_of(target, builtin)
    finally:
        builtin.close()
    served = drafter_with(target, {KERNELS_ENV: "records"})
    try:
        assert served.kernels == {"markov pick": "dspark markov pick (mlx)",
                                  "block attention": "dspark block attention (mlx)"}
        assert all(layer.self_attn.attend is not None for layer in served.model.layers)
        got = drafts_of(target, served)
    finally:
        served.close()
    assert all(len(d) >= 2 for d in want) and got == want


def test_the_drafter_builtin_knob_keeps_mlxs_ops_whatever_the_table_says(target):
    drafter = drafter_with(target, {KERNELS_ENV: "records", DRAFTER_BUILTIN_ENV: "1"})
    try:
        assert drafter.kernels == {"markov pick": "mlx", "block attention": "mlx"}
    finally:
        drafter.close()
