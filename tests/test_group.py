"""Tensor-parallel groups on two local ranks (ring backend): exact replies within the group, a failed rank seen."""

from __future__ import annotations

import json
import re
from dataclasses import replace
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import httpx
import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from group_helpers import HERE, launch, ring_env
from tensorfold_core.errors import CheckpointError
from tensorfold_core.group import (EXIT_GROUP_DOWN, Channel, Forward, Free, Hello, Keep, NewCache, Replica, Stop,
                                   decode, describe_shard, encode, launched)
from tensorfold_core.loading import load_model
from tensorfold_core.memory.ledger import default_budget
from tensorfold_core.plugins import registry
from tensorfold_core.shard import shard, split
from tensorfold_core.testing import tiny_llama_checkpoint

FAMILIES = ("tiny-llama", "tiny-lfm2", "tiny-lfm2-moe")  # llama, lfm2 (w1/w3/w2 MLPs), lfm2_moe (experts)
SERVED = (*FAMILIES, "tiny-lfm2-moe-4bit")  # its experts' width splits in whole groups, unevenly: 128 and 64


def _two_ranks() -> tuple[object, object]:
    """A stand-in for rank 0 and rank 1's groups: sharding reads only rank and size."""
    return tuple(SimpleNamespace(rank=lambda r=r: r, size=lambda: 2) for r in range(2))


