"""Plain and drafted greedy decode of a target + drafter pair per kernel table mode, in-process, ids checked first."""

# python bench/bench_gpu_pair.py TARGET DRAFTER [--depth 4] [--tokens 128] [--modes builtin,records] [--json OUT]
#                                [--streams 4,8] [--mlx-lm] [--rounds 3]
# Each mode runs in a child process with TENSORFOLD_KERNELS set (the table is read at load). In it, every prompt is
# decoded once untimed (MLX compiles its kernels on first use), then plain (`"draft": false`) and drafted, timed; a
# drafted reply must equal the plain one token for token (check_same_ids) before any rate is printed. Rates count
# decode rounds only (the prompt's prefill round left out), as `tensorfold run --json` does. A mode
# `records-OP+OP` serves the records but leaves those ops (the family's table names) to MLX: where the time goes.
# --streams 4,8 adds cells of that many replies decoded at once on one engine (shared rounds where the probe passes),
# plain, drafted and served: aggregate tok/s over the cell's wall time, prefill included, each reply's ids checked
# against the same prompt decoded alone and plain. A drafted round's mean wall ms is printed beside the drafter's
# share of it (its `propose`: where it reads the drafts back, mode `:read-back`, its chain's device time is in it;
# held on the device, a GPU's default, only building and launching the chain): where a drafted round's time goes.
# "Drafted" windows carry --depth drafter drafts each, unpriced, copies off (check mode); "served" is the engine as a
# server runs it (timed: depths priced by measured costs, the guards, copy drafts on), one engine for every prompt so
# what it learned on the untimed pass carries over as on a server that has run a while; "drafter rounds" counts its
# rounds that asked the drafter (the others verified copies or ran plain). --mlx-lm adds plain cells on one-id
# prompts (each code prompt's first id) and mlx-lm `stream_generate` on them in a child of its own (each once
# untimed, then timed): with no prompt to split, mlx-lm's forwards have our rows' shapes, so on a backend whose ops
# are not row-invariant (CUDA) its ids can still equal a `builtin` mode's (MLX's own ops; the first mode's where no
# builtin mode ran), which they must, up to its eos, before its rate is printed beside each mode's plain rate, with
# how many of each mode's ids agree with its (a row-invariant table's bf16 sums round apart from MLX's).
# --rounds N runs every mode's child N times, the modes' order rotated each round (A B C, B C A, ...): rates drift
# 10-25% from one child to the next within a GPU call, so a few percent needs the median of interleaved runs. Each
# rate printed is then its median over the rounds, every round's ids checked, and each mode's plain rate per round
# is printed too. --served-depth N serves every drafter window at depth N (copies first, unpriced): the served
# columns then say what the priced depths cost or gain against a fixed one.

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import (CODE_PROMPTS, BenchMismatch, check_same_ids, exit_code, first_difference, interleaved,
                    kernel_mode_child, model_dir)


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
    proposing = {"s": 0.0, "calls": 0}
    propose = drafter.propose

    def timed_propose(asks):  # the drafter's share of a round (its device time too where it reads drafts back)
        start = time.perf_counter()
        try:
            return propose(asks)
        finally:
            proposing["s"] += time.perf_counter() - start
            proposing["calls"] += 1

    drafter.propose = timed_propose

    def engines():
        plain = Engine(model, shared_rounds=target.row_invariant, copy_drafts=False)
        drafted = Engine(model, shared_rounds=target.row_invariant, drafter=drafter, fixed_depth=args.depth,
                         copy_drafts=False)
        return plain, drafted

    # --served-depth fixes the served engine's drafter depth (the file's header says what it tells apart)
    served = Engine(model, shared_rounds=target.row_invariant, drafter=drafter, timed=True,
                    fixed_depth=args.served_depth)
    served.time_rows(max([1, *args.streams]))  # as a server of that many slots primes its shared rounds' costs

    def request(text: str) -> GenerationRequest:
        return GenerationRequest(prompt_ids=tokenizer.encode(text), max_tokens=args.tokens, stop_token_ids=frozenset())

    for text in prompts:  # compiles every kernel shape the timed runs meet
        for engine in (*engines(), served):
            decode(engine, request(text), len(request(text).prompt_ids) + args.tokens)
    out = {"mode": args.mode, "device": str(mx.default_device()), "kernels": model.kernels,
           "probe": target.probe, "prompts": []}
    for n in args.streams:  # compiles the wider rows' shapes, then the timed cells
        for engine in (engines()[1], served):
            together(model, engine, [request(prompts[i % len(prompts)]) for i in range(n)])
    for text in prompts:
        plain, drafted = engines()
        req = request(text)
        capacity = len(req.prompt_ids) + args.tokens
        plain_ids, plain_rounds, _ = decode(plain, req, capacity)
        proposing["s"] = 0.0
        drafted_ids, drafted_rounds, _ = decode(drafted, req, capacity)
        drafter_s, proposing["calls"] = proposing["s"], 0
        served_ids, served_rounds, _ = decode(served, req, capacity)
        out["prompts"].append({"prompt_ids": req.prompt_ids, "plain_ids": plain_ids, "drafted_ids": drafted_ids,
                               "served_ids": served_ids,
                               "served_tok_s": round(decode_rate(served_rounds, len(served_ids)), 1),
                               "served_rounds": len(served_rounds), "served_drafter_rounds": proposing["calls"],
                               "plain_tok_s": round(decode_rate(plain_rounds, len(plain_ids)), 1),
                               "drafted_tok_s": round(decode_rate(drafted_rounds, len(drafted_ids)), 1),
                               "drafted_rounds": len(drafted_rounds), "plain_rounds": len(plain_rounds),
                               "drafted_round_ms": round(mean([r["ms"] for r in drafted_rounds[1:]]), 2),
                               "drafter_ms": round(1000 * drafter_s / max(len(drafted_rounds), 1), 2)})
    out["peer_prompts"] = []
    for text in prompts if args.mlx_lm else []:  # one-id prompts: no prefill split, so MLX's ops meet mlx-lm's rows
        req = GenerationRequest(prompt_ids=tokenizer.encode(text)[:1], max_tokens=args.tokens,
                                stop_token_ids=frozenset())
        decode(engines()[0], req, 1 + args.tokens)
        ids, rounds, _ = decode(engines()[0], req, 1 + args.tokens)
        out["peer_prompts"].append({"prompt_ids": req.prompt_ids, "plain_ids": ids,
                                    "plain_tok_s": round(decode_rate(rounds, len(ids)), 1)})
    out["streams"] = []
    for n in args.streams:
        requests = [request(prompts[i % len(prompts)]) for i in range(n)]
        cell = {"streams": n, "prompt_of": [i % len(prompts) for i in range(n)]}
        counted = served.counters
        verdicts, kept, offered = dict(counted.verdicts), counted.accepted_tokens, counted.draft_tokens
        for name, engine in zip(("plain", "drafted", "served"), (*engines(), served)):
            ahead = engine.ahead
            before = (ahead.used, ahead.closed, ahead.held, engine.rounds)
            ids, seconds = together(model, engine, requests)
            cell[f"{name}_ids"], cell[f"{name}_tok_s"] = ids, round(sum(map(len, ids)) / seconds, 1)
            # rounds whose forward the device had queued ahead while the host read the last one, queued steps closed
            # unkept, rounds held back since a stream in them might draft next, and all rounds
            used, closed, held, rounds = (now - then for now, then in
                                          zip((ahead.used, ahead.closed, ahead.held, engine.rounds), before))
            cell[f"{name}_ahead"] = f"{used}/{closed}/{held}/{rounds}"
        # what the served engine's windows did in the timed cell: drafted or plain where they could draft, and drafts
        cell["served_windows"] = {k: counted.verdicts[k] - verdicts[k] for k in verdicts}
        cell["served_kept"] = f"{counted.accepted_tokens - kept}/{counted.draft_tokens - offered}"
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


