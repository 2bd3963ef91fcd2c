"""A DSpark-drafted lfm2_moe target over HTTP with the openai client: replies exact, drafted and resumed."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tensorfold_core.loading import load_host
from tensorfold_core.options import ServeOptions
from tensorfold_core.server import start_in_thread

PROMPTS = ["import os\nimport sys\nimport os", "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
           "def main(argv):\n    for arg in argv:\n", "for i in range(10):\n    print(i)\nfor i in range("]


@pytest.fixture(scope="module")
def client(target_dir, dspark_dir):
    options = ServeOptions(parallel=4, context=512, drafter=str(dspark_dir), model_name="target")
    host = load_host(str(target_dir), options, timed=False)
    assert host.drafter is not None and host.drafter.name == "dspark"
    server = start_in_thread(host)
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0)
    server.stop()
    host.close()


def ask(client, i, draft=True):
    sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 0.8, "seed": i}
    return client.completions.create(model="target", prompt=PROMPTS[i], max_tokens=24,
                                     extra_body={"return_token_ids": True, "draft": draft}, **sampling)


def test_concurrent_dspark_drafted_replies_equal_the_serial_reference_over_http(client):
    serial = [ask(client, i, draft=False).choices[0].token_ids for i in range(len(PROMPTS))]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        drafted = list(pool.map(lambda i: ask(client, i), range(len(PROMPTS))))
    assert [r.choices[0].token_ids for r in drafted] == serial
    assert sum(r.usage.model_extra["tensorfold"]["drafted"] for r in drafted) > 0


def test_a_repeated_prompt_resumes_its_kept_state_and_equals_the_first_reply(client):
    first = ask(client, 0)
    again = ask(client, 0)
    assert again.choices[0].token_ids == first.choices[0].token_ids
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_the_servers_capabilities_say_what_serves_the_drafters_ops(client):
    import httpx

    report = httpx.get(str(client.base_url).rstrip("/") + "/capabilities").json()
    assert report["drafter"] is not None
    # MLX's ops on the CPU (the table's cpu column)
    assert report["kernels"]["drafter"] == {"markov pick": "mlx", "block attention": "mlx",
                                            "block attention streams": "mlx"}
