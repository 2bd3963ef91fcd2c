"""Where a plain decode's host time goes: cProfile of one greedy stream (and of N streams at once) on a checkpoint.

    python3 tools/device/profile_decode.py TARGET [--tokens 128] [--streams 8] [--top 25] [--census] [--drafter DIR]
        [--code-prompts]

Each run is decoded once untimed (MLX builds its kernels on first use), then once under cProfile; prints the tok/s
(only where every reply's ids equal the plain engine's: a mismatch exits 1 with no rate) and the functions by their
own time. Time inside `numpy.array` is the engine's read of the logits, waiting for the device (and for MLX's
evaluation of the graph on the host); the rest is Python building graphs and planning rounds. Run it under the
kernel table mode to profile (TENSORFOLD_KERNELS, through run_on_h200.sh exec).
`--census` first counts the primitives of one decode step's graph (one stream, then N), which is what MLX evaluates
on the host node by node: where that evaluation is the cost of a token, fewer nodes is the lever. `--drafter DIR`
profiles the served engine too (the drafter, copy drafts, priced depths, as a server runs them) beside plain, so a
served engine's own cost per round shows against plain's: its rounds, windows drafted and rounds run ahead print,
and a round's phases timed unprofiled (planning, building forwards in step, queueing run-ahead steps, the rest).
`--depth N` profiles a drafted engine too (every window N drafts, no copies, as bench_gpu_pair's drafted cell), and
planning splits into the drafter's chain, its catch-up, the copy lookups, the planner's prices and the rest, and
the rest of the round into the read of the verify's rows (the wait for the device) and the host's work after it.
After each served run, its lone guard's bands print (the plain rate each judges drafting against), and the
phased run says what its rounds told the guards (a lone or shared rate, or why none: a trace, a copy, no drafts);
a last run names each round by what it carried and did for the next (queued it, or held it and why), the first
reply's rounds as letters: where a plain stretch does not run ahead, they say which rounds broke it.
With `--census`, the drafter's own step graph is counted beside the target's. (`round_time.py` times the same parts
each alone and synced; these phases are as rounds run them, overlaps and all.)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import re
import sys
import tempfile
from collections import Counter
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

PROMPT = "def quicksort(items):\n    if len(items) <= 1:\n        return items\n"


def profiled(run, top: int, dump: Path | None = None) -> str:
    """`run()` under cProfile: the top functions by their own time, as text; the whole profile to `dump` if named."""
    profile = cProfile.Profile()
    profile.enable()
    run()
    profile.disable()
    if dump is not None:
        profile.dump_stats(dump)
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def phased(engine, run) -> str:
    """`run()` with the engine's phases timed unprofiled (cProfile inflates Python several times over): ms a round in
    the drafter's chain and catch-up, the rest of planning (prices), building forwards that ran in step, queueing
    run-ahead steps, reading rows (the wait for the device), and the rest (the draws, the commits); a served engine's
    rounds with drafts and without apart too, since a few drafted rounds hide what its plain rounds cost."""
    spent: Counter = Counter()
    by_kind: dict[str, Counter] = {"plain rounds": Counter(), "drafted rounds": Counter()}

    def timed(name: str, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start
        return wrapper

    def sorted_round():
        before, drafted = Counter(spent), engine.counters.verdicts.get("drafted", 0)
        start = time.perf_counter()
        try:
            return engine_round()
        finally:
            kind = by_kind["drafted rounds" if engine.counters.verdicts.get("drafted", 0) > drafted else "plain rounds"]
            kind.update({name: spent[name] - before[name] for name in spent})
            kind["round"] += time.perf_counter() - start
            kind["rounds"] += 1

    from tensorfold_core.lanes import engine as engine_module

    class TimedNumpy:  # the engine's module-level numpy, its `array` (the read that waits for the device) timed
        def __getattr__(self, name):
            return getattr(np, name)

        array = staticmethod(timed("read (device wait)", np.array))

    drafter, engine_round = engine.drafter, engine.round
    engine.plan, engine._forward = timed("plan", engine.plan), timed("forward in step", engine._forward)
    engine.ahead.launch, engine.round = timed("queue ahead", engine.ahead.launch), sorted_round
    if drafter is not None:  # inside the plan: told apart below (0 where the planner asked no drafts)
        drafter.propose, drafter.catch_up = timed("chain", drafter.propose), timed("catch-up", drafter.catch_up)
        spent.update({"chain": 0.0, "catch-up": 0.0})
    # inside the plan too: the copy lookups and the planner's prices (0 where the round asks none)
    copy, planner = engine.copy, engine.planner
    copy.propose, planner.plan = timed("copies", copy.propose), timed("prices", planner.plan)
    spent.update({"copies": 0.0, "prices": 0.0})
    engine_module.np = TimedNumpy()
    told, planner_time = Counter(), planner._time

    def told_time(done, verified, end):
        told[guard_round(done, verified)] += 1
        return planner_time(done, verified, end)

    planner._time = told_time
    start = time.perf_counter()
    try:
        run()
    finally:
        engine_module.np = np
        del engine.plan, engine._forward, engine.ahead.launch, engine.round  # the class's own methods again
        del copy.propose, planner.plan, planner._time
        if drafter is not None:
            del drafter.propose, drafter.catch_up
    total = time.perf_counter() - start
    lines = [phase_line(spent, total, sum(kind["rounds"] for kind in by_kind.values()))]
    if drafter is not None:
        lines += [f"  {name}: " + phase_line(kind, kind["round"], kind["rounds"])
                  for name, kind in by_kind.items() if kind["rounds"]]
    if told:
        lines.append("  the guards were told: " + ", ".join(f"{n} {what}" for what, n in told.most_common()))
    return "\n".join(lines)


ROUND_LETTERS = {"drafter": "D", "copy": "C", "grammar": "G", "guarded": "g", "none": "n", "ahead": "a",
                 "prompt": "p"}


def tallied(engine, run) -> str:
    """`run()` with each round of the engine named: what its windows carried (the drafter's drafts, a copy, none
    because a guard ran it plain, none though the guards let it draft, a step queued by the last round, a prompt
    chunk) and what it did for the next round (queued it, held it since a stream may draft next and why, or could
    not); then the rounds of the first stream's reply as letters, since a plain stretch's breaks show there."""
    seen: dict = {"turns": [], "guards": None}
    rows: Counter = Counter()
    letters: list[str] = []
    engine_plan, engine_round, guards_draft = engine.plan, engine.round, engine.planner.guards_draft

    def plan():
        seen["turns"] = engine_plan()
        return seen["turns"]

    def told_guards(*args, **kwargs):
        seen["guards"] = guards_draft(*args, **kwargs)
        return seen["guards"]

    def named_round():
        seen["guards"], used, held = None, engine.ahead.used, engine.ahead.held
        undrafted = dict(engine._undrafted)
        went = engine_round()
        if not went:
            return went
        turns = [t for t in seen["turns"] if t.draws]
        if engine.ahead.used > used:
            kind = "ahead"
        elif not turns:
            kind = "prompt"
        elif any(t.drafts and t.source == getattr(engine.drafter, "name", None) for t in turns):
            kind = "drafter"
        elif any(t.drafts for t in turns):
            kind = "grammar" if all(t.source == "grammar" for t in turns if t.drafts) else "copy"
        else:
            kind = "guarded" if seen["guards"] is False else "none"
        if engine.ahead.launched is not None:
            then = "queued the next"
        elif engine.ahead.held > held:
            counts = sorted({undrafted.get(t.stream.id, 0) for t in turns})
            then = "held: undrafted " + "/".join(map(str, counts))
        else:
            then = "in step"
        rows[(kind, then)] += 1
        ids = {t.stream.id for t in seen["turns"]}
        seen.setdefault("first", min(ids, default=None))  # the stream of the run's first round
        if seen["first"] in ids:
            letters.append(ROUND_LETTERS[kind])
        return went

    engine.plan, engine.round, engine.planner.guards_draft = plan, named_round, told_guards
    try:
        run()
    finally:
        del engine.plan, engine.round, engine.planner.guards_draft
    kinds = Counter()
    for (kind, _), n in rows.items():
        kinds[kind] += n
    lines = ["rounds by what they carried, then what they did for the next round:"]
    for kind, n in kinds.most_common():
        thens = ", ".join(f"{then} {m}" for (k, then), m in sorted(rows.items(), key=lambda r: -r[1]) if k == kind)
        lines.append(f"  {kind} {n}: {thens}")
    legend = " ".join(f"{letter} {kind}" for kind, letter in ROUND_LETTERS.items())
    lines.append(f"  first reply's rounds ({legend}): " + "".join(letters))
    return "\n".join(lines)


def guard_round(done, verified) -> str:
    """What a timed round tells the guards (`guards.told_kind`, as DraftPlanner._time decides), in words."""
    from tensorfold_core import traces
    from tensorfold_core.lanes.guards import told_kind

    kind = told_kind(done, verified, traces.count() != done.traces)
    mode = "drafted" if done.drafted else "plain"
    return {"prompt": "prompt or idle rounds (unmeasured)", "traced": "rounds that traced a shape (unmeasured)",
            "no drafts": "drafted rounds with no drafts (plain in disguise)",
            "lone copy": "lone copy rounds (the lone guard skips them)"}.get(kind, f"{kind} {mode} rounds")


def phase_line(spent: Counter, total: float, rounds: int) -> str:
    """One line of phases in ms a round: the plan's parts apart, the rest what no timed phase holds."""
    inside = ("chain", "catch-up", "copies", "prices")
    timed = sum(spent[name] for name in spent if name not in ("round", "rounds"))
    parts = {**spent, "plan": spent["plan"] - sum(spent[name] for name in inside),
             "rest (draw, commit)": total - timed + sum(spent[name] for name in inside)}
    order = (*inside, "plan", "forward in step", "queue ahead", "read (device wait)", "rest (draw, commit)")
    n = max(rounds, 1)
    return "  ".join(f"{name} {1e3 * parts[name] / n:.3f}" for name in order if name in parts) \
        + f"  (ms a round, {n} rounds)"


