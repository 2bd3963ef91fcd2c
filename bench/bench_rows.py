"""What a round costs by its rows: `tensorfold run --draft DRAFTER,N` by N, and the bare forward by rows."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from common import (LONG_PROMPTS, MODEL, SHORT_PROMPTS, BenchMismatch, blas_env, check_same_ids, exit_code,
                    fail_if_any, median, platform_lines, spread, table)

PROMPTS = [SHORT_PROMPTS[1], LONG_PROMPTS[2]]  # a short and a long code context


def check_run(prompt: str, depth: int, drafter: str, dtype: str, tokens: int, env: dict) -> dict:
    """One `tensorfold run --json` in a fresh process (N = 0: plain, no --draft)."""
    cmd = [sys.executable, "-m", "tensorfold_core", "run", MODEL, prompt, "--json", "--max-tokens", str(tokens),
           "--dtype", dtype, *(["--draft", f"{drafter},{depth}"] if depth else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env})
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def summary(run: dict) -> dict:
    """Decode rounds after the first (its time holds the first drafter pass): ms, tokens and rate."""
    rounds = [r for r in run["rounds"] if r["tokens"]][1:]
    ms = sum(r["ms"] for r in rounds)
    tokens = sum(r["tokens"] for r in rounds)
    return {"round_ms": median(r["ms"] for r in rounds), "tokens_per_round": tokens / len(rounds) if rounds else 0,
            "rate": 1000 * tokens / ms if ms else 0.0, "ids": run["token_ids"],
            "plain_ids": run.get("plain_token_ids", run["token_ids"]), "drafted": sum(r["drafted"] for r in rounds),
            "kept": sum(r["kept"] for r in rounds), "probe": run["row_invariance"]}


def forward_worker() -> int:
    """In-process: ms of one target forward + keep by window rows, and of a drafter chain by depth."""
    import mlx.core as mx

    from tensorfold_core.loading import load_model, start_drafter
    from tensorfold_core.protocols import DraftAsk
    from tensorfold_core.specs import DrafterOptions, LoadOptions

    job = json.load(sys.stdin)
    model, tokenizer, _ = load_model(MODEL, LoadOptions(dtype=job["dtype"]))
    context = tokenizer.encode(job["prompt"])
    drafters = {name: start_drafter(name, model, tokenizer, DrafterOptions(dtype=job["dtype"])) for name in job["drafters"]}
    times = {("rows", k): [] for k in job["rows"]}
    times.update({(name, d): [] for name in drafters for d in job["depths"]})
    for rep in range(job["reps"]):
        for k in job["rows"]:
            cache = model.new_cache(len(context) + 64)
            mx.eval(model.forward([cache], [context], [1]))
            model.keep(cache, len(context))
            for step in range(4):  # three to settle, the fourth timed
                start = time.perf_counter()
                mx.eval(model.forward([cache], [[100 + step] * k], [k]))
                model.keep(cache, 1)
            times[("rows", k)].append((time.perf_counter() - start) * 1000)
        for name, drafter in drafters.items():
            for d in job["depths"]:
                drafter.propose([DraftAsk(1, context, d)])  # the slot holds the context: a chain feeds one row
                start = time.perf_counter()
                drafter.propose([DraftAsk(1, context + [100 + rep], d)])
                times[(name, d)].append((time.perf_counter() - start) * 1000)
                drafter.release(1)
                drafter.shed_kept()
    print(json.dumps([[list(key), median(v)] for key, v in times.items()]))
    return 0


def forward_table(args, config: tuple[str, str]) -> None:
    dtype, blas = config
    job = {"dtype": dtype, "prompt": PROMPTS[0], "rows": list(range(1, args.max_rows + 1)),
           "depths": [d for d in args.depths if d], "reps": args.forward_reps,
           "drafters": [args.drafter, args.drafter + "-4bit"]}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--forward-worker"], input=json.dumps(job),
                          capture_output=True, text=True, env={**os.environ, **blas_env(blas)})
    if proc.returncode != 0:
        raise RuntimeError(f"forward worker failed: {proc.stderr[-2000:]}")
    got = {tuple(k): v for k, v in json.loads(proc.stdout.strip().splitlines()[-1])}
    one = got[("rows", 1)]
    print(f"\n### bare target forward + keep by window rows ({dtype}, BLAS {blas}; medians of {args.forward_reps})\n")
    print(table(["rows", "ms", "vs 1 row", "ms per extra row"],
                [[k, f"{got[('rows', k)]:.2f}", f"{got[('rows', k)] / one:.2f}x",
                  f"{(got[('rows', k)] - one) / (k - 1):.2f}" if k > 1 else "-"] for k in job["rows"]]))
    print(f"\n### drafter chain by depth ({dtype}, BLAS {blas}; medians of {args.forward_reps})\n")
    print(table(["depth", *[f"{name} ms" for name in job["drafters"]]],
                [[d, *[f"{got[(name, d)]:.2f}" for name in job["drafters"]]] for d in job["depths"]]))


def check(depth: int, cells: list[dict], reference: list[int]) -> None:
    """Every rep's ids at depth N, and the plain decode its run checked them against, are the N=0 reference's."""
    for rep, cell in enumerate(cells):
        check_same_ids(f"N={depth}, rep {rep + 1}", reference, cell["ids"])
        check_same_ids(f"N={depth}, rep {rep + 1}, its run's own plain decode", reference, cell["plain_ids"])


def report(args, config: tuple[str, str], runs: dict) -> list[BenchMismatch]:
    """The config's table; a depth whose ids differ gets FAIL and no speed, and comes back in the list."""
    dtype, blas = config
    print(f"\n## dtype {dtype}, BLAS {blas}: `tensorfold run --draft {args.drafter},N`\n")
    probe = runs[0][0]["probe"]
    print(f"row-invariance probe: {'pass' if probe.get('row_invariant') else 'FAIL'} ({probe.get('detail')})")
    reference = runs[0][0]["ids"]
    base = runs[0]
    rows, failures = [], []
    for depth in args.depths:
        cells = runs[depth]
        try:
            check(depth, cells, reference)
        except BenchMismatch as failure:
            failures.append(BenchMismatch(f"{dtype}, BLAS {blas}: {failure}"))
            rows.append([depth, f"FAIL: {failure}", *["-"] * 6])
            continue
        rates = [s["rate"] for s in cells]
        ratios = [a["rate"] / b["rate"] for a, b in zip(cells, base) if b["rate"]]
        offered, kept = sum(s["drafted"] for s in cells), sum(s["kept"] for s in cells)
        rows.append([depth, "equal", f"{median(s['round_ms'] for s in cells):.1f}",
                     f"{median(s['tokens_per_round'] for s in cells):.2f}",
                     f"{kept / offered:.0%}" if offered else "-", f"{median(rates):.1f}", spread(rates),
                     f"{median(ratios):.2f}x"])
    print(table(["N", "token ids", "round ms", "tokens/round", "drafts kept", "tok/s", "range", "vs N=0"], rows))
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--depths", default="0,1,2,3,4,5,6,7,8", help="comma list of N (0: plain)")
    parser.add_argument("--prompt", type=int, default=0, help=f"which prompt: 0..{len(PROMPTS) - 1}")
    parser.add_argument("--dtypes", default="auto,float32")
    parser.add_argument("--blas", default="bundled", help="comma list: bundled, openblas, openblas-CORE (e.g. openblas-nehalem)")
    parser.add_argument("--drafter", default="tiny-llama-drafter")
    parser.add_argument("--forward", action="store_true", help="also time the bare forward by rows and chains")
    parser.add_argument("--forward-reps", type=int, default=15)
    parser.add_argument("--max-rows", type=int, default=9)
    parser.add_argument("--forward-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.depths = sorted({int(d) for d in args.depths.split(",")} | {0})
    if args.forward_worker:
        return forward_worker()
    configs = [(d, b) for b in args.blas.split(",") for d in args.dtypes.split(",")]
    prompt = PROMPTS[args.prompt]
    print("\n".join(platform_lines(args.blas)))
    print(f"prompt {prompt[:40]!r}..., {args.tokens} tokens greedy, {args.reps} reps, depths alternate within a rep; "
          "round ms: median decode round after the first, drafter chain included")
    runs = {config: {d: [] for d in args.depths} for config in configs}
    for rep in range(args.reps):
        for config in configs:
            shift = rep % len(args.depths)
            for depth in args.depths[shift:] + args.depths[:shift]:
                run = check_run(prompt, depth, args.drafter, config[0], args.tokens, blas_env(config[1]))
                runs[config][depth].append(summary(run))
            print(f"rep {rep + 1} {config[0]}/{config[1]} done", file=sys.stderr)
    failures = [f for config in configs for f in report(args, config, runs[config])]
    fail_if_any(failures)  # the bare forward timed below is the one whose ids these tables checked
    if args.forward:
        for config in configs:
            forward_table(args, config)
    return 0


if __name__ == "__main__":
    sys.exit(exit_code(main))
