"""A shipped DSpark pair (tiny-lfm2-moe or tiny-lfm2 drafted by its DSpark drafter) against its plain decode on code
or random prompts, ids checked first."""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass

import openai

from common import (CODE_PROMPTS, BenchMismatch, blas_env, check_same_ids, complete, drafts_by_source, exit_code,
                    fail_if_any, median, platform_lines, random_prompts, server, spread, table, tokenize)

PAIRS = {"tiny-lfm2-moe": "tiny-lfm2-moe-dspark", "tiny-lfm2": "tiny-lfm2-dspark"}  # target -> its shipped drafter
WARM_UP = "x = 1\n"  # a prompt no timed request uses, so its kept state helps none of them
# the long cell's contexts: stdlib modules' own source, cut to fit the target's 2,048 positions with the reply
LONG_MODULES = ("textwrap", "fractions", "shlex", "calendar", "string", "glob", "bisect", "heapq")
LONG_TOKENS = 1800


@dataclass(frozen=True)
class Cell:
    """One way of decoding: the server's flags and the requests' `draft` field."""

    name: str
    what: str
    flags: tuple[str, ...]
    draft: bool
    env: tuple[tuple[str, str], ...] = ()


def all_cells(drafter: str) -> list[Cell]:
    """Every way of decoding the bench knows, its DSpark cells drafting with `drafter`."""
    return [
        Cell("plain", "`--drafter none`, requests `\"draft\": false` (the reference)", ("--drafter", "none"), False),
        Cell("copy", "`--drafter none`, requests drafted (copy drafts only)", ("--drafter", "none"), True),
        Cell("dspark", f"`--drafter {drafter}`, requests drafted (DSpark and copy drafts)", ("--drafter", drafter),
             True),
        # not run unless named (--cells): the drafter's 8-bit codes read in place on the CPU, as before they were
        # unpacked
        Cell("dspark-codes", "as dspark, the drafter's codes read in place (`TENSORFOLD_UNPACK_ONCE=0`)",
             ("--drafter", drafter), True, (("TENSORFOLD_UNPACK_ONCE", "0"),)),
        # a drafting stream's next hold queued on its verify's device draws before the host reads them
        Cell("dspark-ahead", "as dspark, holds queued before the verify is read (`TENSORFOLD_HOLD_AHEAD=1`)",
             ("--drafter", drafter), True, (("TENSORFOLD_HOLD_AHEAD", "1"),)),
        # and the target's CPU forward as it was: a rope a stream, then every layer part op by op
        Cell("plain-rope-a-stream", "as plain, q and k roped a stream at a time (`TENSORFOLD_ROPE_ROWS=0`)",
             ("--drafter", "none"), False, (("TENSORFOLD_ROPE_ROWS", "0"),)),
        Cell("plain-op-by-op", "as plain, every layer part op by op (`TENSORFOLD_COMPILE=0`)", ("--drafter", "none"),
             False, (("TENSORFOLD_COMPILE", "0"),)),
    ]


DEFAULT_CELLS = "plain,copy,dspark"
BASELINE = "plain"


def sampling(args, i: int) -> dict:
    if args.workload == "random":  # the adversarial cell: text no drafter has seen, sampled hot
        return {"temperature": 1.0, "seed": 1000 + i}
    return {"temperature": 0.0, "seed": None} if args.sampling == "greedy" else {"temperature": 0.8, "seed": 100 + i}


def stdlib_sources(args) -> list[list[int]]:
    """The long cell's stdlib modules' own source, tokenized whole."""
    return tokenize([inspect.getsource(importlib.import_module(m)) for m in LONG_MODULES[:args.prompts or 4]],
                    args.pair)


def workload(args) -> list[list[int]]:
    if args.workload == "random":
        return random_prompts(args.prompts or 8, 64, seed=0)
    if args.workload == "long":
        return [ids[:LONG_TOKENS] for ids in stdlib_sources(args)]
    return tokenize(CODE_PROMPTS[:args.prompts or len(CODE_PROMPTS)], args.pair)


