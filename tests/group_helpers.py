"""Two local ranks on the ring backend (what `mlx.launch --backend ring -n 2` sets up), and a check run on them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()


def free_ports(n: int) -> list[int]:
    """n loopback ports free now (bound once by the kernel's choice, then let go)."""
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def ring_env(tmp: Path, size: int = 2, **extra: str) -> list[dict]:
    """Each rank's environment: the ring hostfile mlx.launch writes (one loopback address a rank) and MLX_RANK."""
    hostfile = tmp / "ring-hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in free_ports(size)]))
    base = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
    return [dict(base, HF_HUB_OFFLINE="1", MLX_HOSTFILE=str(hostfile), MLX_RANK=str(rank), **extra)
            for rank in range(size)]


def launch(command: list[str], tmp: Path, size: int = 2, env: dict | None = None, **popen) -> list[subprocess.Popen]:
    """The same command once per rank, as the launcher runs it (`env`: more variables for every rank)."""
    return [subprocess.Popen(command, env=rank_env, **popen) for rank_env in ring_env(tmp, size, **(env or {}))]


# -- the check each rank runs (python tests/group_helpers.py MODEL...): rank 0 prints one JSON line per model --

PROMPTS = ["def add(a, b):\n    return", "Once upon a time there was", "import numpy as np\nimport"]


def _replies(host, requests) -> list[tuple[list[int], dict]]:
    """Each request's token ids and usage, all submitted at once to a live host."""
    import threading

    from tensorfold_core.lanes.types import DoneEvent, ErrorEvent, TokenEvent

    out = [([], {}) for _ in requests]
    done = [threading.Event() for _ in requests]

    def on_event(i):
        def seen(event):
            if isinstance(event, TokenEvent):
                out[i][0].extend(event.token_ids)
            elif isinstance(event, ErrorEvent):
                out[i][1]["error"] = str(event.error)
                done[i].set()
            elif isinstance(event, DoneEvent):
                out[i][1].update(event.usage)
                done[i].set()
        return seen

    for i, request in enumerate(requests):
        host.submit(request, on_event(i))
    for event in done:
        event.wait(300)
    return out


def check_rank0(model_name: str, joined) -> dict:
    """drafted, draft: false, alone, beside others and resumed replies of one served group, greedy and seeded."""
    import dataclasses

    from tensorfold_core.host import Host
    from tensorfold_core.lanes.types import GenerationRequest
    from tensorfold_core.loading import drafter_name, load_target, start_drafter
    from tensorfold_core.options import ServeOptions
    from tensorfold_core.sampling import SamplingParams as Sampling
    from tensorfold_core.specs import DrafterOptions

    options = ServeOptions(parallel=3)
    target = load_target(model_name, options, joined=joined)
    name = drafter_name(model_name, None)  # the shipped drafter, where the model has one: on rank 0 alone
    drafter = start_drafter(name, target.model, target.tokenizer, DrafterOptions.serving(options)) if name else None
    host = Host(target.model, target.tokenizer, options, model_id=model_name, context=512, timed=False,
                row_invariant=target.row_invariant, group=target.model, drafter=drafter)
    found = {"model": model_name, "probe": target.probe, "kernels": target.model.kernels, "cases": {}}
    for mode, sampling in (("greedy", Sampling(temperature=0.0)), ("seeded", Sampling(temperature=0.9, seed=7))):
        requests = [GenerationRequest(prompt_ids=target.tokenizer.encode(p), max_tokens=16, sampling=sampling)
                    for p in PROMPTS]
        plain = [_replies(host, [dataclasses.replace(r, draft=False)])[0] for r in requests]
        alone = [_replies(host, [r])[0] for r in requests]  # a second run of a prompt resumes its kept state
        together = _replies(host, requests)
        found["cases"][mode] = {
            "plain": [ids for ids, _ in plain], "alone": [ids for ids, _ in alone],
            "together": [ids for ids, _ in together],
            "drafted": sum(u.get("tensorfold", {}).get("drafted", 0) for _, u in alone + together),
            "resumed": sum(u.get("prompt_tokens_details", {}).get("cached_tokens", 0) for _, u in alone + together),
            "errors": [u["error"] for _, u in plain + alone + together if "error" in u]}
    found["health"] = host.health()
    host.close()
    return found


def same_logits_on_every_rank(model_name: str, joined) -> bool:
    """Every rank runs one forward on its own shard in lockstep; the logits are gathered and compared."""
    import mlx.core as mx

    from tensorfold_core.loading import load_shard
    from tensorfold_core.options import ServeOptions

    _, model, _ = load_shard(model_name, ServeOptions(), joined)
    logits = model.forward([model.new_cache(32)], [[5, 9, 200, 31, 7]], [5])
    gathered = mx.distributed.all_gather(logits[None], group=joined.group)
    return all(mx.array_equal(gathered[0], gathered[r]).item() for r in range(1, joined.group.size()))


def main(models: list[str]) -> int:
    from tensorfold_core.group import join
    from tensorfold_core.loading import follow_group
    from tensorfold_core.options import ServeOptions

    joined = join()
    for name in models:
        if joined.rank > 0:
            code = follow_group(name, ServeOptions(), joined)
            if code:
                return code
        else:
            print(json.dumps(check_rank0(name, joined)), flush=True)
        equal = same_logits_on_every_rank(name, joined)
        if joined.rank == 0:
            print(json.dumps({"model": name, "same_logits_on_every_rank": equal}), flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[1]))
    sys.exit(main(sys.argv[1:]))
