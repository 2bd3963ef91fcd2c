"""The depth rule against measurement: priced drafter rounds vs fixed depths and plain, in-process, ids first."""

from __future__ import annotations

import argparse
import sys
import time

from common import (LONG_PROMPTS, MODEL, SHORT_PROMPTS, BenchMismatch, check_same_ids, exit_code, fail_if_any, median,
                    platform_lines, random_prompts, spread, table)

WORKLOADS = {
    "short": "the short code prompts on a fresh engine",
    "long": "the long code contexts (106-202 prompt tokens) on a fresh engine",
    "after-random": "the short code prompts after --random-streams random-token streams at temperature 1.0",
}


class Timed:
    """Wraps a drafter's catch-up and propose: (chain ms, rows fed with the catch-up's, deepest chain) a round."""

    def __init__(self, drafter):
        self.drafter, self.calls, self._caught_up = drafter, [], 0
        self._propose, self._catch_up = drafter.propose, drafter.catch_up
        drafter.propose, drafter.catch_up = self.propose, self.catch_up

    def catch_up(self, asks):
        self._caught_up = self._catch_up(asks)
        return self._caught_up

    def propose(self, asks):
        rows, start = self.drafter.stats["rows"], time.perf_counter()
        out = self._propose(asks)
        fed = self.drafter.stats["rows"] - rows + self._caught_up
        self.calls.append(((time.perf_counter() - start) * 1000, fed, max(a.depth for a in asks)))
        self._caught_up = 0
        return out

    def step_ms(self) -> float:
        """A chain step's time where the chain fed at most two rows first (no catch-up)."""
        return median(ms / depth for ms, rows, depth in self.calls if rows <= depth + 1)

    def largest_feed(self) -> int:
        return max((rows for _, rows, _ in self.calls), default=0)


def check_against_plain(label: str, got: dict[str, list[int]], failures: dict[str, BenchMismatch]) -> None:
    """Each engine's ids against the plain engine's on the same prompt; an engine keeps its first failure."""
    for name, tokens in got.items():
        try:
            check_same_ids(f"{label}: engine {name}", got["plain"], tokens)
        except BenchMismatch as failure:
            failures.setdefault(name, failure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--depths", default="1,2,3", help="fixed depths to compare (check mode's windows)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma list of " + ", ".join(WORKLOADS))
    parser.add_argument("--random-streams", type=int, default=12)
    parser.add_argument("--drafter", default="tiny-llama-drafter")
    args = parser.parse_args(argv)

    from tensorfold_core.loading import load_target, start_drafter
    from tensorfold_core.lanes.engine import Engine
    from tensorfold_core.lanes.stream import Stream
    from tensorfold_core.lanes.types import GenerationRequest
    from tensorfold_core.options import ServeOptions
    from tensorfold_core.sampling import SamplingParams
    from tensorfold_core.specs import DrafterOptions

    target = load_target(MODEL, ServeOptions(dtype=args.dtype))
    model, tokenizer, probe = target.model, target.tokenizer, target.probe
    if not probe.get("row_invariant"):
        print(f"row-invariance probe failed ({probe.get('detail')}): no drafting to price")
        return 1
    ids = iter(range(1, 1 << 30))

    def decode(engine, prompt: list[int], temperature: float = 0.0) -> tuple[list[int], float, object]:
        """One stream alone through `engine`: its tokens, decode tok/s after the prefill round, its stats."""
        request = GenerationRequest(prompt_ids=prompt, max_tokens=args.tokens,
                                    sampling=SamplingParams(temperature=temperature, seed=7),
                                    stop_token_ids=frozenset(tokenizer.eos_ids))
        stream = Stream(id=next(ids), request=request, cache=model.new_cache(len(prompt) + args.tokens),
                        on_event=lambda event: None, limit=len(prompt) + args.tokens)
        engine.add(stream)
        engine.round()  # the prompt
        before, start = stream.generated, time.perf_counter()
        engine.run_until_idle()
        return stream.tokens[len(prompt):], (stream.generated - before) / (time.perf_counter() - start), stream.stats

    def drafter():
        return start_drafter(args.drafter, model, tokenizer, DrafterOptions(dtype=args.dtype))

    print("\n".join(platform_lines("bundled")))
    print(f"in-process engines (copy drafts off, so only the drafter is priced), {args.tokens} tokens greedy, dtype "
          f"{args.dtype}, {args.reps} reps; engines alternate per prompt; each engine keeps its costs across prompts")
    failed = []
    depths = [int(d) for d in args.depths.split(",")]
    for workload in args.workloads.split(","):
        texts = LONG_PROMPTS if workload == "long" else SHORT_PROMPTS[:4]
        prompts = [tokenizer.encode(t) for t in texts]
        priced = Timed(drafter())
        engines = {"plain": Engine(model, timed=True, copy_drafts=False),
                   "priced": Engine(model, drafter=priced.drafter, timed=True, copy_drafts=False)}
        for d in depths:
            engines[f"fixed {d}"] = Engine(model, drafter=drafter(), fixed_depth=d, copy_drafts=False)
        if workload == "after-random":
            for prompt in random_prompts(args.random_streams, 64, seed=11):
                decode(engines["priced"], prompt, temperature=1.0)
        before = engines["priced"].planner.costs.step_ms()
        priced.calls.clear()
        rates = {name: [] for name in engines}
        kept = {name: [0, 0, 0] for name in engines}
        failures = {}
        for rep in range(args.reps):
            for i, prompt in enumerate(prompts):
                names = list(engines)
                shift = (rep * len(prompts) + i) % len(names)
                got = {}
                for name in names[shift:] + names[:shift]:
                    got[name], rate, stats = decode(engines[name], prompt)
                    rates[name].append(rate)
                    kept[name] = [kept[name][0] + stats.drafted, kept[name][1] + stats.accepted,
                                  kept[name][2] + stats.rounds]
                check_against_plain(f"{workload}, rep {rep + 1}, prompt {i}", got, failures)
        print(f"\n## {workload}: {WORKLOADS[workload]}\n")
        print(f"priced engine: planner step_ms {before:.1f} before the timed prompts, "
              f"{engines['priced'].planner.costs.step_ms():.1f} after; a measured chain step (chains feeding no "
              f"catch-up) {priced.step_ms():.1f} ms; largest drafter feed {priced.largest_feed()} rows\n")
        rows = []
        for name in engines:
            if name in failures:
                failed.append(failures[name])
                rows.append([name, f"FAIL: {failures[name]}", "-", "-", "-", "-"])
                continue
            ratios = [a / b for a, b in zip(rates[name], rates["plain"])]
            offered, accepted, rounds = kept[name]
            rows.append([name, "equal", f"{median(rates[name]):.1f}", spread(rates[name]), f"{median(ratios):.2f}x",
                         f"{accepted}/{offered} in {rounds} rounds" if offered else f"0 in {rounds} rounds"])
        print(table(["engine", "token ids", "tok/s (median)", "range", "vs plain", "drafts kept"], rows))
    fail_if_any(failed)
    return 0


if __name__ == "__main__":
    sys.exit(exit_code(main))
