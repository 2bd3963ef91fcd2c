"""On the H200 (and the CPU): the load probe and drafted == "draft": false == shared == resumed, per family and mode.

Each family and mode runs in a child process with TENSORFOLD_KERNELS set: `builtin` (MLX's own ops everywhere),
`records` (every op that has a kernel record through it) and `table` (the family's table as it ships: its records
where it names them on this backend, MLX's ops the probe proves elsewhere). The reference is each request served alone
with draft=False; against it: drafted alone, plain and drafted at each --streams count with streams joining a running
engine and neighbours cancelled mid-run, and two passes through a prompt cache (the second resumes each prompt's
kept state), greedy and seeded. Rounds are shared and drafted even where the probe fails, so a backend that is not
row-invariant shows its mismatches instead of hiding them. Exit 1 on a mismatch, a missing case or a failed child in
`records` or `table` mode; `builtin` is reported only, and cut after --builtin-seconds (on CUDA it is slow and expected to differ).
Usage: python3 tools/device/gpu_exact.py --out DIR [--families llama,lfm2] [--modes records] [--tokens 32]
       [--prompts 12] [--streams 4,8]     (docs/gpu.md: how to run it on the H200, what it prints)
TF_EXACT_WATCH=DIR: each child writes where its time went and its threads' stacks every 30 s there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from exact_cases import FAMILIES, PROMPTS, run_family

MODES = ("builtin", "records", "table")


def expected_cases(prompts: int, streams: list[int], drafted: bool) -> int:
    """Cases per family and mode: greedy and seeded per prompt, in each run compared with the reference."""
    runs = 1 + 2 * len(streams) + 4 if drafted else len(streams) + 2
    return 2 * prompts * runs


def summary(reports: list[dict]) -> list[str]:
    """One line per family and mode (shared: plain tok/s at the most streams), then the mismatches (ten at most
    per family and mode) and failures."""
    lines = [f"{'family':<14} {'mode':<8} {'probe':<5} {'cases':>5} {'mismatches':>10} {'plain tok/s':>11} "
             f"{'shared':>8} {'drafts kept/offered':>19} {'resumed tokens':>14} {'seconds':>7}"]
    notes = []
    for r in reports:
        if "error" in r:
            lines.append(f"{r['family']:<14} {r['mode']:<8} FAILED (see below)")
            notes.append(f"{r['family']} {r['mode']}: {r['error']}")
            continue
        runs = r["runs"].values()
        together = [v for k, v in r["speeds"].items() if k.startswith("plain ")]  # the last: the most streams
        kept = f"{sum(v['accepted'] for v in runs)}/{sum(v['drafted'] for v in runs)}"
        lines.append(f"{r['family']:<14} {r['mode']:<8} {'pass' if r['probe']['row_invariant'] else 'FAIL':<5} "
                     f"{r['cases']:>5} {len(r['mismatches']):>10} {r['plain tok/s (alone, prefill included)']:>11} "
                     f"{together[-1] if together else '-':>8} {kept:>19} "
                     f"{sum(v['cached_tokens'] for v in runs):>14} {r['seconds']:>7}")
        if not r["probe"]["row_invariant"]:
            notes.append(f"{r['family']} {r['mode']}: probe: {r['probe']['detail']}")
        if "holds ahead (queued/taken)" in r:
            notes.append(f"{r['family']} {r['mode']}: holds ahead queued/taken {r['holds ahead (queued/taken)']}")
        if r["cut"]:
            notes.append(f"{r['family']} {r['mode']}: {r['cut']} cases cut at --builtin-seconds (not compared)")
        if r["cases"] + r["cut"] != r["expected cases"]:
            notes.append(f"{r['family']} {r['mode']}: {r['cases']} cases, expected {r['expected cases']}")
        notes += [f"{r['family']} {r['mode']}: {m}" for m in r["mismatches"][:10]]
        if len(r["mismatches"]) > 10:
            notes.append(f"{r['family']} {r['mode']}: ... {len(r['mismatches']) - 10} more in the JSON")
    return lines + notes


def failed(report: dict) -> bool:
    """Whether the report fails the run: records or table mode, on a mismatch, a crash or a missing case."""
    if report["mode"] == "builtin":
        return False
    return "error" in report or bool(report["mismatches"]) or report["cases"] != report["expected cases"]


def child(command: list[str], mode: str, timeout: float) -> dict:
    """One family under one kernel table mode, in a process of its own: its report, or {"error": why}."""
    env = dict(os.environ, TENSORFOLD_KERNELS=mode)
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr or ""
        return {"error": f"{err[-2000:]}\ntimed out after {timeout:g} s (--child-timeout)"}
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        return {"error": done.stderr[-3000:] or f"exit {done.returncode}"}
    try:
        return json.loads(lines[-1])
    except json.JSONDecodeError:
        return {"error": f"no report on its last line: {lines[-1][:200]!r}; {done.stderr[-2000:]}"}


def watch(family: str) -> None:
    """TF_EXACT_WATCH=DIR: the child samples where its time goes and dumps every thread's stack every 30 s there,
    so a child cut by its timeout says where it was (a hang repeats one stack; a slow loop moves)."""
    folder = os.environ.get("TF_EXACT_WATCH")
    if not folder:
        return
    import faulthandler

    import sampler

    name = f"{family}-{os.environ.get('TENSORFOLD_KERNELS', 'table')}"
    Path(folder).mkdir(parents=True, exist_ok=True)
    sampler.start(Path(folder) / f"sample-{name}.txt")
    stacks = open(Path(folder) / f"stacks-{name}.txt", "w")  # kept open: faulthandler writes to it until exit
    faulthandler.dump_traceback_later(30, repeat=True, file=stacks)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="writes gpu_exact.json here (required)")
    parser.add_argument("--families", default=",".join(FAMILIES), help=f"of {', '.join(FAMILIES)}")
    parser.add_argument("--modes", default="builtin,records", help=f"kernel table modes (TENSORFOLD_KERNELS) of "
                        f"{', '.join(MODES)}")
    parser.add_argument("--tokens", type=int, default=32, help="reply tokens of the shortest request")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"at most {len(PROMPTS)}")
    parser.add_argument("--streams", default="4,8", help="concurrent stream counts of the shared runs")
    parser.add_argument("--builtin-seconds", type=float, default=45, help="builtin mode cuts the cases still "
                        "running this long after its start (0: none); records mode runs every case")
    parser.add_argument("--child-timeout", type=float, default=300, help="seconds a family and mode may take")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    streams = [int(n) for n in args.streams.split(",")]
    if args.child:
        watch(args.child)
        print(json.dumps(run_family(args.child, args.tokens, args.prompts, streams, args.seconds)))
        return 0
    if args.out is None:
        parser.error("--out is required")
    families, modes = args.families.split(","), args.modes.split(",")
    unknown = [f for f in families if f not in FAMILIES] + [m for m in modes if m not in MODES]
    if unknown or not 1 <= args.prompts <= len(PROMPTS):
        parser.error(f"unknown {', '.join(unknown)}" if unknown else f"--prompts: 1..{len(PROMPTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    reports, started = [], time.perf_counter()
    for family in families:
        for mode in modes:
            command = [sys.executable, __file__, "--child", family, "--tokens", str(args.tokens),
                       "--prompts", str(args.prompts), "--streams", args.streams,
                       "--seconds", str(args.builtin_seconds if mode == "builtin" else 0)]
            expected = expected_cases(args.prompts, streams, FAMILIES[family].drafter is not None)
            report = {"family": family, "mode": mode, **child(command, mode, args.child_timeout),
                      "expected cases": expected}
            reports.append(report)
            print("\n".join(summary([report])[1:]), flush=True)
            # written after each child, so a call cut short still brings back what ran
            took = round(time.perf_counter() - started, 1)
            verdict = "FAIL" if any(failed(r) for r in reports) else "PASS"
            (args.out / "gpu_exact.json").write_text(json.dumps(
                {"verdict": verdict, "finished": f"{len(reports)} of {len(families) * len(modes)} families and modes",
                 "seconds": took, "tokens": args.tokens, "prompts": args.prompts,
                 "streams": streams, "families": families, "modes": modes, "reports": reports}, indent=1))
    print("\n".join(summary(reports)))
    print(f"{verdict}: records mode {'has mismatches or failures' if verdict == 'FAIL' else 'exact'} "
          f"({sum(r.get('cases', 0) for r in reports)} cases, {took} s)")
    return 1 if verdict == "FAIL" else 0


if __name__ == "__main__":
    sys.exit(main())