@pytest.mark.parametrize("name", FAMILIES)
def test_a_shard_keeps_half_of_every_split_matrix_and_sizes_caches_per_rank(name):
    whole, _, _ = load_model(name)
    half, _, _ = load_model(name)
    family = registry().family_for(whole.model_type)
    shard(half, family.shard_plan(half), _two_ranks()[1])
    assert half.shards == 2
    assert half.cache_bytes(100) < whole.cache_bytes(100)
    a = whole.args
    attention = next(layer for layer in half.model.layers if hasattr(layer, "self_attn")).self_attn
    assert (attention.n_heads, attention.n_kv_heads) == (a.num_attention_heads // 2, a.num_key_value_heads // 2)
    assert attention.k_proj.weight.shape[0] == a.num_key_value_heads // 2 * a.head_dim
    assert half.model.embed_tokens.weight.shape == whole.model.embed_tokens.weight.shape  # replicated


# a rank's load in a process of its own: MLX's peak counts every thread's arrays, an earlier test's too
RANK_LOAD = """
import json, sys
import mlx.core as mx
from mlx.utils import tree_flatten
from tensorfold_core.loading import load_model
from tensorfold_core.specs import LoadOptions
rank, _, _ = load_model(sys.argv[1], LoadOptions(shard=(1, 2)))
print(json.dumps([sum(a.nbytes for _, a in tree_flatten(rank.parameters())), mx.get_peak_memory()]))
"""


@pytest.mark.parametrize("name", SERVED)
def test_a_rank_loads_its_shard_without_ever_holding_the_whole_model(name):
    whole, _, _ = load_model(name)
    whole_bytes = sum(a.nbytes for _, a in tree_flatten(whole.parameters()))
    done = subprocess.run([sys.executable, "-c", RANK_LOAD, name], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rank_bytes, peak = json.loads(done.stdout.splitlines()[-1])
    assert rank_bytes < whole_bytes and peak < whole_bytes  # each matrix read, cut and let go


@pytest.mark.parametrize("name", FAMILIES)
def test_every_projection_a_rank_serves_has_its_shape_gated_by_the_family_s_gemv_record(name):
    half, _, _ = load_model(name)
    family = registry().family_for(half.model_type)
    shard(half, family.shard_plan(half), _two_ranks()[0])
    weights = [w for key, w in tree_flatten(half.model.parameters()) if re.search(r"(proj|\.w[123])\.weight$", key)]
    served = {tuple(w.shape[-2:]) for w in weights}  # an expert stack's [experts, n, k] too
    gemv = next(r for r in registry().kernels()
                if r.family == family.name.split("_")[0] and r.name.endswith("gemv bf16"))
    gated = {(shape.dims["n"], shape.dims["k"]) for shape in gemv.shapes}
    assert served and served <= gated, sorted(served - gated)


def test_a_split_projections_halves_add_up_to_the_whole_with_its_bias_added_once_by_rank_0(tmp_path):
    path = tiny_llama_checkpoint(tmp_path, attention_bias=True, mlp_bias=True)
    whole, _, _ = load_model(path)
    halves = [load_model(path)[0] for _ in range(2)]
    bias = mx.random.normal(whole.model.layers[0].self_attn.o_proj.bias.shape, key=mx.random.key(2))
    for model in (whole, *halves):  # transformers initialises biases to zero: give o a bias worth adding
        model.model.layers[0].self_attn.o_proj.bias = bias
    for rank, half in zip(_two_ranks(), halves):
        shard(half, registry().family_for("llama").shard_plan(half), rank)
    x = mx.random.normal((3, whole.args.hidden_size), key=mx.random.key(0))
    full, parts = whole.model.layers[0].self_attn, [h.model.layers[0].self_attn for h in halves]
    q = mx.concatenate([part.q_proj(x) for part in parts], axis=-1)  # column halves, side by side
    assert mx.allclose(q, full.q_proj(x), atol=1e-5).item()
    heads = mx.random.normal((3, full.o_proj.weight.shape[1]), key=mx.random.key(1))
    width = heads.shape[1] // 2  # row halves: each reads its half of the heads' outputs; the bias is rank 0's
    o = parts[0].o_proj.inner(heads[:, :width]) + parts[1].o_proj.inner(heads[:, width:])
    assert not parts[1].o_proj.inner.bias.any().item() and parts[0].o_proj.inner.bias.any().item()
    assert mx.allclose(o, full.o_proj(heads), atol=1e-4).item()


def test_a_4_bit_expert_width_that_halves_would_cut_splits_in_whole_groups_and_the_parts_add_up_to_the_whole():
    whole, _, _ = load_model("tiny-lfm2-moe-4bit")
    halves = [load_model("tiny-lfm2-moe-4bit")[0] for _ in range(2)]
    for rank, half in enumerate(halves):
        split(half, registry().family_for(half.model_type).shard_plan(half), rank, 2)
    at = whole.args.num_dense_layers  # the first MoE layer
    experts = [m.model.layers[at].feed_forward.switch_mlp for m in (whole, *halves)]
    # 192 = three groups of 64: rank 0 keeps two, rank 1 one; gate/up keep the same outputs as down's inputs
    assert [e.down_proj.scales.shape[-1] * e.down_proj.group_size for e in experts] == [192, 128, 64]
    assert [e.gate_proj.scales.shape[-2] for e in experts] == [192, 128, 64]
    assert describe_shard(halves[0]) == describe_shard(halves[1])  # the ranks still agree on what they serve
    x = mx.random.normal((3, whole.args.hidden_size), key=mx.random.key(0)).astype(mx.bfloat16)
    picks = mx.array([[0, 5], [3, 1], [7, 2]], mx.uint32)
    parts = [e(x, picks).astype(mx.float32) for e in experts]
    assert mx.allclose(parts[1] + parts[2], parts[0], atol=0.05 * mx.abs(parts[0]).max().item()).item()


def test_a_quantized_width_of_fewer_groups_than_ranks_is_refused_by_name():
    model, _, _ = load_model("tiny-lfm2-moe-4bit")
    plan = registry().family_for(model.model_type).shard_plan(model)
    four = SimpleNamespace(rank=lambda: 0, size=lambda: 4)  # 192 inputs are three groups of 64
    with pytest.raises(CheckpointError, match=r"switch_mlp\.down_proj .*not 4 or more whole groups of 64"):
        shard(model, replace(plan, sizes={}), four)


def test_rank_0s_commands_survive_their_encoding_in_order():
    commands = [NewCache(1, 64, 8), Forward([1], [5, 6, 7], [3], [1], False), Keep(1, 3), Free([1], [2]), Stop()]
    assert decode(encode(commands)) == commands


class Loopback(Channel):
    """A channel whose collective is rank 0's blocks played back: the framing without a group."""

    def __init__(self):
        self.blocks: list = []

    def _sum(self, data):
        if data.any():  # rank 0's bytes; the other ranks add zeros and get them back
            self.blocks.append(data.copy())
            return data
        return self.blocks.pop(0)


@pytest.mark.parametrize("ids", [200, 4000])  # one block, and a prompt chunk's commands past it
def test_a_rounds_commands_reach_the_other_ranks_whole_in_one_block_or_two(ids):
    commands = [Forward([1], list(range(ids)), [ids], [1], False), Keep(1, ids)]
    channel = Loopback()
    channel.send(encode(commands))
    assert len(channel.blocks) == (1 if ids == 200 else 2)
    assert decode(channel.receive()) == commands and channel.blocks == []


def test_a_rank_whose_shard_is_not_rank_0s_refuses_to_follow_naming_both():
    llama, _, _ = load_model("tiny-llama")
    lfm2, _, _ = load_model("tiny-lfm2")
    for model in (llama, lfm2):
        shard(model, registry().family_for(model.model_type).shard_plan(model), _two_ranks()[1])
    with pytest.raises(ValueError, match=r"rank 0 serves lfm2 .* this rank loaded llama .*same model and flags"):
        Replica(llama).apply(Hello(describe_shard(lfm2)))
    assert Replica(llama).apply(Hello(describe_shard(llama))) is None


def test_the_launchers_environment_names_the_group_before_any_rank_joins(tmp_path):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([["127.0.0.1:1"], ["127.0.0.1:2"]]))
    assert launched({}) is None
    found = launched({"MLX_HOSTFILE": str(hostfile), "MLX_RANK": "1"})
    assert (found.backend, found.rank, found.size, found.local) == ("ring", 1, 2, 2)


def test_capabilities_json_shows_the_group_the_launcher_set_up(tmp_path):
    alone = subprocess.run([sys.executable, "-m", "tensorfold_core", "capabilities", "--json"], capture_output=True,
                           text=True, check=True, timeout=300, env=ring_env(tmp_path)[0] | {"MLX_HOSTFILE": ""})
    launched_rank = subprocess.run([sys.executable, "-m", "tensorfold_core", "capabilities", "--json"],
                                   capture_output=True, text=True, check=True, timeout=300, env=ring_env(tmp_path)[1])
    assert json.loads(alone.stdout)["group"] == {"size": 1, "backend": None}
    assert json.loads(launched_rank.stdout)["group"] == {"size": 2, "backend": "ring", "rank": 1}


@pytest.mark.parametrize("kernels", ["builtin", "records"])
def test_a_group_of_two_replies_alike_drafted_plain_alone_together_and_resumed_greedy_and_seeded(tmp_path, kernels):
    # records: every op with a kernel record is served through it (on the CPU its composed mlx implementation),
    # prepared at the shard's shapes, as a GPU group would serve them
    ranks = launch([sys.executable, str(HERE.parent / "group_helpers.py"), *SERVED], tmp_path,
                   env={"TENSORFOLD_KERNELS": kernels}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outs = [rank.communicate(timeout=600) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outs[0][1][-3000:] + outs[1][1][-3000:]
    lines = [json.loads(line) for line in outs[0][0].splitlines() if line.startswith("{")]
    served = [line for line in lines if "cases" in line]
    assert [line["model"] for line in served] == list(SERVED)
    for found in served:
        assert found["probe"]["row_invariant"], found["probe"]  # the probe ran on the group
        assert any(label != "mlx" for label in found["kernels"].values()) == (kernels == "records")
        for mode, case in found["cases"].items():
            assert case["errors"] == []
            assert case["plain"] == case["alone"] == case["together"], (found["model"], mode)
            assert case["resumed"] > 0 and all(len(ids) == 16 for ids in case["plain"])
        assert sum(case["drafted"] for case in found["cases"].values()) > 0
        group = found["health"]["group"]
        assert (group["size"], group["backend"], group["status"]) == (2, "ring", "ok")
        assert len(group["held_bytes"]) == 2
    assert all(line["same_logits_on_every_rank"] for line in lines if "same_logits_on_every_rank" in line)


class Group:
    """`tensorfold serve` launched as a ring group of two local ranks; rank 0 says where it listens."""

    def __init__(self, tmp: Path, env: dict | None = None):
        tmp.mkdir()
        command = [sys.executable, "-m", "tensorfold_core", "serve", "tiny-llama", "--port", "0"]
        self.ranks = launch(command, tmp, env=env, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        for line in self.ranks[0].stderr:
            self.log.append(line)
            found = re.search(r"serving .* at (http://\S+)/v1", line)
            if found:
                self.url = found.group(1)
                break
        else:
            raise AssertionError("rank 0 never said where it listens:\n" + "".join(self.log))
        self._rest = threading.Thread(target=lambda: self.log.extend(self.ranks[0].stderr), daemon=True)
        self._rest.start()

    def complete(self, **body) -> httpx.Response:
        body = {"model": "tiny-llama", "prompt": "def add(a, b):\n", "max_tokens": 12, "temperature": 0, **body}
        return httpx.post(self.url + "/v1/completions", json=body, timeout=120)

    def health(self) -> httpx.Response:
        return httpx.get(self.url + "/health", timeout=60)

    def stop(self) -> None:
        for rank in self.ranks:
            if rank.poll() is None:
                rank.kill()
            rank.wait(60)


def _killed_mid_reply(group: Group) -> list[dict]:
    """A long streamed reply whose rank 1 is killed once its first tokens are in; the reply's events."""
    body = {"model": "tiny-llama", "prompt": "def add(a, b):\n", "max_tokens": 400, "temperature": 0,
            "draft": False, "stream": True}
    events = []
    with httpx.stream("POST", group.url + "/v1/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if len(events) == 2:
                    group.ranks[1].send_signal(signal.SIGKILL)
    return events


def test_a_rank_killed_mid_reply_ends_it_with_a_clear_error_and_health_says_the_group_is_down(tmp_path):
    group = Group(tmp_path / "group")
    try:
        health = group.health().json()
        assert health["group"]["size"] == 2 and health["group"]["backend"] == "ring"
        assert health["memory"]["budget_bytes"] == pytest.approx(default_budget() / 2, abs=2)  # two ranks, one machine
        assert httpx.get(group.url + "/v1/capabilities", timeout=60).json()["group"]["status"] == "ok"
        events = _killed_mid_reply(group)
        health = group.health()
        refused = group.complete()
    finally:
        group.stop()
    assert events[-1]["error"]["code"] == "group_down" and "ring group of 2 is down" in events[-1]["error"]["message"]
    assert health.status_code == 503 and health.json()["status"] == "error"
    assert health.json()["group"]["status"] == "down" and "restart the group" in health.json()["error"]
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "group_down"


def test_a_restarted_group_serves_again_and_a_rank_that_stops_answering_takes_rank_0_down(tmp_path):
    first = Group(tmp_path / "first")
    try:
        before = first.complete()
    finally:
        first.stop()
    again = Group(tmp_path / "again", env={"TENSORFOLD_GROUP_TIMEOUT": "5"})
    try:
        after = again.complete()
        again.ranks[1].send_signal(signal.SIGSTOP)  # alive but silent: no socket closes, only the watchdog sees it
        code = again.ranks[0].wait(120)  # idle rank 0 syncs with the group between rounds
        again._rest.join(60)
    finally:
        again.stop()
    assert before.status_code == after.status_code == 200
    assert after.json()["choices"][0]["text"] == before.json()["choices"][0]["text"]
    assert code == EXIT_GROUP_DOWN
    assert "waited more than 5 s for a rank (TENSORFOLD_GROUP_TIMEOUT); restart the group" in "".join(again.log)
