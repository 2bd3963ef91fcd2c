"""What the shared guard sees at N streams: every round it measures and every verdict, pass after pass.

    python3 tools/device/guard_trace.py TARGET DRAFTER [--streams 8] [--passes 5] [--tokens 128] [--width 2500]
                                        [--warm-up] [--served-first] [--keys]

Each pass decodes the same N code prompts at once on a plain engine, then on the served one (one engine for every
pass, as a server keeps one), checks the served replies equal the plain ones, and prints both rates with the
guard's log: `p8/5.1` a plain round of 8 streams that committed 8 tokens in 5.1 ms, `D37/8.9` a drafted one (`l` and
`L` the lone guard's plain and drafted rounds of one stream), `*` a round in the mode the guard did not ask for, `+`
one during which a compiled trace was made, `~` one that ran a forward from Python for a key met too few times to
trace, `^` one whose forward was queued a round ahead (taken from the lookahead's step), `@5` the stream count from
that round on, and each verdict between bars (each mode's rate in tokens a ms, the mode it runs next, and for how
many rounds). Then each engine's rounds tallied by kind (prompt chunks, traced, each guard's modes) and the served
rounds' phases (plan, catch-up, chain, the rest) for the pass's first rounds and its slow ones. Drafted rounds far
slower than their neighbours are what a measure of four rounds can pick plain on, and a plain verdict runs 512
rounds. `--warm-up` warms the pair up as a server does at load and `--served-first` runs each pass's served engine
before its plain one: with both, pass 0 is a warmed server's first requests, no plain pass having met their shapes;
`--keys` prints the keys of the traces each served pass made (what a warm-up did not meet).
Run it through `run_on_h200.sh exec`, with MLX's knobs set per run to compare (MLX_USE_CUDA_GRAPHS=1 puts back MLX's
CUDA graphs, which tensorfold_core turns off: contract/receipts/h200-2026-12-05d/ and -06g/).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


def band_streams(key: int) -> str:
    """The stream counts a shared guard's band key stands for: SharedGuard.band's inverse ("2", "3-4", "5-8")."""
    return f"{2 ** (key - 1) + 1}-{2 ** key}" if key > 1 else str(key + 1)


def traced_guard(log: list[str]) -> dict:
    """Log every round the shared guard observes and every verdict it reaches into `log`. The returned dict follows
    the served engine: "kind" the last round a guard observed (shared drafted, shared plain or lone), "phases" each
    timed round's plan/catch-up/chain/rest ms, "streams" the last logged stream count."""
    from tensorfold_core import traces
    from tensorfold_core.lanes.ahead import Lookahead
    from tensorfold_core.lanes.guards import DraftPlanner, LoneGuard, SharedGuard
    from tensorfold_core.row_kernels.modules import KeyCompiled

    observe, verdict, get, lone = SharedGuard.observe, SharedGuard._next, KeyCompiled.get, LoneGuard.observe
    take = Lookahead.take
    seen = {"untraced": 0, "at": (traces.count(), 0), "kind": None, "streams": None, "phases": [], "ahead": False,
            "made": []}

    def noted_take(self, turns):
        logits = take(self, turns)
        seen["ahead"] = logits is not None
        return logits

    def counted_get(self, key, make):
        made = key not in self.compiled
        compiled = get(self, key, make)
        seen["untraced"] += compiled is None
        if made and compiled is not None:
            seen["made"].append(key)
        return compiled

    def marks() -> str:
        """What happened since the last logged round: a trace made, a forward run untraced, a queued step taken."""
        now = (traces.count(), seen["untraced"])
        out = ("+" if now[0] != seen["at"][0] else "") + ("~" if now[1] != seen["at"][1] else "")
        seen["at"] = now
        return out + ("^" if seen["ahead"] else "")

    def logged_observe(self, streams, drafted, tokens, ms, catch_up=0.0):
        unasked = "*" if drafted != self._band(streams).drafted else ""
        count = f"@{streams}" if streams != seen["streams"] else ""
        seen["streams"] = streams
        log.append(f"{'D' if drafted else 'p'}{unasked}{tokens}/{ms:.1f}{marks()}{count}")
        seen["kind"] = "shared drafted" if drafted else "shared plain"
        return observe(self, streams, drafted, tokens, ms, catch_up)

    def lone_observe(self, stream, band, drafted, tokens, ms):
        log.append(f"{'L' if drafted else 'l'}{tokens}/{ms:.1f}{marks()}")
        seen["kind"] = "lone drafted" if drafted else "lone plain"
        return lone(self, stream, band, drafted, tokens, ms)

    def logged_verdict(self, entry):
        verdict(self, entry)
        key = next(k for k, e in self._bands.items() if e is entry)
        streams = band_streams(key)
        rate = lambda r: "-" if r is None else f"{r:.2f}"
        log.append(f"|{streams} streams: plain {rate(entry.rates[False])} drafted {rate(entry.rates[True])} -> "
                   f"{'drafted' if entry.drafted else 'plain'} {'run' if entry.running else 'measure'} {entry.run}|")

    SharedGuard.observe, SharedGuard._next, KeyCompiled.get = logged_observe, logged_verdict, counted_get
    Lookahead.take = noted_take
    LoneGuard.observe = lone_observe
    timed_round = DraftPlanner._time

    def phased(self, done, verified, end):
        caught = done.caught_up if done.caught_up is not None else done.planned
        marks = [done.start, done.planned, caught, done.proposed if done.proposed is not None else caught, end]
        if None not in marks:
            seen["phases"].append([b - a for a, b in zip(marks, marks[1:])])
        return timed_round(self, done, verified, end)

    DraftPlanner._time = phased
    return seen