def peer(args) -> dict:
    """mlx-lm `stream_generate` on the target, each prompt once untimed then timed: its ids and decode tok/s."""
    from bench_family import theirs

    prompt_ids, path = json.loads(sys.stdin.read()), model_dir(args.target)
    for ids in prompt_ids:  # its kernels compile on first use, as ours do in their untimed pass
        theirs(path, ids, args.tokens, "auto")
    return {"prompts": [dict(zip(("ids", "tok_s"), theirs(path, ids, args.tokens, "auto"))) for ids in prompt_ids]}


def compare_peer(args, results: list[dict]) -> None:
    """mlx-lm on one-id prompts (the code prompts' first ids: with no prompt to split, its rows are ours row for row)
    against the `builtin` mode's plain replies to them (the same MLX ops), to its eos where it stops; then each mode's plain rate on them against its rate, with how far each mode's ids agree."""
    reference = next(r for r in results if r["mode"].partition(":")[0] == "builtin")
    done = subprocess.run([sys.executable, __file__, args.target, args.drafter, "--tokens", str(args.tokens),
                           "--peer"], input=json.dumps([p["prompt_ids"] for p in reference["peer_prompts"]]),
                          capture_output=True, text=True)
    if done.returncode:
        raise BenchMismatch(f"mlx-lm: the child failed: {done.stderr[-2000:]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])["prompts"]
    for i, (theirs, ours) in enumerate(zip(got, reference["peer_prompts"])):
        check_same_ids(f"mlx-lm against {reference['mode']} plain, one-id prompt {i}",
                       ours["plain_ids"][:len(theirs["ids"])], theirs["ids"])
    rate = mean([p["tok_s"] for p in got])
    print(f"\nmlx-lm generate on one-id prompts {rate:.1f} tok/s, its greedy ids those of {reference['mode']} plain")
    for r in results:  # a row-invariant table's bf16 sums differ from MLX's, so its ids may part from theirs
        plain = mean([p["plain_tok_s"] for p in r["peer_prompts"]])
        agree = sum(agreeing(p["plain_ids"][:len(t["ids"])], t["ids"]) for p, t in zip(r["peer_prompts"], got))
        print(f"  {r['mode']}: plain {plain:.1f} tok/s, {plain / rate if rate else 0:.2f}x mlx-lm; its ids as "
              f"mlx-lm's for {agree} of {sum(len(t['ids']) for t in got)} tokens (each prompt to its first difference)")


def agreeing(ours: list[int], theirs: list[int]) -> int:
    """How many ids from the start the two replies share."""
    at = first_difference(ours, theirs)
    return len(theirs) if at is None else at


RATES = ("plain_tok_s", "drafted_tok_s", "served_tok_s", "drafted_round_ms", "drafter_ms")


def median_run(runs: list[dict]) -> dict:
    """A mode's first run, its rates replaced by their medians over every run (prompt by prompt, cell by cell)."""
    out = json.loads(json.dumps(runs[0]))
    for i, p in enumerate(out["prompts"]):
        for key in RATES:
            if key in p:
                p[key] = statistics.median(r["prompts"][i][key] for r in runs)
    for j, cell in enumerate(out.get("streams", [])):
        for key in ("plain_tok_s", "drafted_tok_s", "served_tok_s"):
            cell[key] = statistics.median(r["streams"][j][key] for r in runs)
    for i, p in enumerate(out.get("peer_prompts", [])):
        p["plain_tok_s"] = statistics.median(r["peer_prompts"][i]["plain_tok_s"] for r in runs)
    return out


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
    parser.add_argument("--mlx-lm", action="store_true", help="mlx-lm generate on the target too (ids checked)")
    parser.add_argument("--rounds", type=int, default=1, help="run the modes N times, interleaved; medians")
    parser.add_argument("--served-depth", type=int, help="serve every drafter window at this depth, unpriced")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.streams = [int(n) for n in args.streams.split(",") if n.strip()]
    if args.child or args.peer:
        print(json.dumps(child(args) if args.child else peer(args)))
        return 0
    if args.mlx_lm and "builtin" not in [m.partition(":")[0] for m in args.modes.split(",")]:
        # another table sums in its own order, so its ids may part from mlx-lm's on any backend but the CPU
        raise SystemExit("--mlx-lm checks mlx-lm's ids against the builtin mode's (MLX's own ops): add builtin to "
                         f"--modes (got {args.modes})")
    modes = args.modes.split(",")
    if len(set(modes)) != len(modes):
        raise SystemExit(f"--modes names a mode twice ({args.modes}): use --rounds to run each more than once")

    def kept(runs):  # before any check, after each child: a cut or failed call keeps the raw results it got
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(runs, indent=1))

    runs, failed = interleaved(modes, args.rounds, lambda mode: kernel_mode_child(
        __file__, mode, args.target, args.drafter, "--depth", str(args.depth), "--tokens", str(args.tokens),
        "--prompts", str(args.prompts), "--streams", ",".join(map(str, args.streams)),
        *(["--mlx-lm"] if args.mlx_lm else []),
        *(["--served-depth", str(args.served_depth)] if args.served_depth is not None else [])), kept)
    modes = list(runs)
    kept(runs)  # the modes that ran, the failed ones left out
    for mode in modes:  # every round's ids equal its first's: a mode's tokens never depend on when it ran
        for n, r in enumerate(runs[mode][1:], 1):
            for i, (p, q) in enumerate(zip(runs[mode][0]["prompts"], r["prompts"])):
                check_same_ids(f"{mode}: round {n + 1} vs round 1, prompt {i}", p["plain_ids"], q["plain_ids"])
    results = [median_run(runs[mode]) for mode in modes]
    if args.rounds > 1:
        print("plain tok/s a round (prompts' mean), in the order each mode ran:")
        for mode in modes:
            rates = [mean([p["plain_tok_s"] for p in r["prompts"]]) for r in runs[mode]]
            print(f"  {mode}: " + " ".join(f"{rate:.1f}" for rate in rates))
    for r in results:  # ids first: a drafted reply off its plain one fails the run before any rate is read
        for i, p in enumerate(r["prompts"]):
            check_same_ids(f"{r['mode']}: drafted vs plain, prompt {i}", p["plain_ids"], p["drafted_ids"])
            check_same_ids(f"{r['mode']}: served vs plain, prompt {i}", p["plain_ids"], p["served_ids"])
        for cell in r.get("streams", []):
            for kind in ("plain", "drafted", "served"):
                for j, (ids, prompt) in enumerate(zip(cell[f"{kind}_ids"], cell["prompt_of"])):
                    check_same_ids(f"{r['mode']}: {cell['streams']} streams {kind}, reply {j} vs its prompt alone",
                                   r["prompts"][prompt]["plain_ids"], ids)
    if args.served_depth is not None:  # the served columns below are not the priced engine's
        print(f"served: every drafter window at depth {args.served_depth}, unpriced (--served-depth)")
    first = results[0]
    width = max(9, *(len(r["mode"]) for r in results))
    print(f"{'mode':<{width}} {'probe':<6} {'plain tok/s':>11} {'drafted tok/s':>13} {'drafted/plain':>13} "
          f"{'rounds':>7} {'drafted round ms':>16} {'drafter ms':>10} {'served tok/s':>12} {'served/plain':>12} "
          f"{'drafter rounds':>14}  same ids as {first['mode']}")
    for r in results:
        plain = mean([p["plain_tok_s"] for p in r["prompts"]])
        drafted = mean([p["drafted_tok_s"] for p in r["prompts"]])
        rounds = sum(p["drafted_rounds"] for p in r["prompts"])
        same = all(p["plain_ids"] == q["plain_ids"] for p, q in zip(r["prompts"], first["prompts"]))
        round_ms = mean([p.get("drafted_round_ms", 0.0) for p in r["prompts"]])
        drafter_ms = mean([p.get("drafter_ms", 0.0) for p in r["prompts"]])
        served = mean([p["served_tok_s"] for p in r["prompts"]])
        asked = (f"{sum(p['served_drafter_rounds'] for p in r['prompts'])}/"
                 f"{sum(p['served_rounds'] for p in r['prompts'])}")
        print(f"{r['mode']:<{width}} {str(r['probe']['row_invariant']):<6} {plain:>11.1f} {drafted:>13.1f} "
              f"{drafted / plain if plain else 0:>13.2f} {rounds:>7} {round_ms:>16.2f} {drafter_ms:>10.2f} "
              f"{served:>12.1f} {served / plain if plain else 0:>12.2f} {asked:>14}  {same}")
    if any(r.get("streams") for r in results):
        print(f"\n{'mode':<{width}} {'streams':>7} {'plain tok/s':>11} {'drafted tok/s':>13} {'drafted/plain':>13}"
              f" {'served tok/s':>12} {'served/plain':>12} {'served windows drafted/plain':>28} {'kept/offered':>13}"
              f" {'ahead plain':>15} {'ahead served':>15}"
              "  (aggregate, prefill included; every reply's ids as its prompt alone; ahead: rounds run ahead/steps"
              " closed unkept/rounds held back for drafts/all rounds)")
        for r in results:
            for cell in r.get("streams", []):
                plain, drafted, served = cell["plain_tok_s"], cell["drafted_tok_s"], cell["served_tok_s"]
                print(f"{r['mode']:<{width}} {cell['streams']:>7} {plain:>11.1f} {drafted:>13.1f} "
                      f"{drafted / plain if plain else 0:>13.2f} {served:>12.1f} "
                      f"{served / plain if plain else 0:>12.2f} "
                      f"{'{drafted}/{plain}'.format(**cell['served_windows']):>28} {cell['served_kept']:>13} "
                      f"{cell.get('plain_ahead', '-'):>15} {cell.get('served_ahead', '-'):>15}")
    if args.mlx_lm:
        compare_peer(args, results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(exit_code(main))