def cell_server(cell: Cell, streams: int, args):
    """The cell's server (a context manager giving its url), sized for `streams` replies at once; a kept one keeps
    no prompt states, or each rep after the first would copy its replies whole from the last rep's (Recall)."""
    kept = ["--prompt-cache-gib", "0"] if args.warm else []
    flags = ["--dtype", args.dtype, "--parallel", str(max(4, streams)), *cell.flags, *kept, *args.serve_flags.split()]
    return server(args.pair, *flags, env={**blas_env(args.blas), **dict(cell.env)})


def decode_all(url: str, cell: Cell, streams: int, prompts: list[list[int]], args) -> dict:
    """Every prompt once, `streams` at a time, on the server at `url`; the replies and the decode rate."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=1200)
    send = lambda i: complete(client, prompts[i], args.tokens, draft=cell.draft, model=args.pair, **sampling(args, i))
    complete(client, tokenize([WARM_UP], args.pair)[0], 8, draft=cell.draft, model=args.pair)
    before = drafts_by_source(url)
    start = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        replies = list(pool.map(send, range(len(prompts))))
    wall = time.perf_counter() - start
    after = drafts_by_source(url)
    sources = {source: tuple(a - b for a, b in zip(counts, before.get(source, (0.0, 0.0))))
               for source, counts in after.items()}
    return {"replies": replies, "rate": sum(len(r["ids"]) for r in replies) / wall, "sources": sources}


def warm_workload(args) -> list[list[int]]:
    """Prompts of the workload's kind that no timed request repeats (a kept server would copy a repeated request's
    reply from its kept state): other random ids, or stdlib source cut to the code prompts' length."""
    if args.workload == "random":
        return random_prompts(args.prompts or 8, 64, seed=1)
    length = LONG_TOKENS if args.workload == "long" else 160
    return [ids[-length:] for ids in stdlib_sources(args)]


def run_cell(cell: Cell, streams: int, prompts: list[list[int]], args, urls: dict[str, str]) -> dict:
    """The cell's kept server where `--warm` started one (`urls`), else a fresh one: the replies and the rate."""
    if cell.name in urls:
        return decode_all(urls[cell.name], cell, streams, prompts, args)
    with cell_server(cell, streams, args) as url:
        return decode_all(url, cell, streams, prompts, args)


