"""The shipped DSpark drafters (tiny-lfm2-moe-dspark, tiny-lfm2-dspark): each found by name, its drafts land on
code, and replies it drafts stay exact."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tensorfold_core.checkmode import decode
from tensorfold_core.checkpoint import Checkpoint
from tensorfold_core.lanes.engine import Engine
from tensorfold_core.lanes.types import GenerationRequest
from tensorfold_core.loading import drafter_only, load_host, load_target, resolve_model, start_drafter
from tensorfold_core.options import ServeOptions
from tensorfold_core.server import start_in_thread
from tensorfold_dspark.plugin import MODELS

PAIRS = [("tiny-lfm2-moe-dspark", "tiny-lfm2-moe"), ("tiny-lfm2-dspark", "tiny-lfm2")]
PROMPTS = ["def fib(n):\n", "import os\nimport sys\n", "class Stack:\n    def __init__(self):\n",
           "for i in range(10):\n"]
# two stdlib-like contexts of about a hundred tokens, the length the drafter's held-out figures are measured at
CONTEXTS = [
    'import os\nimport sys\n\n\ndef read_lines(path, encoding="utf-8"):\n    """Return the lines of the file at path, '
    'without their line endings."""\n    with open(path, encoding=encoding) as f:\n        return [line.rstrip("\\n") '
    'for line in f]\n\n\ndef write_lines(path, lines, encoding="utf-8"):\n    """Write lines to the file at path, one '
    'per line."""\n    with open(path, "w", encoding=encoding) as f:\n        for line in lines:\n',
    'class Stack:\n    """A last-in, first-out stack built on a list."""\n\n    def __init__(self):\n'
    '        self._items = []\n\n    def __len__(self):\n        return len(self._items)\n\n    def push(self, item):\n'
    '        self._items.append(item)'
    '\n\n    def pop(self):\n        if not self._items:\n            raise IndexError("pop from an empty stack")\n'
    '        return self._items.pop()\n\n    def peek(self):\n',
]


@pytest.fixture(scope="module", params=PAIRS, ids=[name for name, _ in PAIRS])
def pair(request):
    return request.param


@pytest.fixture(scope="module")
def client(pair):
    name, target = pair
    # float32: mlx's CPU backend has no bf16 gather_mm for the target's experts
    options = ServeOptions(parallel=4, context=512, dtype="float32", drafter=name, model_name=target)
    host = load_host(target, options, timed=False)
    assert host.drafter is not None and host.drafter.name == "dspark"
    server = start_in_thread(host)
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0), target
    server.stop()
    host.close()


def ask(client, i: int, seeded: bool, draft: bool = True):
    sampling = {"temperature": 0.8, "seed": 7 + i} if seeded else {"temperature": 0}
    openai_client, target = client
    return openai_client.completions.create(model=target, prompt=PROMPTS[i], max_tokens=32,
                                            extra_body={"return_token_ids": True, "draft": draft}, **sampling)


def test_the_shipped_drafter_is_found_by_name_and_is_admitted_only_as_a_drafter(pair):
    name, target = pair
    path = resolve_model(name)
    assert path == MODELS / name
    ckpt = Checkpoint.open(path)
    assert drafter_only(ckpt)
    assert ckpt.config["dflash_config"]["enable_confidence_head"] is True
    assert sum(f.stat().st_size for f in path.iterdir()) <= 8 * 2**20
    assert json.loads((path / "config.json").read_text())["dflash_config"]["num_target_layers"] == \
        json.loads((resolve_model(target) / "config.json").read_text())["num_hidden_layers"]


def test_the_shipped_drafters_own_blocks_land_on_code_without_copy_drafts(pair):
    name, target_name = pair
    target = load_target(target_name, ServeOptions(dtype="float32"))
    drafter = start_drafter(name, target.model, target.tokenizer)
    tokens = kept = 0
    try:
        for prompt in PROMPTS + CONTEXTS:
            request = GenerationRequest(prompt_ids=target.tokenizer.encode(prompt), max_tokens=64)
            capacity = len(request.prompt_ids) + request.max_tokens
            plain, _, _ = decode(Engine(target.model, copy_drafts=False), request, capacity)
            engine = Engine(target.model, drafter=drafter, fixed_depth=8, copy_drafts=False)
            drafted, rounds, _ = decode(engine, request, capacity)
            assert drafted == plain
            tokens, kept = tokens + len(drafted), kept + sum(r["kept"] for r in rounds)
    finally:
        drafter.close()
    # an eighth: well under what the shipped drafter lands (its card), over what a barely trained one does
    assert kept >= tokens // 8


def test_the_shipped_drafters_drafts_land_on_code_over_http(client):
    replies = [ask(client, i, seeded=False) for i in range(len(PROMPTS))]
    stats = [r.usage.model_extra["tensorfold"] for r in replies]
    assert sum(s["drafted"] for s in stats) > 0
    assert sum(s["accepted"] for s in stats) > 0


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("streams", [1, 4])
def test_replies_drafted_by_the_shipped_drafter_equal_the_draft_false_ones(client, streams, seeded):
    serial = [ask(client, i, seeded, draft=False).choices[0].token_ids for i in range(len(PROMPTS))]
    with ThreadPoolExecutor(streams) as pool:
        drafted = list(pool.map(lambda i: ask(client, i, seeded), range(len(PROMPTS))))
    assert [r.choices[0].token_ids for r in drafted] == serial
    assert sum(r.usage.model_extra["tensorfold"]["drafted"] for r in drafted) > 0