def lone_bands(engine) -> str:
    """The served engine's lone guard, band by band: the plain rate its drafted stretches are judged against, the
    drafted rounds judged since it was read, and the band's verdict (a stale plain rate lets drafting win)."""
    lone = engine.planner.lone
    lines = []
    for (greedy, bits), entry in sorted(lone._bands.items()):
        plain = "unread" if entry.plain is None else f"{entry.plain:.3f} tok/ms ({entry.plain_round_ms:.2f} ms a round)"
        lines.append(f"  band {'greedy' if greedy else 'sampled'} ctx<2^{bits}: plain {plain}, {entry.since_plain} "
                     f"drafted rounds since, refresh at {entry.refresh}, losses {entry.losses}, wait {entry.wait}")
    return "\n".join(["lone guard bands:", *lines] if lines else ["lone guard bands: none"])


def census(model, tokenizer, streams: int) -> Counter:
    """The primitives of one decode step's graph over `streams` streams (their prompts read first), by name."""
    import mlx.core as mx

    caches = [model.new_cache(256) for _ in range(streams)]
    ids = tokenizer.encode(PROMPT)
    mx.eval(model.forward(caches, [ids] * streams, [1] * streams))
    for cache in caches:
        model.keep(cache, len(ids))
    logits = model.forward(caches, [ids[-1:]] * streams, [1] * streams)
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as dot:
        mx.export_to_dot(dot.name, logits)
        labels = re.findall(r'\[label ="([^"]*)", shape=rectangle\]', dot.read())
    mx.eval(logits)
    return Counter(labels)