def columns(runs: list[dict]) -> tuple[str, str, str]:
    """Tokens committed per stream round, drafts kept / offered over every reply of the cell, and kept / offered
    by the proposer that gave them (the server's /metrics around each run)."""
    replies = [r for run in runs for r in run["replies"]]
    tokens = sum(len(r["ids"]) for r in replies)
    rounds = sum(r["stats"].get("rounds", 0) for r in replies)
    offered, kept = (sum(r["stats"].get(k, 0) for r in replies) for k in ("drafted", "accepted"))
    by_source: dict[str, list[float]] = {}
    for run in runs:
        for source, (source_offered, source_kept) in run["sources"].items():
            totals = by_source.setdefault(source, [0.0, 0.0])
            totals[0], totals[1] = totals[0] + source_offered, totals[1] + source_kept
    sources = ", ".join(f"{source} {k:.0f}/{o:.0f}" for source, (o, k) in sorted(by_source.items()) if o) or "-"
    return ((f"{tokens / rounds:.2f}" if rounds else "-"),
            (f"{kept}/{offered} ({kept / offered:.0%})" if offered else "0"), sources)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pair", default="tiny-lfm2-moe", choices=list(PAIRS),
                        help="the target; its shipped DSpark drafter drafts")
    parser.add_argument("--tokens", type=int, default=128, help="max_tokens of each reply")
    parser.add_argument("--reps", type=int, default=3, help="rounds over every cell, in a rotated order")
    parser.add_argument("--workload", default="code", choices=["code", "random", "long"],
                        help="code: the code prompts; random: 64-id random-token prompts at temperature 1.0, a seed "
                        f"each (the adversarial cell); long: {LONG_TOKENS}-token contexts of stdlib source, greedy")
    parser.add_argument("--prompts", type=int, default=0,
                        help="how many prompts (0: all 11 code prompts, 8 random, 4 long)")
    parser.add_argument("--streams", default="1", help="comma list of concurrent stream counts")
    parser.add_argument("--sampling", default="greedy", choices=["greedy", "seeded"],
                        help="the code prompts: greedy, or temperature 0.8 with a seed per prompt")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--blas", default="openblas-nehalem", help="bundled, openblas, openblas-CORE")
    parser.add_argument("--serve-flags", default="", help="more flags for every cell's server, e.g. "
                        "'--prompt-cache-gib 0' (no kept prompt states, so no Recall copies)")
    names = ", ".join(c.name for c in all_cells("DRAFTER"))
    parser.add_argument("--cells", default=DEFAULT_CELLS, help=f"comma list of {names}; "
                        f"{BASELINE} always runs")
    parser.add_argument("--warm", action="store_true",
                        help="one server a cell for the whole run, each first decoding prompts of the workload's kind "
                        "(none a timed one) untimed at every stream count, so the timed reps meet servers whose "
                        "guards have learned, as on a server that has run a while; their prompt caches off, so no rep "
                        "copies the last one's replies (default: a fresh server a cell a rep, its learning timed)")
    args = parser.parse_args(argv)
    known = {c.name: c for c in all_cells(PAIRS[args.pair])}
    unknown = [name for name in args.cells.split(",") if name not in known]
    if unknown:
        parser.error(f"--cells: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    cells = [c for c in known.values() if c.name == BASELINE or c.name in args.cells.split(",")]
    prompts = workload(args)
    levels = [int(s) for s in args.streams.split(",")]
    print("\n".join(platform_lines(args.blas)))
    how = {"random": "random, temperature 1.0, seeded", "long": f"long: {LONG_TOKENS}-token stdlib sources, "
           f"{args.sampling}"}.get(args.workload, f"code, {args.sampling}")
    print(f"{args.pair} drafted by {PAIRS[args.pair]}, dtype {args.dtype}; {len(prompts)} prompts ({how}), "
          f"{args.tokens} tokens each; "
          f"{args.reps} reps; " + ("one server a cell, warmed by an untimed pass, no prompt cache" if args.warm else
                                   "a fresh server per cell") + ", cells in a rotated order"
          + (f"; every server with {args.serve_flags}" if args.serve_flags else ""))
    runs = {(c.name, n): [] for c in cells for n in levels}
    with ExitStack() as kept:
        urls = {c.name: kept.enter_context(cell_server(c, max(levels), args)) for c in cells} if args.warm else {}
        warm = warm_workload(args) if args.warm else []
        for n in levels if args.warm else ():
            for c in cells:
                decode_all(urls[c.name], c, n, warm, args)
        for rep in range(args.reps):
            for n in levels:
                shift = rep % len(cells)
                for c in cells[shift:] + cells[:shift]:
                    started = time.perf_counter()
                    runs[c.name, n].append(run_cell(c, n, prompts, args, urls))
                    print(f"rep {rep + 1} {c.name} x{n}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
    reference = [r["ids"] for r in runs[BASELINE, levels[0]][0]["replies"]]
    rows, failures = [], []
    for n in levels:
        base = [r["rate"] for r in runs[BASELINE, n]]
        for c in cells:
            try:  # every rep's every reply against the first plain run's, before any speed is quoted
                for rep, run in enumerate(runs[c.name, n]):
                    for i, reply in enumerate(run["replies"]):
                        check_same_ids(f"{c.name} x{n}, rep {rep + 1}, prompt {i}", reference[i], reply["ids"])
            except BenchMismatch as failure:
                failures.append(failure)
                rows.append([c.name, n, f"FAIL: {failure}", "-", "-", "-", "-", "-", "-"])
                continue
            rates = [r["rate"] for r in runs[c.name, n]]
            ratios = [a / b for a, b in zip(rates, base) if b]
            per_round, kept, sources = columns(runs[c.name, n])
            rows.append([c.name, n, "equal", f"{median(rates):.1f}", spread(rates), f"{median(ratios):.2f}x",
                         per_round, kept, sources])
    print()
    print(table(["cell", "streams", "token ids", "tok/s (median)", "range", f"vs {BASELINE}", "tokens/round",
                 "drafts kept", "kept by source"], rows))
    print("\n".join(f"- {c.name}: {c.what}" for c in cells))
    fail_if_any(failures)
    return 0


if __name__ == "__main__":
    sys.exit(exit_code(main))
