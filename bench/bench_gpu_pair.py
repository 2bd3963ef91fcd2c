"""Plain and drafted greedy decode of a target + drafter pair per kernel table mode, in-process, ids checked first."""

# python bench/bench_gpu_pair.py TARGET DRAFTER [--depth 4] [--tokens 128] [--modes builtin,records] [--json OUT]
# Each mode runs in a child process with TENSORFOLD_KERNELS set (the table is read at load). In it, every prompt is
# decoded once untimed (MLX compiles its kernels on first use), then plain (`"draft": false`) and drafted, timed; a
# drafted reply must equal the plain one token for token (check_same_ids) before any rate is printed. Rates count
# decode rounds only (the prompt's prefill round left out), as `tensorfold run --json` does. A mode
# `records-OP+OP` serves the records but leaves those ops (the family's table names) to MLX: where the time goes.
# --streams 4,8 adds cells of that many replies decoded at once on one engine (shared rounds where the probe passes),
# plain and drafted: aggregate tok/s over the cell's wall time, prefill included, each reply's ids checked against
# the same prompt decoded alone and plain. A drafted round's mean wall ms is printed beside the drafter's share of it
# (its `propose`, which reads the drafts back, so its chain's device time is in it): where a drafted round's time goes.
# "Drafted" windows carry --depth drafter drafts each, unpriced, copies off (check mode); "served" is the engine as a
# server runs it (timed: depths priced by measured costs, the guards, copy drafts on), one engine for every prompt so
# what it learned on the untimed pass carries over as on a server that has run a while.

from __future__ import annotations

import argparse
import json
import sys
import time

from common import CODE_PROMPTS, check_same_ids, exit_code, kernel_mode_child


def decode_rate(rounds: list[dict], tokens: int) -> float:
    """Tokens after the first over the time of the rounds after the first that gave tokens."""
    timed = [r for r in rounds if r["tokens"]][1:]
    ms = sum(r["ms"] for r in timed)
    return 1000 * (tokens - 1) / ms if ms else 0.0


def child(args) -> dict:
    import mlx.core as mx

    from tensorfold_core.checkmode import decode
    from tensorfold_core.lanes.engine import Engine
    from tensorfold_core.lanes.types import GenerationRequest
    from tensorfold_core.loading import load_target, start_drafter
    from tensorfold_core.options import ServeOptions
    from tensorfold_core.specs import DrafterOptions

    target = load_target(args.target, ServeOptions(dtype="bfloat16"))
    model, tokenizer = target.model, target.tokenizer
    drafter = start_drafter(args.drafter, model, tokenizer, DrafterOptions(dtype="bfloat16"))
    prompts = CODE_PROMPTS[:args.prompts]
    proposing = {"s": 0.0}
    propose = drafter.propose

    def timed_propose(asks):  # the drafter's share of a round: it reads its drafts back, so its device time is in it
        start = time.perf_counter()
        try:
            return propose(asks)
        finally:
            proposing["s"] += time.perf_counter() - start

    drafter.propose = timed_propose

    def engines():
        plain = Engine(model, shared_rounds=target.row_invariant, copy_drafts=False)
        drafted = Engine(model, shared_rounds=target.row_invariant, drafter=drafter, fixed_depth=args.depth,
                         copy_drafts=False)
        return plain, drafted

    served = Engine(model, shared_rounds=target.row_invariant, drafter=drafter, timed=True)

    def request(text: str) -> GenerationRequest:
        return GenerationRequest(prompt_ids=tokenizer.encode(text), max_tokens=args.tokens, stop_token_ids=frozenset())

    for text in prompts:  # compiles every kernel shape the timed runs meet
        for engine in (*engines(), served):
            decode(engine, request(text), len(request(text).prompt_ids) + args.tokens)
    out = {"mode": args.mode, "device": str(mx.default_device()), "kernels": model.kernels,
           "probe": target.probe, "prompts": []}
    for n in args.streams:  # compiles the wider rows' shapes, then the timed cells
        together(model, engines()[1], [request(prompts[i % len(prompts)]) for i in range(n)])
    for text in prompts:
        plain, drafted = engines()
        req = request(text)
        capacity = len(req.prompt_ids) + args.tokens
        plain_ids, plain_rounds, _ = decode(plain, req, capacity)
        proposing["s"] = 0.0
        drafted_ids, drafted_rounds, _ = decode(drafted, req, capacity)
        served_ids, served_rounds, _ = decode(served, req, capacity)
        out["prompts"].append({"plain_ids": plain_ids, "drafted_ids": drafted_ids, "served_ids": served_ids,
                               "served_tok_s": round(decode_rate(served_rounds, len(served_ids)), 1),
                               "plain_tok_s": round(decode_rate(plain_rounds, len(plain_ids)), 1),
                               "drafted_tok_s": round(decode_rate(drafted_rounds, len(drafted_ids)), 1),
                               "drafted_rounds": len(drafted_rounds), "plain_rounds": len(plain_rounds),
                               "drafted_round_ms": round(mean([r["ms"] for r in drafted_rounds[1:]]), 2),
                               "drafter_ms": round(1000 * proposing["s"] / max(len(drafted_rounds), 1), 2)})
    out["streams"] = []
    for n in args.streams:
        requests = [request(prompts[i % len(prompts)]) for i in range(n)]
        cell = {"streams": n, "prompt_of": [i % len(prompts) for i in range(n)]}
        for name, engine in zip(("plain", "drafted"), engines()):
            ids, seconds = together(model, engine, requests)
            cell[f"{name}_ids"], cell[f"{name}_tok_s"] = ids, round(sum(map(len, ids)) / seconds, 1)
        out["streams"].append(cell)
    return out


