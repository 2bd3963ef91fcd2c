"""Concurrent streams drafted against plain: aggregate tok/s by stream count, every reply's ids checked first."""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import openai

from common import (CODE_PROMPTS, MODEL, blas_env, capabilities, complete, first_difference, median, platform_lines,
                    random_prompts, server, spread, table, tokenize)

MODES = {  # name: (serve flags, the requests' draft field); `--drafter` replaces the drafted cells' flags
    "drafted": ((), True),
    "plain": (("--drafter", "none"), False),
}


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    temperature: float
    seed: int | None


def workload(name: str, args) -> list[Request]:
    if name == "code":
        return [Request(p, 0.0, None) for p in tokenize(CODE_PROMPTS, args.model)]
    if name == "random":
        prompts = random_prompts(args.random_prompts, args.random_len, seed=args.random_seed)
        return [Request(p, args.temperature, 1000 + i) for i, p in enumerate(prompts)]
    raise SystemExit(f"unknown workload {name!r} (code, random)")


def send(client, model: str, request: Request, tokens: int, draft: bool) -> dict:
    return complete(client, request.prompt, tokens, temperature=request.temperature, seed=request.seed, draft=draft,
                    stream=False, model=model)


def connect(url: str) -> tuple[openai.OpenAI, str]:
    """A client of the server at `url` and the model id it answers to (a directory serves under its own)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=1200)
    return client, client.models.list().data[0].id


def mode_flags(mode: str, args) -> tuple[tuple[str, ...], bool]:
    """The mode's serve flags and draft field, the drafted cells serving `--drafter` where it names one."""
    flags, draft = MODES[mode]
    return (("--drafter", args.drafter) if draft and args.drafter is not None else flags), draft


def batch(level: int, wave: int, count: int) -> list[int]:
    """Which requests wave `wave` of `level` streams sends: consecutive ones, wrapping around."""
    return [(wave * level + s) % count for s in range(level)]


def one_by_one(mode: str, requests: list[Request], args) -> list[list[int]]:
    """Every request sent alone (one after another) to a fresh server of `mode`: their token ids."""
    flags, draft = mode_flags(mode, args)
    with server(args.model, "--dtype", args.dtype, "--parallel", str(max(args.levels)), *flags,
                *args.serve_flags.split(), env=blas_env(args.blas)) as url:
        client, model = connect(url)
        return [send(client, model, r, args.tokens, draft)["ids"] for r in requests]


def cell(mode: str, level: int, requests: list[Request], args) -> dict:
    """A fresh server of `mode`; `args.waves` waves of `level` concurrent requests; replies and aggregate rate."""
    flags, draft = mode_flags(mode, args)
    with server(args.model, "--dtype", args.dtype, "--parallel", str(max(args.levels)), *flags,
                *args.serve_flags.split(), env=blas_env(args.blas)) as url:
        client, model = connect(url)
        warmed = capabilities(url).get("warm_up_seconds")  # None: the server did not warm up
        warm = requests[-1]
        send(client, model, Request(warm.prompt[:4], warm.temperature, warm.seed), 8, draft)
        replies, tokens, seconds, waves, sent = [], 0, 0.0, [], set()
        with ThreadPoolExecutor(level) as pool:
            for wave in range(args.waves):
                which = batch(level, wave, len(requests))
                start = time.perf_counter()
                got = list(pool.map(lambda i: send(client, model, requests[i], args.tokens, draft), which))
                took, made = time.perf_counter() - start, sum(len(r["ids"]) for r in got)
                seconds, tokens = seconds + took, tokens + made
                waves.append((made / took, bool(sent.intersection(which))))
                sent.update(which)
                replies += [(i, r) for i, r in zip(which, got)]
    return {"replies": replies, "rate": tokens / seconds, "waves": waves, "warmed": warmed}


def rate_line(run: dict) -> str:
    """A cell's rate and each wave's own, `r` after a wave that repeats a request of an earlier one (a drafted
    server's prompt cache then holds its reply, which Recall copies), and the server's warm-up at load where it
    ran one."""
    warmed = "" if run["warmed"] is None else f"; warmed up at load in {run['warmed']:.1f} s"
    waves = " ".join(f"{rate:.0f}{'r' if repeats else ''}" for rate, repeats in run["waves"])
    return f"{run['rate']:.1f} tok/s (waves {waves}{warmed})"


def check(runs: list[dict], references: dict[str, list[list[int]]]) -> str | None:
    """Why some reply differs from a reference (alone / serial), or None."""
    for rep, run in enumerate(runs):
        for i, reply in run["replies"]:
            for what, reference in references.items():
                at = first_difference(reply["ids"], reference[i])
                if at is not None:
                    return f"rep {rep + 1}, request {i}: token {at} differs from {what}"
    return None


def stats(runs: list[dict]) -> str:
    """Tokens per stream round, drafts kept / offered, over every reply of the cell."""
    replies = [r for run in runs for _, r in run["replies"]]
    tokens = sum(len(r["ids"]) for r in replies)
    rounds = sum(r["stats"].get("rounds", 0) for r in replies)
    offered = sum(r["stats"].get("drafted", 0) for r in replies)
    kept = sum(r["stats"].get("accepted", 0) for r in replies)
    drafts = f"{kept}/{offered} ({kept / offered:.0%})" if offered else "0 drafts"
    return f"{tokens / rounds:.2f}, {drafts}" if rounds else drafts


