"""Where a decode token's time goes: the bare forward's graph build, eval and keep, per kernel table mode, ids first."""

# python bench/bench_token_time.py TARGET [--modes builtin,table] [--tokens 96] [--contexts 60,1600]
#                                   [--streams 1,4,8] [--json OUT]
# Each mode runs in a child with TENSORFOLD_KERNELS set (a mode `table-OP+OP` leaves those ops to MLX), and no
# engine: the target's own forward, one row a stream a step, greedy:
#   sync       build the step's graph, eval its argmax, read the id, keep the row (what a round does today)
#   pipelined  the next step's graph is built on the last step's lazy argmax while the device runs it (mlx-lm's
#              loop): its time per token is the larger of the host's and the device's, so sync minus pipelined is
#              the time the device waits on the host; its host ms is a step's own host cost (building the graph,
#              and encoding it, from async_eval's quickest calls, MLX holding the host back once steps queue up):
#              near its token ms, the host sets the pace; well under it, the device does (bubbles included). A GPU
#              reading: on MLX's CPU backend the step's own compute shows in it
#   streams    1/4/8 streams side by side, one row each in one forward a step (a shared round): aggregate tok/s
# The pipelined ids must equal the sync ids; where the load probe passes, a first token resumed from a kept state
# (the prompt cache's path) must have the cold prefill's logits bit for bit, and each of the side-by-side streams the
# ids it decodes alone; all are checked before any time is printed (where the probe fails, the server serves no
# resume and no shared rounds: those figures are shown, marked).

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from common import CODE_PROMPTS, BenchMismatch, check_same_ids, exit_code, interleaved, kernel_mode_child


def context_ids(tokenizer, length: int) -> list[int]:
    """Code prompts joined until `length` ids (the first prompt alone for a short context)."""
    ids: list[int] = []
    while len(ids) < length:
        ids += tokenizer.encode(CODE_PROMPTS[len(ids) % len(CODE_PROMPTS)])
    return ids[:length]


def sync_loop(model, prompt: list[int], tokens: int) -> dict:
    import mlx.core as mx

    cache = model.new_cache(len(prompt) + tokens + 8)
    token = int(mx.argmax(model.forward([cache], [prompt], [1])[-1]).item())
    model.keep(cache, len(prompt))
    ids, build, wait, keep = [token], [], [], []
    for _ in range(tokens):
        t0 = time.perf_counter()
        nxt = mx.argmax(model.forward([cache], [[token]], [1])[-1])
        t1 = time.perf_counter()
        mx.eval(nxt)
        t2 = time.perf_counter()
        token = int(nxt.item())
        model.keep(cache, 1)
        t3 = time.perf_counter()
        ids.append(token)
        build.append(t1 - t0), wait.append(t2 - t1), keep.append(t3 - t2)
    return {"ids": ids, "build_ms": ms(build), "eval_ms": ms(wait), "keep_ms": ms(keep),
            "token_ms": ms([a + b + c for a, b, c in zip(build, wait, keep)])}


