"""How fast any drafter could make a target on this machine: a plain round's time against what each verify row adds."""

# python bench/bench_ceiling.py [--target tiny-lfm2-moe] [--drafter tiny-lfm2-moe-dspark] [--streams 1,4,8]
#                              [--depths 1,2,3,4,6,8,15] [--blas openblas-nehalem] [--acceptance tools/zoo/runs/...]
# In one process (the BLAS preloaded as bench_dspark's servers preload it):
#   plain      the engine's own decode rounds, `"draft": false`, N streams sharing each round: ms a round
#   rows       the bare forward + keep of N streams' windows of 1..16 rows each: what each verify row adds
#   holds      the drafter's hold passes as it timed them at its start (N blocks of D drafts; DSpark's `hold_costs`)
# A drafted round of depth D is then the plain round plus D rows a stream plus (where priced) the hold, for
# 1 + E[accepted] tokens a stream. Three ceilings per N, the best depth each:
#   perfect    every draft accepted, holds free: what no drafter passes on this machine
#   shipped    the drafter's measured acceptance (`tools/zoo/eval_dspark.py`'s histogram), holds free
#   priced     the same with its holds at their timed cost
# Before any figure: the first row of every wider window gives bit-equal logits to its one-row forward (the rows
# being timed are the ones exactness is proven on). In-process rounds carry no HTTP or tokenizer work, so a served
# plain round is longer and the served ceiling somewhat higher (docs/dspark.md, section *What this CPU allows*).

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from common import CODE_PROMPTS, BenchMismatch, blas_env, exit_code, platform_lines, table

REPO = Path(__file__).resolve().parents[1]
ACCEPTANCE = REPO / "tools" / "zoo" / "runs" / "dspark-eval.json"
MAX_ROWS = 16  # the widest window the kernels serve


def expected_accepted(histogram: dict[str, int], depth: int, block: int) -> float:
    """E[drafts accepted] at `depth` from a histogram of accepted drafts per block of `block`: sum of P(>= k)."""
    total = sum(histogram.values())
    at_least = lambda k: sum(n for accepted, n in histogram.items() if int(accepted) >= k) / total
    return sum(at_least(k) for k in range(1, min(depth, block) + 1))


def plain_round_ms(target, tokenizer, streams: int, tokens: int) -> float:
    """Median ms of the engine's decode rounds (every window one row) with `streams` greedy streams, undrafted."""
    from tensorfold_core.lanes.engine import Engine
    from tensorfold_core.lanes.stream import Stream
    from tensorfold_core.lanes.types import GenerationRequest

    times = []
    for timed in (False, True):  # the first pass builds every shape the second times
        engine = Engine(target.model, shared_rounds=target.row_invariant, copy_drafts=False)
        for i in range(streams):
            ids = tokenizer.encode(CODE_PROMPTS[i % len(CODE_PROMPTS)])
            request = GenerationRequest(prompt_ids=ids, max_tokens=tokens, stop_token_ids=frozenset(), draft=False)
            limit = len(ids) + tokens
            engine.add(Stream(id=i, request=request, cache=target.model.new_cache(limit), on_event=lambda e: None,
                              limit=limit))
        while not engine.idle():
            start = time.perf_counter()
            engine.round()
            if timed and engine.last_windows == [1] * streams:
                times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def rows_ms(model, tokenizer, streams: int, widths: list[int], reps: int) -> dict[int, float]:
    """Median ms of one forward + keep of `streams` windows of each width, the widths interleaved rep by rep (load
    drifts), after checking the first row of each window is bit-equal to that stream's one-row forward."""
    import mlx.core as mx

    prompts = [tokenizer.encode(CODE_PROMPTS[i % len(CODE_PROMPTS)]) for i in range(streams)]
    caches = [model.new_cache(max(map(len, prompts)) + MAX_ROWS + 1) for _ in prompts]
    for cache, prompt in zip(caches, prompts):
        mx.eval(model.forward([cache], [prompt], [1]))
        model.keep(cache, len(prompt))
    times: dict[int, list[float]] = {width: [] for width in widths}
    first = None
    for rep in range(reps + 1):  # the first pass builds each width's shapes, untimed, and checks its rows
        for width in widths[rep % len(widths):] + widths[:rep % len(widths)]:
            windows = [[p[-1]] + [7] * (width - 1) for p in prompts]
            start = time.perf_counter()
            logits = model.forward(caches, windows, [width] * streams)
            mx.eval(logits)
            for cache in caches:
                model.keep(cache, 0)
            if rep:
                times[width].append(1000 * (time.perf_counter() - start))
                continue
            rows = logits.reshape(streams, width, -1)[:, 0]
            first = rows if first is None else first
            if not mx.array_equal(rows, first).item():
                raise BenchMismatch(f"{streams} streams: a {width}-row window's first row differs from its one-row "
                                    "forward (the probe's row invariance does not hold here)")
    return {width: statistics.median(t) for width, t in times.items()}


