"""`python -m tensorfold_contract` and the body of `tensorfold contract`: run, print lines or JSON, exit status."""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import time

from .isolate import child_main
from .runner import NoMatch, OrderFile, run_contract, seconds_of_report


def run_cli(only=(), as_json: bool = False, seed: int | None = None, out=None, err=None,
            isolate: bool | None = None, jobs: int | None = None, progress: bool | None = None,
            order_from: str | None = None) -> int:
    """Run the contract and print it; 0 when nothing failed and no control was missed, 1 otherwise, 2 on misuse."""
    out, err = out or sys.stdout, err or sys.stderr
    start = time.monotonic()

    def step(what: str) -> None:
        print(f"  … {time.monotonic() - start:6.1f} s  {what}", file=err, flush=True)

    try:
        seconds = seconds_of_report(order_from) if order_from else None
        report = run_contract(only=only, seed=seed, progress=step if (err.isatty() if progress is None else progress)
                              else None, isolate=isolate, jobs=jobs, seconds=seconds)
    except (NoMatch, OrderFile) as exc:
        print(f"tensorfold contract: error: {exc}", file=err)
        return 2
    if as_json:
        print(json.dumps(report.as_json(), indent=1), file=out)
    else:
        print("\n".join(report.lines()), file=out)
    return 0 if report.ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tensorfold_contract",
                                     description="Prove every installed kernel: gates 1-5 and planted controls.")
    parser.add_argument("--only", action="append", default=[], metavar="NAME",
                        help="a kernel, family, plugin or distribution name (globs allowed); repeatable")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--seed", type=int, default=None, help="draw the inputs from this seed (default: fresh)")
    parser.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                        help="run each record in a child process, so a crash fails that record and the run goes "
                             "on (default: on a GPU, not on the CPU)")
    parser.add_argument("--jobs", type=int, default=None, metavar="N",
                        help="isolated records to run at once (default: 8, at most half the cores, where isolated; else 1)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="print each step as it starts, with the seconds since the run began, on stderr "
                             "(default: when stderr is a terminal)")
    parser.add_argument("--order-from", metavar="REPORT",
                        help="an earlier run's --json report: start the records that took longest there first "
                             "(records it lacks before them), so a run of many jobs does not end on one started last")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # the isolated run's child: one record's steps
    args = parser.parse_args(argv)
    if args.jobs is not None and (args.jobs < 1 or (args.jobs > 1 and args.isolate is False)):
        parser.error("--jobs takes 1 or more, and more than 1 only where records are isolated")
    if args.child:
        return child_main(json.loads(args.child))
    if not faulthandler.is_enabled():
        faulthandler.enable()  # without --isolate a crash at least leaves the Python stack on stderr
    return run_cli(args.only, args.json, args.seed, isolate=args.isolate, jobs=args.jobs, progress=args.progress,
                   order_from=args.order_from)
