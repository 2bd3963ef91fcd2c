"""The target's forward timed at start at a few widths per band of streams: what a verify row costs here."""

from __future__ import annotations

import os
import time

import mlx.core as mx

from .guards import DraftPlanner, SharedGuard
from .pricing import Costs

WIDTHS = (1, 5)  # rows of each stream's window in a timed forward: plain, and four drafts verified
UNTIMED = 2  # forwards of a shape run first: MLX builds its kernels, and a compiled forward traces, on early calls
TIMED = 3  # forwards timed after them; the fastest is kept (a preempted one reads long)
CAPACITY = 16  # tokens each throwaway cache holds: a window of WIDTHS' widest at the start of its stream
# "1": forwards timed at start on any backend, "0": on none (the prior's slope until rounds tell); unset: on a GPU
TIME_ROWS_ENV = "TENSORFOLD_TIME_ROWS"


def times_rows() -> bool:
    """Whether a server times its forwards at start here: on a GPU, where the prior's slope priced a verify row at ten
    times its cost; not on the CPU, whose shares the prior was made from (there the timed line took DSpark's 4- and
    8-stream speed from about 1.5x and 1.34x plain to 1.4x and 1.24x: docs/speculation.md), unless
    TENSORFOLD_TIME_ROWS says."""
    wanted = os.environ.get(TIME_ROWS_ENV, "")
    if wanted in ("0", "1"):
        return wanted == "1"
    return mx.default_device().type == mx.DeviceType.gpu


def band_counts(parallel: int) -> list[int]:
    """One stream count for each band of shared rounds up to `parallel` streams: the band's widest that fits."""
    return sorted({min(1 << b, parallel) for b in range(1, max(parallel - 1, 0).bit_length() + 1)})


def time_forwards(model, streams: int) -> dict[int, float]:
    """{rows: ms} of the model's forward over `streams` fresh windows of each of WIDTHS rows, every row drawing."""
    out = {}
    for width in WIDTHS:
        times = []
        for i in range(UNTIMED + TIMED):
            caches = [model.new_cache(CAPACITY) for _ in range(streams)]  # never kept: the windows stay open
            start = time.perf_counter()
            mx.eval(model.forward(caches, [[0] * width] * streams, [width] * streams))
            if i >= UNTIMED:
                times.append((time.perf_counter() - start) * 1000.0)
        out[streams * width] = min(times)
    return out


def prime_shared_lines(planner: DraftPlanner, model, parallel: int) -> dict[int, dict[int, float]]:
    """Time the forwards of each band of 2..`parallel` streams and prime the planner's line for that band's shared
    rounds with them: a band runs plain until its guard measures drafting, so its rounds are all of one width, and
    the prior's row (a tenth of a round, a CPU's share) priced every hold out on a GPU, where 40 verify rows cost
    about what 8 do. Returns {streams: {rows: ms}}."""
    timed = {}
    for streams in band_counts(parallel):
        timed[streams] = time_forwards(model, streams)
        planner.shared_costs.setdefault(SharedGuard.band(streams), Costs()).prime(timed[streams])
    return timed