def pipelined_loop(model, prompt: list[int], tokens: int) -> dict:
    import mlx.core as mx

    cache = model.new_cache(len(prompt) + tokens + 8)
    nxt = mx.argmax(model.forward([cache], [prompt], [1])[-1:], axis=-1).astype(mx.uint32)
    model.keep(cache, len(prompt))
    pending, build, queue = [nxt], [], []
    start = time.perf_counter()
    for _ in range(tokens):
        t0 = time.perf_counter()
        nxt = mx.argmax(model.forward_ids([cache], nxt, [1], [1], commit=True), axis=-1).astype(mx.uint32)
        t1 = time.perf_counter()
        mx.async_eval(nxt)
        pending.append(nxt)
        build.append(t1 - t0), queue.append(time.perf_counter() - t1)
    mx.eval(pending)
    took = time.perf_counter() - start
    # MLX holds the host back once a few steps are in flight, inside async_eval: its quickest calls are the encoding
    # alone, so the host's own cost a step is about the median build plus the tenth-percentile queueing
    own = statistics.median(build) + sorted(queue)[len(queue) // 10]
    return {"ids": [int(a.item()) for a in pending], "token_ms": 1000 * took / tokens, "host_ms": 1000 * own}


def first_token(model, prompt: list[int], reps: int = 3) -> dict:
    """Time to the first token of `prompt` cold (the whole prefill) and resumed from a kept state of all but its
    last id (the prompt cache's path); the two logits rows must be bit-equal."""
    import mlx.core as mx
    import numpy as np

    cold, resumed = [], []
    for _ in range(reps):
        start = time.perf_counter()
        cache = model.new_cache(len(prompt) + 8)
        fresh = model.forward([cache], [prompt], [1])[-1]
        mx.eval(fresh)
        cold.append(time.perf_counter() - start)
    cache = model.new_cache(len(prompt) + 8)
    mx.eval(model.forward([cache], [prompt[:-1]], [1]))
    model.keep(cache, len(prompt) - 1)
    state = model.snapshot(cache)
    for _ in range(reps):
        start = time.perf_counter()
        cache = model.restore(state, len(prompt) + 8)
        again = model.forward([cache], [prompt[-1:]], [1])[-1]
        mx.eval(again)
        resumed.append(time.perf_counter() - start)
    same = bool(np.array_equal(np.array(fresh.astype(mx.float32)), np.array(again.astype(mx.float32))))
    return {"cold_ms": ms(cold), "resumed_ms": ms(resumed), "bit_equal": same}


def streams_loop(model, prompts: list[list[int]], tokens: int) -> dict:
    """Streams decoded side by side, one row each in one forward a step (a shared round): aggregate tok/s."""
    import mlx.core as mx

    caches = [model.new_cache(len(p) + tokens + 8) for p in prompts]
    first = mx.argmax(model.forward(caches, prompts, [1] * len(prompts)), axis=-1)
    for cache, p in zip(caches, prompts):
        model.keep(cache, len(p))
    ids = [[int(t)] for t in first.tolist()]
    start = time.perf_counter()
    for _ in range(tokens):
        nxt = mx.argmax(model.forward(caches, [[i[-1]] for i in ids], [1] * len(ids)), axis=-1).tolist()
        for cache, stream, token in zip(caches, ids, nxt):
            model.keep(cache, 1)
            stream.append(int(token))
    return {"ids": ids, "tok_s": len(prompts) * tokens / (time.perf_counter() - start)}


def ms(values: list[float]) -> float:
    return 1000 * statistics.median(values)


def child(args) -> dict:
    import mlx.core as mx

    from tensorfold_core.loading import load_target
    from tensorfold_core.options import ServeOptions

    target = load_target(args.target, ServeOptions(dtype="bfloat16"))
    model, tokenizer = target.model, target.tokenizer
    out = {"mode": args.mode, "device": str(mx.default_device()), "kernels": model.kernels,
           "row_invariant": bool(target.probe.get("row_invariant")), "cells": []}
    for length in (int(n) for n in args.contexts.split(",")):
        prompt = context_ids(tokenizer, length)
        sync_loop(model, prompt, 8), pipelined_loop(model, prompt, 8)  # MLX compiles each kernel on first use
        sync, piped = sync_loop(model, prompt, args.tokens), pipelined_loop(model, prompt, args.tokens)
        out["cells"].append({"context": length, "sync": sync, "pipelined": piped,
                             "first_token": first_token(model, prompt)})
    prompts = [tokenizer.encode(text) for text in CODE_PROMPTS]
    streams_loop(model, prompts[:8], 4)  # each row count's kernels compiled before any time is taken
    out["streams"] = []
    for n in (int(n) for n in args.streams.split(",")):
        shared = streams_loop(model, [prompts[i % len(prompts)] for i in range(n)], args.tokens)
        alone = [sync_loop(model, prompts[i % len(prompts)], args.tokens)["ids"] for i in range(n)]
        out["streams"].append({"streams": n, "tok_s": shared["tok_s"], "same_as_alone": shared["ids"] == alone})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("--modes", default="builtin,table")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--contexts", default="60,1600", help="comma list of prompt lengths in ids")
    parser.add_argument("--streams", default="1,4,8", help="comma list of stream counts decoded side by side")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    runs, failed = interleaved(args.modes.split(","), 1, lambda mode: kernel_mode_child(
        __file__, mode, args.target, "--tokens", str(args.tokens), "--contexts", args.contexts, "--streams",
        args.streams))
    results = [r[0] for r in runs.values()]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    for r in results:
        for c in r["cells"]:
            check_same_ids(f"{r['mode']}, context {c['context']}: pipelined vs sync", c["sync"]["ids"],
                           c["pipelined"]["ids"])
    for r in results:  # a mode whose probe fails serves no resume (the server turns it off): its figure is shown only
        for c in r["cells"]:
            if r["row_invariant"] and not c["first_token"]["bit_equal"]:
                raise BenchMismatch(f"{r['mode']}, context {c['context']}: resumed logits differ from cold ones")
        for cell in r["streams"]:
            if r["row_invariant"] and not cell["same_as_alone"]:
                raise BenchMismatch(f"{r['mode']}, {cell['streams']} streams: ids differ from each stream alone")
    print(f"{'mode':<22} {'context':>7} {'build ms':>9} {'eval ms':>8} {'keep ms':>8} {'sync tok/s':>10} "
          f"{'pipelined tok/s':>15} {'host wait ms':>12} {'pipelined host ms':>17}")
    for r in results:
        for c in r["cells"]:
            s, p = c["sync"], c["pipelined"]
            print(f"{r['mode']:<22} {c['context']:>7} {s['build_ms']:>9.2f} {s['eval_ms']:>8.2f} {s['keep_ms']:>8.2f} "
                  f"{1000 / s['token_ms']:>10.1f} {1000 / p['token_ms']:>15.1f} {s['token_ms'] - p['token_ms']:>12.2f} "
                  f"{p['host_ms']:>17.2f}")
    print(f"\n{'mode':<22} {'context':>7} {'cold first token ms':>19} {'resumed ms':>10} {'cold/resumed':>12}  logits")
    for r in results:
        for c in r["cells"]:
            f = c["first_token"]
            same = "bit-equal" if f["bit_equal"] else "differ (probe fails: no resume served)"
            print(f"{r['mode']:<22} {c['context']:>7} {f['cold_ms']:>19.2f} {f['resumed_ms']:>10.2f} "
                  f"{f['cold_ms'] / f['resumed_ms']:>11.1f}x  {same}")
    print(f"\n{'mode':<22} {'streams':>7} {'aggregate tok/s':>15} {'vs 1 stream':>11}  ids")
    for r in results:
        one = next((c["tok_s"] for c in r["streams"] if c["streams"] == 1), None)
        for c in r["streams"]:
            same = "as alone" if c["same_as_alone"] else "differ (probe fails: no shared rounds served)"
            print(f"{r['mode']:<22} {c['streams']:>7} {c['tok_s']:>15.1f} "
                  f"{c['tok_s'] / one if one else 0:>10.2f}x  {same}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(exit_code(main))