def together(model, engine, requests) -> tuple[list[list[int]], float]:
    """Every request on one engine at once: each reply's ids, and the wall seconds until the last one ended."""
    from tensorfold_core.lanes.stream import Stream
    from tensorfold_core.lanes.types import TokenEvent

    events: list[list] = [[] for _ in requests]
    start = time.perf_counter()
    for i, req in enumerate(requests):
        limit = len(req.prompt_ids) + req.max_tokens
        engine.add(Stream(id=i, request=req, cache=model.new_cache(limit), on_event=events[i].append, limit=limit))
    while not engine.idle():
        engine.round()
    seconds = time.perf_counter() - start
    return [[t for e in got if isinstance(e, TokenEvent) for t in e.token_ids] for got in events], seconds


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("drafter")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=3, help="the first N code prompts")
    parser.add_argument("--modes", default="builtin,records")
    parser.add_argument("--streams", default="", help="cells of N replies at once, e.g. 4,8")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.streams = [int(n) for n in args.streams.split(",") if n.strip()]
    if args.child:
        print(json.dumps(child(args)))
        return 0
    results = [kernel_mode_child(__file__, mode, args.target, args.drafter, "--depth", str(args.depth), "--tokens",
                                 str(args.tokens), "--prompts", str(args.prompts), "--streams",
                                 ",".join(map(str, args.streams))) for mode in args.modes.split(",")]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    for r in results:  # ids first: a drafted reply off its plain one fails the run before any rate is read
        for i, p in enumerate(r["prompts"]):
            check_same_ids(f"{r['mode']}: drafted vs plain, prompt {i}", p["plain_ids"], p["drafted_ids"])
            check_same_ids(f"{r['mode']}: served vs plain, prompt {i}", p["plain_ids"], p["served_ids"])
        for cell in r.get("streams", []):
            for kind in ("plain", "drafted"):
                for j, (ids, prompt) in enumerate(zip(cell[f"{kind}_ids"], cell["prompt_of"])):
                    check_same_ids(f"{r['mode']}: {cell['streams']} streams {kind}, reply {j} vs its prompt alone",
                                   r["prompts"][prompt]["plain_ids"], ids)
    first = results[0]
    width = max(9, *(len(r["mode"]) for r in results))
    print(f"{'mode':<{width}} {'probe':<6} {'plain tok/s':>11} {'drafted tok/s':>13} {'drafted/plain':>13} "
          f"{'rounds':>7} {'drafted round ms':>16} {'drafter ms':>10} {'served tok/s':>12} {'served/plain':>12}  "
          f"same ids as {first['mode']}")
    for r in results:
        plain = mean([p["plain_tok_s"] for p in r["prompts"]])
        drafted = mean([p["drafted_tok_s"] for p in r["prompts"]])
        rounds = sum(p["drafted_rounds"] for p in r["prompts"])
        same = all(p["plain_ids"] == q["plain_ids"] for p, q in zip(r["prompts"], first["prompts"]))
        round_ms = mean([p.get("drafted_round_ms", 0.0) for p in r["prompts"]])
        drafter_ms = mean([p.get("drafter_ms", 0.0) for p in r["prompts"]])
        served = mean([p["served_tok_s"] for p in r["prompts"]])
        print(f"{r['mode']:<{width}} {str(r['probe']['row_invariant']):<6} {plain:>11.1f} {drafted:>13.1f} "
              f"{drafted / plain if plain else 0:>13.2f} {rounds:>7} {round_ms:>16.2f} {drafter_ms:>10.2f} "
              f"{served:>12.1f} {served / plain if plain else 0:>12.2f}  {same}")
    if any(r.get("streams") for r in results):
        print(f"\n{'mode':<{width}} {'streams':>7} {'plain tok/s':>11} {'drafted tok/s':>13} {'drafted/plain':>13}"
              "  (aggregate, prefill included; every reply's ids as its prompt alone)")
        for r in results:
            for cell in r.get("streams", []):
                plain, drafted = cell["plain_tok_s"], cell["drafted_tok_s"]
                print(f"{r['mode']:<{width}} {cell['streams']:>7} {plain:>11.1f} {drafted:>13.1f} "
                      f"{drafted / plain if plain else 0:>13.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(exit_code(main))