def printed_census(model, tokenizer, streams: int) -> None:
    counts = census(model, tokenizer, streams)
    layers = len(model.model.layers) if hasattr(model, "model") and hasattr(model.model, "layers") else 1
    print(f"\n== graph of one decode step, {streams} stream(s): {sum(counts.values())} primitives "
          f"({sum(counts.values()) / layers:.1f} a layer over {layers} layers)")
    for name, n in counts.most_common():
        print(f"  {n:5d}  {name}")


def main(argv: list[str] | None = None) -> int:
    from bench_gpu_pair import together
    from common import CODE_PROMPTS, BenchMismatch, check_same_replies

    from tensorfold_core.lanes.engine import Engine
    from tensorfold_core.lanes.types import GenerationRequest
    from tensorfold_core.loading import load_target
    from tensorfold_core.options import ServeOptions

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--census", action="store_true", help="count one decode step's graph primitives first")
    parser.add_argument("--drafter", help="also profile the served engine with this drafter")
    parser.add_argument("--depth", type=int, default=0, help="and a drafted engine, N drafts a window (with --drafter)")
    parser.add_argument("--code-prompts", action="store_true", help="stream i decodes bench/common.py's code prompt "
                        "i (as bench_gpu_pair's streams cells), not one prompt for all")
    parser.add_argument("--dump", type=Path, help="write each run's whole profile here (STREAMS-ENGINE.prof), "
                        "for pstats' callers and cumulative views")
    args = parser.parse_args(argv)
    target = load_target(args.target, ServeOptions(dtype="bfloat16"))
    model, tokenizer = target.model, target.tokenizer
    drafter = None
    if args.drafter:
        from tensorfold_core.loading import start_drafter
        from tensorfold_core.specs import DrafterOptions

        drafter = start_drafter(args.drafter, model, tokenizer, DrafterOptions(dtype="bfloat16"))
    print(f"kernels {model.kernels}\nprobe {target.probe}")
    if args.census:
        for streams in sorted({1, args.streams}):
            printed_census(model, tokenizer, streams)
        if drafter is not None and hasattr(getattr(drafter, "model", None), "forward"):
            print("\n== the drafter's step:", end="")
            printed_census(drafter.model, tokenizer, 1)
    for streams in sorted({1, args.streams}):
        texts = CODE_PROMPTS if args.code_prompts else [PROMPT]
        requests = [GenerationRequest(prompt_ids=tokenizer.encode(texts[i % len(texts)]), max_tokens=args.tokens,
                                      stop_token_ids=frozenset()) for i in range(streams)]
        engines = {"plain": Engine(model, shared_rounds=target.row_invariant, copy_drafts=False)}
        if drafter is not None and args.depth:
            engines["drafted"] = Engine(model, shared_rounds=target.row_invariant, drafter=drafter,
                                        fixed_depth=args.depth, copy_drafts=False)
        if drafter is not None:
            engines["served"] = Engine(model, shared_rounds=target.row_invariant, drafter=drafter, timed=True)
            engines["served"].time_rows(streams)  # as a server of that many slots primes its shared rounds' costs
        plain_ids = None
        for name, engine in engines.items():
            together(model, engine, requests)  # warm: every shape built once
            before = (engine.rounds, engine.ahead.used, dict(engine.counters.verdicts))
            start = time.perf_counter()
            ids, _ = together(model, engine, requests)
            rate = streams * args.tokens / (time.perf_counter() - start)
            plain_ids = ids if plain_ids is None else plain_ids
            try:  # a rate whose replies are not plain's is no rate
                check_same_replies(f"{streams} stream(s), {name}", plain_ids, ids)
            except BenchMismatch as exc:
                print(f"MISMATCH {exc}: no rate", file=sys.stderr)
                return 1
            rounds, ahead = engine.rounds - before[0], engine.ahead.used - before[1]
            drafted = engine.counters.verdicts.get("drafted", 0) - before[2].get("drafted", 0)
            print(f"\n== {streams} stream(s), {name}: {rate:.1f} tok/s unprofiled; {rounds} rounds, {ahead} run "
                  f"ahead, {drafted} windows drafted; replies equal plain's")
            print(phased(engine, lambda: together(model, engine, requests)))
            if name == "served":
                print(lone_bands(engine))
                print(tallied(engine, lambda: together(model, engine, requests)))
            dump = args.dump / f"{streams}-{name}.prof" if args.dump else None
            if dump is not None:
                dump.parent.mkdir(parents=True, exist_ok=True)
            print(profiled(lambda: together(model, engine, requests), args.top, dump))
    return 0


if __name__ == "__main__":
    sys.exit(main())