def key_text(key) -> str:
    """A trace's key in brief: a whole forward's rows and caches' shapes (its layout left out), else the key."""
    if isinstance(key, tuple) and len(key) == 4 and isinstance(key[0], int):
        rows, _, tapped, shapes = key
        return f"[{rows} rows, taps {list(tapped)}, caches {sorted(set(shapes))}]"
    return f"[{key}]"


def phase_line(phases: list[list[float]], first: int = 8) -> str:
    """The first rounds' phases and every later round's over twice the median: total=plan/catch-up/chain/rest ms."""
    if not phases:
        return "-"
    median = sorted(map(sum, phases))[len(phases) // 2]
    picked = [(i, p) for i, p in enumerate(phases) if i < first or sum(p) > 2 * median]
    return " ".join(f"#{i}:{sum(p):.1f}=" + "/".join(f"{x:.1f}" for x in p) for i, p in picked)


def tallied(engine, seen: dict, tally: dict):
    """The engine's round, each call's wall time added to `tally` under "prompt" where a stream was prefilling at
    its start, "traced" where a compiled trace was made in it, else the kind of round a guard saw in it (none:
    "other", e.g. drafted rounds that offered no drafts)."""
    from tensorfold_core import traces

    round_ = engine.round

    def timed():
        prompt, traced, seen["kind"] = any(s.prefilling for s in engine.streams.values()), traces.count(), None
        start = time.perf_counter()
        out = round_()
        kind = "prompt" if prompt else "traced" if traces.count() != traced else seen["kind"] or "other"
        count, ms = tally.get(kind, (0, 0.0))
        tally[kind] = (count + 1, ms + (time.perf_counter() - start) * 1e3)
        return out

    return timed


def served_pair(target_dir: str, drafter_dir: str, slots: int, tokens: int, count: int, warm: bool = False):
    """The pair loaded as `serve` loads it: the model, a plain engine (no drafts at all, as `"draft": false`: not even
    copies from the prompt), a served one whose shared rounds' costs are primed for `slots` streams as a server's
    are, and a maker of `count` greedy requests of `tokens` over the code prompts; `warm`: warmed up as a server is."""
    from common import CODE_PROMPTS

    from tensorfold_core.lanes.engine import Engine
    from tensorfold_core.lanes.types import GenerationRequest
    from tensorfold_core.lanes.warm_up import warm_up
    from tensorfold_core.loading import load_target, start_drafter
    from tensorfold_core.options import ServeOptions
    from tensorfold_core.specs import DrafterOptions

    options = ServeOptions()
    target = load_target(target_dir, options)
    drafter = start_drafter(drafter_dir, target.model, target.tokenizer, DrafterOptions())
    prompts = [target.tokenizer.encode(p) for p in CODE_PROMPTS]
    requests = lambda: [GenerationRequest(prompt_ids=prompts[i % len(prompts)], max_tokens=tokens,
                                          stop_token_ids=frozenset()) for i in range(count)]
    plain = Engine(target.model, shared_rounds=target.row_invariant, copy_drafts=False)
    served = Engine(target.model, shared_rounds=target.row_invariant, drafter=drafter, timed=True)
    served.time_rows(slots)
    if warm:
        warmed = warm_up(target.model, prefill_chunk=options.prefill_chunk, context=target.context(options.context),
                         shared_rounds=target.row_invariant, drafter=drafter)
        print(f"warmed up: {warmed}")
    return target.model, plain, served, requests


def main(argv: list[str] | None = None) -> int:
    from bench_gpu_pair import together

    from tensorfold_core import traces

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("drafter")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--width", type=int, default=2500, help="characters of each pass's log printed")
    parser.add_argument("--warm-up", action="store_true", help="warm up at load as a server does")
    parser.add_argument("--served-first", action="store_true", help="each pass's served engine before its plain one")
    parser.add_argument("--keys", action="store_true", help="print the keys of the traces each served pass made")
    args = parser.parse_args(argv)

    model, plain, served, requests = served_pair(args.target, args.drafter, args.streams, args.tokens, args.streams,
                                                 args.warm_up)
    log = []
    seen, tally = traced_guard(log), {}
    plain_tally = {}
    plain.round, served.round = tallied(plain, seen, plain_tally), tallied(served, seen, tally)

    def plain_pass():
        """The plain engine's replies and seconds for a pass, its rounds tallied afresh."""
        plain_tally.clear()
        return together(model, plain, requests())

    for n in range(args.passes):  # the first pass builds every kernel and shape, and the guard's first verdicts
        if not args.served_first:
            plain_ids, plain_s = plain_pass()
        log.clear()
        tally.clear()
        seen["phases"].clear()
        seen["made"].clear()
        seen["streams"] = None
        seen["at"] = (traces.count(), seen["untraced"])  # marks from the served pass alone, not the plain one
        served_ids, served_s = together(model, served, requests())
        if args.served_first:
            plain_ids, plain_s = plain_pass()
        if served_ids != plain_ids:
            print(f"pass {n}: the served replies differ from the plain ones", file=sys.stderr)
            return 1
        tokens = sum(map(len, served_ids))
        print(f"pass {n}: plain {tokens / plain_s:.1f} tok/s, served {tokens / served_s:.1f} tok/s "
              f"({plain_s / served_s:.2f}x)")
        print("  " + " ".join(log)[:args.width])
        for name, counts in (("plain", plain_tally), ("served", tally)):
            kinds = sorted(counts.items())
            print(f"  {name} rounds: " + ", ".join(f"{kind} {n} in {ms:.1f} ms" for kind, (n, ms) in kinds))
        print(f"  served round phases (#round:total=plan/catch-up/chain/rest ms): {phase_line(seen['phases'])}")
        if args.keys:
            print(f"  traces the served pass made ({len(seen['made'])}): " + " ".join(map(key_text, seen["made"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
