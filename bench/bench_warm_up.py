"""A warmed host against an unwarmed one on the same loaded model, requests in turns: the warm-up must change no id
and no steady speed (a fresh server's first requests, which it is for, need fresh processes: bench_concurrent's
per-wave rates, with and without TENSORFOLD_WARM_UP)."""

# python bench/bench_warm_up.py [--model tiny-lfm2] [--drafter tiny-lfm2-dspark] [--tokens 128] [--prompts 6]
#                               [--reps 3]
# For plain (no drafter, "draft": false) and drafted hosts: both hosts of a mode serve every code prompt in turns,
# who goes first swapping each rep; every reply's ids must equal the unwarmed host's before any time prints.

from __future__ import annotations

import argparse
import os
import sys
import time

from common import CODE_PROMPTS, check_same_replies, exit_code, median, platform_lines

TIMEOUT_S = 600


def host(target, options, drafter_name: str | None, warm: bool):
    """A started host (its engine thread running), warmed up at load or not."""
    from tensorfold_core.host import Host
    from tensorfold_core.lanes.warm_up import WARM_UP_ENV
    from tensorfold_core.loading import start_drafter

    os.environ[WARM_UP_ENV] = "1" if warm else "0"
    drafter = start_drafter(drafter_name, target.model, target.tokenizer) if drafter_name else None
    return Host(target.model, target.tokenizer, options, model_id="bench", context=target.context(),
                drafter=drafter, row_invariant=target.row_invariant)


def serve(host, prompt: list[int], tokens: int, draft: bool) -> tuple[float, list[int]]:
    """One greedy request through the host's engine thread: its wall seconds and token ids."""
    from tensorfold_core.lanes.types import GenerationRequest
    from tensorfold_core.testing import served_by_thread

    start = time.perf_counter()
    ids = served_by_thread(host, GenerationRequest(prompt_ids=prompt, max_tokens=tokens, draft=draft), TIMEOUT_S)
    return time.perf_counter() - start, ids


def run_mode(target, options, drafter: str | None, prompts: list[list[int]], args) -> dict[bool, list[float]]:
    """Both hosts of one mode in turns: {warm: each request's seconds}, after every reply's ids were checked."""
    hosts = {warm: host(target, options, drafter, warm) for warm in (False, True)}
    try:
        print(f"{'drafted' if drafter else 'plain'}: warmed up at load: {hosts[True].warmed_up}")
        seconds, replies = {False: [], True: []}, {False: [], True: []}
        for rep in range(args.reps):
            for warm in ((False, True) if rep % 2 == 0 else (True, False)):
                for prompt in prompts:
                    took, ids = serve(hosts[warm], prompt, args.tokens, draft=drafter is not None)
                    seconds[warm].append(took)
                    replies[warm].append(ids)
        check_same_replies("the warmed host", replies[False], replies[True])
        return seconds
    finally:
        for h in hosts.values():
            h.close()


def main() -> int:
    from tensorfold_core.loading import load_target
    from tensorfold_core.options import ServeOptions

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="tiny-lfm2")
    parser.add_argument("--drafter", default="tiny-lfm2-dspark")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=6, help="the first N code prompts")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dtype", default="float32", help="the CPU's fast exact configuration's")
    args = parser.parse_args()
    print("\n".join(platform_lines()))
    options = ServeOptions(parallel=4, dtype=args.dtype)
    target = load_target(args.model, options)
    prompts = [target.tokenizer.encode(p) for p in CODE_PROMPTS[:args.prompts]]
    rows = []
    for drafter in (None, args.drafter):
        seconds = run_mode(target, options, drafter, prompts, args)  # a mismatch: exit_code's FAIL, no time
        cold, warm = (sum(seconds[w]) for w in (False, True))
        mid = {w: median(seconds[w]) * 1e3 for w in (False, True)}
        rows.append(f"{'drafted' if drafter else 'plain':<8} unwarmed {cold:.2f} s (median {mid[False]:.0f} ms), "
                    f"warmed {warm:.2f} s (median {mid[True]:.0f} ms): the warmed host {cold / warm:.2f}x the speed")
    print(f"ids equal, warmed and not, every reply ({len(prompts)} prompts x {args.reps} reps a host)")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(exit_code(main))
