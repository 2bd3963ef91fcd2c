"""Drafted replies over HTTP equal the serial reference, whatever runs beside them."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tensorfold_core.loading import load_host
from tensorfold_core.options import ServeOptions
from tensorfold_core.server import start_in_thread
from tensorfold_core.testing import mlx_quantized_copy, tiny_llama_checkpoint, truncated_drafter

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(", "class Point:\n    def __init__(self, x",
           "import os\nimport sys\nimport os\nimport", "for i in range(10):\n    print(i * i)\nfor",
           "Hello world! The quick brown fox", "0123456789 0123456789 01234", "éà中文 ✓ éà中文", "print(os.path"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    target = tiny_llama_checkpoint(root / "target", seed=5, num_hidden_layers=3)
    drafter = truncated_drafter(target, root / "drafter", layers=2)
    return target, drafter


@pytest.fixture(scope="module", params=["float", "4bit"])
def served(request, pair, tmp_path_factory):
    target, drafter = pair
    if request.param == "4bit":
        drafter = mlx_quantized_copy(drafter, tmp_path_factory.mktemp("q") / "drafter-4bit")
    host = load_host(str(target), ServeOptions(parallel=8, context=256, drafter=str(drafter), model_name="x"),
                     timed=False)
    assert host.drafter is not None
    server = start_in_thread(host)
    yield server
    server.stop()
    host.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)


def fields(i: int, draft: bool = True) -> dict:
    """Even requests greedy, odd ones seeded sampling; all return their token ids."""
    sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 0.9, "top_p": 0.95, "seed": 40 + i}
    return dict(max_tokens=24 + 3 * i, extra_body={"return_token_ids": True, "draft": draft}, **sampling)


def complete(client, i: int, draft: bool = True):
    return client.completions.create(model="x", prompt=PROMPTS[i], **fields(i, draft)).choices[0]


@pytest.fixture(scope="module")
def serial(client):
    """Every prompt served alone with "draft": false: the reference."""
    return [complete(client, i, draft=False).token_ids for i in range(len(PROMPTS))]


@pytest.mark.parametrize("streams", [1, 2, 4, 8])
def test_drafted_replies_equal_the_serial_reference_at_several_concurrent_streams(client, serial, streams):
    with ThreadPoolExecutor(streams) as pool:
        replies = list(pool.map(lambda i: client.completions.create(model="x", prompt=PROMPTS[i], **fields(i)),
                                range(streams)))
    for i, reply in enumerate(replies):
        assert reply.choices[0].token_ids == serial[i], f"prompt {i}"


def test_drafts_are_offered_and_some_land(client):
    usage = [client.completions.create(model="x", prompt=PROMPTS[i], **fields(i)).usage for i in (0, 2)]
    stats = [u.model_extra["tensorfold"] if u.model_extra else u.tensorfold for u in usage]
    assert sum(s["drafted"] for s in stats) > 0
    assert sum(s["accepted"] for s in stats) > 0


@pytest.fixture(scope="module")
def served_two(pair):
    """Two streams at most, so a third request queues."""
    target, drafter = pair
    host = load_host(str(target), ServeOptions(parallel=2, context=256, drafter=str(drafter), model_name="x"),
                     timed=False)
    server = start_in_thread(host)
    yield server
    server.stop()
    host.close()


def test_joining_queued_cancelled_and_refused_neighbours_change_no_reply(served_two, serial):
    served, client = served_two, openai.OpenAI(base_url=served_two.url + "/v1", api_key="-", max_retries=0)
    results, started = {}, threading.Event()

    def streamed(i, stop_after=None):
        ids = []
        with httpx.stream("POST", served.url + "/v1/completions", timeout=60,
                          json={"prompt": PROMPTS[i], "stream": True, **fields(i)["extra_body"],
                                **{k: v for k, v in fields(i).items() if k != "extra_body"}}) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                ids += chunk["choices"][0].get("token_ids", []) if chunk["choices"] else []
                started.set()
                if stop_after is not None and len(ids) >= stop_after:
                    return  # the client goes away mid-stream
        results[i] = ids

    threads = [threading.Thread(target=streamed, args=(0,))]
    threads[0].start()
    started.wait(30)
    threads += [threading.Thread(target=streamed, args=(i,)) for i in (1, 2, 3)]
    threads.append(threading.Thread(target=streamed, args=(4, 3)))
    for t in threads[1:]:
        t.start()
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="x", prompt=[7] * 300, max_tokens=4)
    for t in threads:
        t.join(120)
    for i in (0, 1, 2, 3):
        assert results[i] == serial[i], f"prompt {i}"
    health = httpx.get(served.url + "/health").json()
    assert health["streams"] == 0 and health["queued"] == 0  # the cancelled stream left too
