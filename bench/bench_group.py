"""A 2-rank ring group (mlx.launch on this CPU) against one process: decode and the sums' cost a round, ids first."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

from common import (CODE_PROMPTS, MODEL, BenchMismatch, blas_env, check_same_replies, complete, decode_rate,
                    exit_code, fail_if_any, free_port, median, platform_lines, spread, table, tokenize, wait_up)

LAUNCHER = Path(sys.executable).parent / "mlx.launch"  # MLX's own launcher, as users start a group


def ring_port(ranks: int) -> int:
    """A first port whose next `ranks - 1` are free too: mlx.launch gives rank r the port start + r."""
    import socket

    while True:
        start, taken = free_port(), []
        try:
            for port in range(start, start + ranks):
                sock = socket.socket()
                taken.append(sock)
                sock.bind(("127.0.0.1", port))
            return start
        except OSError:
            continue
        finally:
            for sock in taken:
                sock.close()


def threads(env: dict, ranks: int) -> dict:
    """BLAS threads a rank may use: the cores shared out, so two ranks do not oversubscribe them."""
    return {**env, "OPENBLAS_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks))}


@dataclass(frozen=True)
class Cell:
    """One way of serving: alone or as a group of two ranks, requests drafted or `"draft": false`."""

    name: str
    ranks: int
    draft: bool


CELLS = [Cell("solo-plain", 1, False), Cell("solo-drafted", 1, True), Cell("group-plain", 2, False),
         Cell("group-drafted", 2, True)]


@contextlib.contextmanager
def serving(ranks: int, flags: list[str], env: dict, timeout: float = 300):
    """`tensorfold serve` alone, or under `mlx.launch --backend ring -n 2` (rank 0 listens); stopped afterwards."""
    port = free_port()
    serve = [sys.executable, "-m", "tensorfold_core", "serve", MODEL, "--port", str(port), *flags]
    command = serve if ranks == 1 else [str(LAUNCHER), "--backend", "ring", "-n", str(ranks),
                                        "--starting-port", str(ring_port(ranks)), "--", *serve]
    log = tempfile.TemporaryFile(mode="w+")
    # a session of its own: the launcher's ranks are stopped with it, and nothing else is
    proc = subprocess.Popen(command, env={**os.environ, **threads(env, ranks)}, stdout=log, stderr=log, text=True,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(proc, log, url, timeout)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(60)


def run_cell(cell: Cell, dtype: str, env: dict, prompts: list[list[int]], tokens: int) -> list[dict]:
    with serving(cell.ranks, ["--dtype", dtype], env) as url:
        health = httpx.get(url + "/health", timeout=10).json()
        if cell.ranks > 1 and health.get("group", {}).get("size") != cell.ranks:
            raise RuntimeError(f"{cell.name}: /health shows no group of {cell.ranks}: {health}")
        client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=1200)
        complete(client, tokenize(["x = 1\n"])[0], 8, draft=cell.draft)  # warm-up, on a prompt no cell times
        return [complete(client, p, tokens, draft=cell.draft) for p in prompts]


# -- one round's cost: a 1-row decode forward on a shard (sums included) against the sums and the command alone --

def round_worker(model: str, dtype: str, steps: int) -> int:
    """Run alone or under mlx.launch: time 1-row decode forwards; in a group also the sums and the command block."""
    import mlx.core as mx

    from tensorfold_core.group import Channel, join
    from tensorfold_core.loading import load_shard
    from tensorfold_core.options import ServeOptions
    from tensorfold_core.shard import Trail, fixed_sum

    joined = join()
    _, shard, _ = load_shard(model, ServeOptions(dtype=dtype), joined)
    trail = shard.reductions if joined is not None else Trail()
    prompt = tokenize(CODE_PROMPTS[:1])[0]
    cache = shard.new_cache(len(prompt) + 2 * steps + 8)
    trail.evaluate(shard.forward_ids([cache], mx.array(prompt, dtype=mx.uint32), [len(prompt)], [1]))
    shard.keep(cache, len(prompt))
    token, forward_ms, whole_ms = prompt[-1], [], []
    for step in range(2 * steps):  # every rank draws the same argmax from the same logits, so the ranks stay in step
        start = time.perf_counter()
        logits = shard.forward_ids([cache], mx.array([token], dtype=mx.uint32), [1], [1])
        if step % 2:  # as served: one sum at a time (shard.Trail)
            trail.evaluate(logits)
        else:  # the whole graph in one evaluation: what the trail costs
            trail.clear()
            mx.eval(logits)
        (forward_ms if step % 2 else whole_ms).append(1000 * (time.perf_counter() - start))
        shard.keep(cache, 1)
        token = int(mx.argmax(logits[0]).item())
    found = {"forward_ms": median(forward_ms[2:]), "whole_ms": median(whole_ms[2:]),
             "ranks": 1 if joined is None else joined.group.size()}
    if joined is not None:
        hidden = shard.args.hidden_size
        sums = 2 * shard.args.num_hidden_layers  # one after attention (or the conv), one after the MLP, a layer
        sum_ms, block_ms, channel = [], [], Channel(joined.group)
        for _ in range(steps):
            start = time.perf_counter()
            for _ in range(sums):  # one at a time, as a served forward runs them
                mx.eval(fixed_sum(mx.ones((1, hidden), shard.dtype), joined.group))
            sum_ms.append(1000 * (time.perf_counter() - start))
            start = time.perf_counter()
            if joined.rank == 0:  # a round's commands fit one block
                channel.send(b"{}" * 40)
            else:
                channel.receive()
            block_ms.append(1000 * (time.perf_counter() - start))
        found.update(sums=sums, sums_ms=median(sum_ms[2:]), command_ms=median(block_ms[2:]))
        if joined.rank > 0:
            return 0
    print(json.dumps(found), flush=True)
    return 0


def round_costs(dtype: str, env: dict, steps: int) -> tuple[dict, dict]:
    worker = [sys.executable, os.path.abspath(__file__), "--round-worker", "--dtype-worker", dtype,
              "--steps", str(steps)]
    runs = []
    for ranks, command in ((1, worker), (2, [str(LAUNCHER), "--backend", "ring", "-n", "2", "--starting-port",
                                             str(ring_port(2)), "--", *worker])):
        proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **threads(env, ranks)},
                              timeout=900)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode or not lines:
            raise RuntimeError(f"round worker failed: {proc.stderr[-2000:]}")
        runs.append(json.loads(lines[-1]))
    return runs[0], runs[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=96, help="max_tokens of each reply")
    parser.add_argument("--reps", type=int, default=2, help="rounds over every cell, in a rotated order")
    parser.add_argument("--prompts", type=int, default=6, help="how many of the code prompts")
    parser.add_argument("--dtype", default="float32", help="--dtype of every server")
    parser.add_argument("--blas", default="openblas-nehalem", help="bundled, openblas or openblas-CORE")
    parser.add_argument("--steps", type=int, default=40, help="decode steps the round worker times")
    parser.add_argument("--rounds-only", action="store_true", help="only the round costs, no servers")
    parser.add_argument("--round-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dtype-worker", default="auto", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.round_worker:
        return round_worker(MODEL, args.dtype_worker, args.steps)
    env = blas_env(args.blas)
    prompts = tokenize(CODE_PROMPTS[:args.prompts])
    print("\n".join(platform_lines(args.blas)))
    if args.rounds_only:
        return print_rounds(args.dtype, env, args.steps)
    print(f"{MODEL} --dtype {args.dtype}; {len(prompts)} prompts, {args.tokens} tokens each, greedy; {args.reps} reps;"
          " a fresh server (or group) per cell, cells rotated within each rep")
    runs: dict[str, list[list[dict]]] = {c.name: [] for c in CELLS}
    for rep in range(args.reps):
        shift = rep % len(CELLS)
        for cell in CELLS[shift:] + CELLS[:shift]:
            runs[cell.name].append(run_cell(cell, args.dtype, env, prompts, args.tokens))
    failures, rows = [], []
    references = {1: [r["ids"] for r in runs["solo-plain"][0]], 2: [r["ids"] for r in runs["group-plain"][0]]}
    for cell in CELLS:  # ids first: each cell against the plain replies of its own configuration
        try:
            for rep, replies in enumerate(runs[cell.name]):
                check_same_replies(f"{cell.name} rep {rep + 1}", references[cell.ranks], [r["ids"] for r in replies])
        except BenchMismatch as failure:
            failures.append(failure)
            rows.append([cell.name, f"FAIL: {failure}", "-", "-", "-"])
            continue
        rates = [decode_rate(replies) for replies in runs[cell.name]]
        alone = [decode_rate(replies) for replies in runs[cell.name.replace("group", "solo")]]
        ratio = f"{median(rates) / median(alone):.2f}x" if cell.ranks > 1 else "-"
        rows.append([cell.name, "equal", f"{median(rates):.1f}", spread(rates), ratio])
    same = sum(a == b for a, b in zip(references[1], references[2]))
    print(f"\ngroup replies equal to one process's: {same} of {len(prompts)} prompts (a group sums in another order)")
    print(table(["cell", "ids vs its plain", "tok/s (median)", "range", "vs one process"], rows))
    print_rounds(args.dtype, env, args.steps)
    fail_if_any(failures)
    return 0


def print_rounds(dtype: str, env: dict, steps: int) -> int:
    solo, group = round_costs(dtype, env, steps)
    print(f"\none 1-row decode round of {MODEL} ({dtype}), medians of {steps} steps:")
    print(table(["", "ms"], [
        ["one process: forward", f"{solo['forward_ms']:.2f}"],
        ["group of 2: forward on a shard, sums included (one at a time, as served)", f"{group['forward_ms']:.2f}"],
        ["group of 2: the same, the whole graph in one evaluation", f"{group['whole_ms']:.2f}"],
        [f"group of 2: its {group['sums']} sums alone (1 row, one at a time)", f"{group['sums_ms']:.2f}"],
        ["group of 2: the round's command block (one all_sum of 4 KiB)", f"{group['command_ms']:.2f}"],
        ["group forward / one process", f"{group['forward_ms'] / solo['forward_ms']:.2f}x"]]))
    return 0


if __name__ == "__main__":
    sys.exit(exit_code(main))
