"""Slots kept full: a queue of requests fed to one engine as its streams leave, plain against served, every served
reply's ids equal to the plain one's before any rate prints.

    python3 tools/device/kept_full.py TARGET DRAFTER [--slots 8] [--requests 32] [--tokens 128] [--passes 3]
                                      [--hold-ahead]

A wave of N requests at once (bench_gpu_pair's streams cells, guard_trace.py) ends with its slowest reply: the
streams whose drafts land finish early, and the ones whose drafts do not are left decoding at two or three streams,
one token a round, through rounds the others' drafts made dearer. A server's slots are refilled as replies end, so
its rate is the rounds' own; this keeps `--slots` streams running from a queue of `--requests` (the code prompts,
cycled) until the queue is empty, one engine a mode for every pass (the first pass builds every kernel and shape and
teaches the guards, as a server's first requests do). Prints each pass's rates, the served engine's drafted windows,
the shared guard's verdicts by band, and each engine's time by round kind (rounds reading a prompt chunk, drafted
rounds, plain ones). `--hold-ahead` runs a third engine a pass, served with each drafting stream's next hold queued
before the host reads its verify (`TENSORFOLD_HOLD_AHEAD`). Run it through `run_on_h200.sh exec` on a GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


def kept_full(model, engine, requests, slots: int, split: dict | None = None) -> tuple[list[list[int]], float]:
    """The requests through one engine, at most `slots` at once, each next one admitted as a stream leaves: each
    reply's ids, and the wall seconds until the last one ended. `split` gathers the rounds by kind (round_kinds)."""
    from tensorfold_core.lanes.stream import Stream
    from tensorfold_core.lanes.types import TokenEvent

    replies: list[list[int]] = [[] for _ in requests]

    def taker(reply: list[int]):  # each reply's ids as they come: no walk over the events inside the timed rounds
        return lambda event: reply.extend(event.token_ids) if isinstance(event, TokenEvent) else None

    waiting = list(range(len(requests)))
    made = 0  # tokens emitted so far, for `split`
    start = time.perf_counter()
    while waiting or not engine.idle():
        while waiting and len(engine.streams) < slots:
            i = waiting.pop(0)
            limit = len(requests[i].prompt_ids) + requests[i].max_tokens
            engine.add(Stream(id=i, request=requests[i], cache=model.new_cache(limit), on_event=taker(replies[i]),
                              limit=limit))
        prompt = any(s.prefilling for s in engine.streams.values())
        drafts, began = engine.counters.drafts, time.perf_counter()
        engine.round()
        if split is not None:
            kind = "prompt" if prompt else "drafted" if engine.counters.drafts > drafts else "plain"
            now_made = sum(map(len, replies))
            seconds, rounds, tokens = split.get(kind, (0.0, 0, 0))
            split[kind] = (seconds + time.perf_counter() - began, rounds + 1, tokens + now_made - made)
            made = now_made
    seconds = time.perf_counter() - start
    return replies, seconds


def round_kinds(split: dict) -> str:
    """Where an engine's time went: rounds carrying a prompt chunk, drafted rounds (the drafter's or recall's drafts)
    and plain ones, with the tokens each kind gave a ms (a round's wall time: one run ahead is paid where the host
    next waits)."""
    return ", ".join(f"{kind} {rounds} rounds {seconds * 1e3:.0f} ms {made / (seconds * 1e3):.2f} tok/ms"
                     for kind, (seconds, rounds, made) in sorted(split.items()))


def verdicts(engine) -> str:
    """The shared guard's bands: each one's mode, whether it runs or measures, and its two rates in tokens a ms."""
    from guard_trace import band_streams

    rate = lambda r: "-" if r is None else f"{r:.2f}"
    mode = lambda b: f"{'drafted' if b.drafted else 'plain'} {'run' if b.running else 'measure'}"
    bands = [f"{band_streams(key)} streams: {mode(b)} (plain {rate(b.rates[False])}, drafted {rate(b.rates[True])})"
             for key, b in sorted(engine.planner.shared._bands.items())]
    return ", ".join(bands) or "no shared rounds"


def main(argv: list[str] | None = None) -> int:
    from guard_trace import served_pair

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("drafter")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--hold-ahead", action="store_true", help="a third engine, served with holds queued ahead")
    args = parser.parse_args(argv)

    from tensorfold_core.lanes.engine import Engine

    model, plain, served, requests = served_pair(args.target, args.drafter, args.slots, args.tokens, args.requests)
    engines = {"served": served}
    if args.hold_ahead:
        engines["ahead"] = Engine(model, shared_rounds=served.shared_rounds, drafter=served.drafter, timed=True,
                                  hold_ahead=True)
        engines["ahead"].time_rows(args.slots)
    print(f"{args.requests} requests of {args.tokens} tokens through {args.slots} slots kept full")
    for n in range(args.passes):
        plain_split = {}
        plain_ids, plain_s = kept_full(model, plain, requests(), args.slots, plain_split)
        parts = [f"pass {n}: plain {sum(map(len, plain_ids)) / plain_s:.1f} tok/s"]
        splits = [f"  plain: {round_kinds(plain_split)}"]
        for name, engine in engines.items():
            split, before = {}, engine.counters.drafts
            ids, seconds = kept_full(model, engine, requests(), args.slots, split)
            differ = next((i for i, (a, b) in enumerate(zip(plain_ids, ids)) if a != b), None)
            if differ is not None:
                print(f"pass {n}: request {differ}'s {name} reply differs from its plain one", file=sys.stderr)
                return 1
            parts.append(f"{name} {sum(map(len, ids)) / seconds:.1f} tok/s ({plain_s / seconds:.2f}x); {name} "
                         f"drafted windows {engine.counters.drafts - before}; {verdicts(engine)}")
            splits.append(f"  {name}: {round_kinds(split)}")
        print(", ".join(parts))
        print("\n".join(splits))
    return 0


if __name__ == "__main__":
    sys.exit(main())
