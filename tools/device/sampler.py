"""Where a process spends its time, from every thread's Python stack sampled on a timer (the H200 has no py-spy).

`start(path)` samples every 5 ms and rewrites `path` every 10 s, so a process killed by its timeout still leaves its
latest picture: the innermost lines that held the time, the functions that held it inclusively, the stacks most seen.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path

DEPTH = 14  # frames kept per stack: enough to name the engine's phase above a C call


def frames_of(frame, thread: str) -> tuple[str, ...]:
    """A stack, innermost first, as 'file:line function' entries, and its thread's name last."""
    out = []
    while frame is not None and len(out) < DEPTH:
        code = frame.f_code
        out.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return (*out, f"thread {thread}")


def report(stacks: Counter, started: float, top: int = 25) -> str:
    """The picture as text: counts are samples, percentages of all samples of busy threads."""
    total = sum(stacks.values()) or 1
    inner, inclusive, threads = Counter(), Counter(), Counter()
    for stack, n in stacks.items():
        inner[f"{stack[0]}  [{stack[-1]}]"] += n
        threads[stack[-1]] += n
        for entry in {e.split(" ", 1)[1] + " @" + e.split(":", 1)[0] for e in stack[:-1]}:
            inclusive[entry] += n
    lines = [f"{total} samples over {time.perf_counter() - started:.1f} s (every thread; one waiting is sampled too)",
             "", "threads:"]
    lines += [f"  {100 * n / total:5.1f}%  {name}" for name, n in threads.most_common()]
    lines += ["", "innermost lines:"]
    lines += [f"  {100 * n / total:5.1f}%  {line}" for line, n in inner.most_common(top)]
    lines += ["", "functions, inclusive:"]
    lines += [f"  {100 * n / total:5.1f}%  {name}" for name, n in inclusive.most_common(top)]
    lines += ["", "stacks most seen (innermost first):"]
    for stack, n in stacks.most_common(8):
        lines.append(f"  {100 * n / total:5.1f}%")
        lines += [f"      {entry}" for entry in stack]
    return "\n".join(lines) + "\n"


def start(path: str | Path, every_s: float = 0.005, write_every_s: float = 10.0) -> None:
    """Sample every thread but this one until the process ends; the report is rewritten as it goes."""
    stacks: Counter = Counter()
    started = time.perf_counter()
    atexit.register(lambda: Path(path).write_text(report(stacks, started)))

    def run() -> None:
        me, written = threading.get_ident(), time.perf_counter()
        while True:
            time.sleep(every_s)
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    stacks[frames_of(frame, names.get(ident, str(ident)))] += 1
            if time.perf_counter() - written > write_every_s:
                Path(path).write_text(report(stacks, started))
                written = time.perf_counter()

    threading.Thread(target=run, name="sampler", daemon=True).start()