def ceilings(plain: float, rows: dict[int, float], depths: list[int], accepted, hold) -> dict[str, tuple]:
    """Per kind of ceiling, (speed-up over plain, its depth): the best over `depths`, the shallower on a tie."""
    best = {}
    for kind in ("perfect", "shipped", "priced"):
        rates = []
        for d in depths:
            extra = rows[d + 1] - rows[1] + (hold(d) if kind == "priced" else 0.0)
            tokens = 1 + (d if kind == "perfect" else accepted(d))
            rates.append((tokens * plain / (plain + extra), d))
        best[kind] = max(rates, key=lambda rate: (rate[0], -rate[1]))
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="tiny-lfm2-moe")
    parser.add_argument("--drafter", default="tiny-lfm2-moe-dspark", help="a DSpark drafter whose holds are timed")
    parser.add_argument("--acceptance", default=str(ACCEPTANCE), help="an eval_dspark.py JSON with its histogram")
    parser.add_argument("--streams", default="1,4,8")
    parser.add_argument("--depths", default="1,2,3,4,6,8,15")
    parser.add_argument("--tokens", type=int, default=48, help="tokens a stream in the plain rounds")
    parser.add_argument("--reps", type=int, default=25)
    parser.add_argument("--blas", default="openblas-nehalem")
    args = parser.parse_args()
    env = blas_env(args.blas)
    if any(os.environ.get(k) != v for k, v in env.items()):  # a preload only acts from a process's start
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **env})
    from tensorfold_core.loading import load_target, start_drafter
    from tensorfold_core.options import ServeOptions

    streams, depths = [int(n) for n in args.streams.split(",")], [int(d) for d in args.depths.split(",")]
    if max(depths) + 1 > MAX_ROWS:
        raise SystemExit(f"--depths {args.depths}: at most {MAX_ROWS - 1} drafts a window")
    evaluation = json.loads(Path(args.acceptance).read_text())
    histogram, block = evaluation["accepted_histogram"], evaluation["depth"]
    target = load_target(args.target, ServeOptions(dtype="float32"))
    drafter = start_drafter(args.drafter, target.model, target.tokenizer)
    print("\n".join(platform_lines(args.blas)))
    print(f"{args.target} float32, probe: {target.probe['detail']}; acceptance from {Path(args.acceptance).name} "
          f"({evaluation['blocks']} blocks of {block}, {evaluation['accepted_per_block']} accepted a block)\n")
    widths = sorted({1, *(d + 1 for d in depths)})
    lines, costs = [], []
    for n in streams:
        plain = plain_round_ms(target, target.tokenizer, n, args.tokens)
        rows = rows_ms(target.model, target.tokenizer, n, widths, args.reps)
        hold = lambda d, n=n: drafter.hold_ms(n, min(d, block))
        best = ceilings(plain, rows, depths, lambda d: expected_accepted(histogram, d, block), hold)
        costs.append([n, f"{plain:.2f}", f"{rows[1]:.2f}", *(f"{rows[d + 1] - rows[1]:.2f}" for d in depths)])
        lines.append([n, *(f"{best[k][0]:.2f}x at {best[k][1]}" for k in ("perfect", "shipped", "priced")),
                      " ".join(f"{d}:{hold(d):.1f}" for d in depths if d <= block)])
    print(table(["streams", "plain round ms", "forward 1 row ms", *(f"+{d} rows" for d in depths)], costs))
    print()
    print(table(["streams", "perfect drafts, free holds", "shipped acceptance, free holds",
                 "shipped acceptance, priced holds", "hold ms by depth"], lines))
    drafter.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(exit_code(main))
