"""The runner: records from every installed plugin, gates on each implementation this device runs, controls."""

from __future__ import annotations

import json
import os
import secrets
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

from tensorfold_core.errors import OptionError

from . import devices
from .isolate import run_record_isolated
from .registry import Registered, discover
from .report import Report
from .steps import new_result, run_record

# Isolated records run at most this many at a time by default, and at most one a two host cores: on the H200 most of
# the time is MLX compiling its own kernels on the host, one core a record (docs/kernel-contract.md has the timings)
JOBS = 8


def run_contract(only: Iterable[str] = (), seed: int | None = None, pm=None, device: devices.Device | None = None,
                 progress: Callable[[str], None] | None = None, isolate: bool | None = None,
                 jobs: int | None = None, seconds: dict[str, float] | None = None) -> Report:
    """Run every registered record (or those `only` names: kernel, family, plugin or distribution; globs allowed).

    `isolate` runs each record in a child process (default: on a GPU, not on the CPU), so a crash in MLX or a
    kernel fails that record's step, and the rest of the run and its summary go on. Children find the records
    through the installed entry points, so isolation takes no `pm`. `jobs` isolated records run at once (default
    JOBS, at most half the host's cores, where isolated); the report keeps record order. `seconds` (an earlier
    run's, `seconds_of_report`) starts the slowest records first, so the longest ones do not start last.
    """
    only = list(only)
    seed = secrets.randbits(32) if seed is None else seed
    device = device or devices.current()
    if isolate is None:
        isolate = device.backend != "cpu" and pm is None
    if isolate and pm is not None:
        raise ValueError("an isolated run finds its records through installed entry points: pass no pm")
    jobs = (max(1, min(JOBS, (os.cpu_count() or 1) // 2)) if isolate else 1) if jobs is None else jobs
    if jobs < 1 or (jobs > 1 and not isolate):
        raise ValueError(f"jobs {jobs}: records run side by side only in child processes (isolated), 1 or more")
    found = discover(pm)
    chosen = [r for r in found if not only or r.matches(only)]
    if only and not chosen:
        known = sorted({n for r in found for n in (r.plugin, r.record.family if r.record else r.plugin)})
        raise NoMatch(only, known)
    report = Report(device=device, seed=seed, only=only, registered=len(found), isolated=isolate)

    def one(reg: Registered):
        try:
            if isolate and reg.record is not None:
                return run_record_isolated(reg, next(i for i, r in enumerate(found) if r is reg), device, seed,
                                           progress)
            return run_record(reg, device, seed, progress)
        except Exception as exc:  # a fault in the runner or a record's own code: that record fails, the run goes on
            kernel = new_result(reg)
            kernel.problems.append(f"the runner stopped on this record: {type(exc).__name__}: {str(exc)[:300]}")
            return kernel

    if jobs > 1:  # each record's work is in its own child: the threads here only wait on their pipes
        started = slowest_first(chosen, seconds or {})
        with ThreadPoolExecutor(jobs) as pool:
            done = dict(zip(map(id, started), pool.map(one, started)))
        report.kernels = [done[id(reg)] for reg in chosen]
    else:
        report.kernels = [one(reg) for reg in chosen]
    return report


def slowest_first(chosen: list[Registered], seconds: dict[str, float]) -> list[Registered]:
    """`chosen` in the order to start them: records `seconds` lacks first (a new one may be slow), then slowest first."""
    def took(reg: Registered) -> float:
        return seconds.get(reg.record.name if reg.record else "", float("inf"))

    return sorted(chosen, key=took, reverse=True)


def seconds_of_report(path: str) -> dict[str, float]:
    """Each record's seconds in an earlier `--json` report: its slowest implementation's (they run side by side)."""
    try:
        with open(path) as f:
            kernels = json.load(f)["kernels"]
        return {k["name"]: max((i.get("seconds") or 0.0 for i in k["implementations"].values()), default=0.0)
                for k in kernels}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise OrderFile(path, exc) from exc


class OrderFile(OptionError):
    """`--order-from` names a file that is not an earlier `--json` report (the CLI's one-line error, exit 2)."""

    def __init__(self, path: str, exc: Exception):
        super().__init__(f"--order-from {path}: not a contract --json report ({type(exc).__name__}: {exc})")


class NoMatch(OptionError):
    """`--only` named nothing that is registered (a flag's value: the CLI's one-line error, exit 2)."""

    def __init__(self, only: list, known: list):
        super().__init__(f"--only {' '.join(only)} matches no kernel, family, plugin or distribution "
                         f"(registered: {', '.join(known) or 'none'})")