def run_workload(name: str, args) -> bool:
    requests = workload(name, args)
    sampling = "greedy" if name == "code" else f"temperature {args.temperature}, seeded"
    print(f"\n## workload {name}: {len(requests)} distinct requests ({sampling}), {args.tokens} tokens each, "
          f"{args.waves} waves per cell, dtype {args.dtype}, BLAS {args.blas}\n")
    if max(args.levels) * args.waves > len(requests):
        print("waves marked r repeat requests an earlier wave of the cell sent: drafted, a request's reply may be "
              "copied from its kept prompt state (Recall); --serve-flags '--prompt-cache-gib 0' keeps none\n")
    references: dict[str, dict[str, list[list[int]]]] = {mode: {} for mode in MODES}
    serial = one_by_one("plain", requests, args)  # plain mode sends draft: false, so alone it is the serial reference
    alone_ok = True  # a request no wave sends is still checked here, so its FAIL must fail the run too
    if args.serial:
        for mode in MODES:
            references[mode]["serial (draft: false, alone)"] = serial
    if args.alone:
        references["plain"]["the same request alone"] = serial
        alone = one_by_one("drafted", requests, args)
        references["drafted"]["the same request alone"] = alone
        diff = next(((i, at) for i, (a, b) in enumerate(zip(alone, serial))
                     if (at := first_difference(a, b)) is not None), None)
        print(f"drafted alone vs serial: {'equal' if diff is None else f'FAIL request {diff[0]} token {diff[1]}'}")
        alone_ok = diff is None
    runs = {(mode, level): [] for level in args.levels for mode in MODES}
    order = {}  # (rep, level): the modes in the order they ran
    for rep in range(args.reps):
        for level in args.levels:
            modes = list(MODES) if (rep + level) % 2 == 0 else list(MODES)[::-1]  # alternate who runs first
            for mode in modes:
                runs[(mode, level)].append(cell(mode, level, requests, args))
            order[(rep, level)] = modes
            # progress only: a rate prints once every reply of its level was checked
            print(f"rep {rep + 1} {name} level {level}: ran {', '.join(modes)}", file=sys.stderr)
    rows, ok, checked = [], True, []  # checked: each rep's rates of the levels whose replies all matched
    for level in args.levels:
        failures = {mode: check(runs[(mode, level)], references[mode]) for mode in MODES}
        if any(failures.values()):
            ok = False
            why = "; ".join(f"{m}: {w}" for m, w in failures.items() if w)
            rows.append([level, f"FAIL: {why}", "-", "-", "-", "-", "-"])
            continue
        for rep in range(args.reps):
            rates = ", ".join(f"{mode} {rate_line(runs[(mode, level)][rep])}" for mode in order[(rep, level)])
            checked.append(f"rep {rep + 1} {name} level {level}: {rates} (in that order)")
        drafted = [r["rate"] for r in runs[("drafted", level)]]
        plain = [r["rate"] for r in runs[("plain", level)]]
        ratios = [a / b for a, b in zip(drafted, plain)]
        rows.append([level, "equal", f"{median(drafted):.1f} ({spread(drafted)})",
                     f"{median(plain):.1f} ({spread(plain)})", f"{median(ratios):.2f}x", f"{min(ratios):.2f}x",
                     stats(runs[("drafted", level)])])
    checks = " and ".join(c for c, on in (("--alone", args.alone), ("--serial", args.serial)) if on) or "none"
    print(f"token ids checked ({checks}) before any rate is quoted\n")
    for line in checked:
        print(line)
    if checked:
        print()
    print(table(["streams", "token ids", "drafted tok/s", "plain tok/s", "drafted/plain (median)", "worst rep",
                 "drafted: tokens/round, drafts kept"], rows))
    return ok and alone_ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=MODEL, help="the served checkpoint: a zoo name or a directory")
    parser.add_argument("--drafter", default=None,
                        help="the drafted cells' drafter (a zoo name or a directory); default: the model's own default")
    parser.add_argument("--levels", default="1,2,4,8", help="comma list of concurrent stream counts")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--waves", type=int, default=2, help="batches of concurrent requests per cell")
    parser.add_argument("--workload", default="code", help="comma list: code (the code prompts, greedy), random "
                        "(random-token prompts at --temperature, seeded: the adversarial cell, where drafts rarely "
                        "land and the guards should stand drafting aside)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--blas", default="bundled", help="bundled, openblas or openblas-CORE (e.g. openblas-nehalem)")
    parser.add_argument("--alone", action=argparse.BooleanOptionalAction, default=True,
                        help="check each reply against the same request alone on a fresh server of its mode")
    parser.add_argument("--serial", action=argparse.BooleanOptionalAction, default=True,
                        help="check each reply against the request alone with \"draft\": false")
    parser.add_argument("--random-prompts", type=int, default=8)
    parser.add_argument("--random-len", type=int, default=64)
    parser.add_argument("--random-seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=1.0, help="the random workload's temperature")
    parser.add_argument("--serve-flags", default="", help="more flags for every server, e.g. '--prompt-cache-gib 0' "
                        "(no kept prompt states, so a repeated request recalls nothing)")
    args = parser.parse_args()
    if not (args.alone or args.serial):
        parser.error("--no-alone with --no-serial would quote rates for replies nothing checked")
    args.levels = [int(n) for n in args.levels.split(",")]
    print("\n".join(platform_lines(args.blas)))
    also = f", {args.serve_flags.strip()}" if args.serve_flags.strip() else ""
    print(f"a fresh server per cell (--parallel = the most streams{also}); drafted and plain cells alternate; "
          f"medians of {args.reps} reps")
    ok = all([run_workload(name, args) for name in args.workload.split(",")])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
