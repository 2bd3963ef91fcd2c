"""Where a plain decode step's host time goes: building, queueing, waiting; at each stream count, device idle or busy.

    python3 tools/device/launch_time.py TARGET [--streams 1,8] [--steps 48]

Each step runs one row a stream and commits it as the engine's lookahead does (greedy ids on the device, the keep's
arrays queued with the step). Per stream count two loops: `idle` waits for the device before building each step, so
queueing meets an empty device; `busy` builds and queues step k before reading step k-1's ids, as plain rounds run
ahead. Prints each phase's median ms: a queue that costs more busy than idle waits on the device (its launch queue or
its allocator), not on the host's launches. Run it under TENSORFOLD_KERNELS=table (run_on_h200.sh exec).
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np

PHASES = ("build", "queue forward", "queue commit", "read", "step")


def decode_steps(model, streams: int, steps: int, busy: bool, context: int = 64) -> tuple[dict[str, float], list]:
    """Median ms of each phase over `steps` one-row steps of `streams` streams after a `context`-token prompt each,
    and every step's greedy ids."""
    from tensorfold_core.lanes.ahead import greedy_ids

    caches = [model.new_cache(context + steps + 16) for _ in range(streams)]
    prompt = mx.concatenate([(mx.arange(context, dtype=mx.uint32) * (s + 3)) % 400 + 7 for s in range(streams)])
    logits = model.forward_ids(caches, prompt, [context] * streams, [1] * streams, commit=True)
    tokens = greedy_ids(logits)
    mx.eval(tokens)
    times: dict[str, list[float]] = {phase: [] for phase in PHASES}
    previous, drawn = None, []
    for _ in range(steps):
        if not busy:
            mx.synchronize()
        start = time.perf_counter()
        logits = model.forward_ids(caches, tokens, [1] * streams, [1] * streams)
        built = time.perf_counter()
        ids = greedy_ids(logits)
        mx.async_eval(logits, ids)
        queued = time.perf_counter()
        mx.async_eval([array for cache in caches for array in model.keep_later(cache, 1)])
        committed = time.perf_counter()
        if not busy:
            drawn.append(np.array(ids))
        elif previous is not None:  # the last step's ids, as a round running ahead reads them
            drawn.append(np.array(previous))
        read = time.perf_counter()
        previous, tokens = ids, ids
        for phase, ms in zip(PHASES, (built - start, queued - built, committed - queued, read - committed,
                                      read - start)):
            times[phase].append(1000 * ms)
    if busy:
        drawn.append(np.array(previous))
    return {phase: statistics.median(values[4:]) for phase, values in times.items()}, [step.tolist() for step in drawn]


def main() -> int:
    from tensorfold_core.loading import load_target
    from tensorfold_core.options import ServeOptions

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("--streams", default="1,8", help="stream counts, comma-separated")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()

    model = load_target(args.target, ServeOptions(dtype=args.dtype)).model
    print(f"device {mx.default_device()}; kernels {model.kernels}", flush=True)
    print(f"{'streams':>7} {'device':>6} " + " ".join(f"{phase:>13}" for phase in PHASES) + "   tok/s (ms a step)")
    for streams in (int(s) for s in args.streams.split(",")):
        decode_steps(model, streams, 8, busy=True)  # traces and kernels built before any timing
        (idle, idle_ids), (busy, busy_ids) = (decode_steps(model, streams, args.steps, busy) for busy in (False, True))
        if busy_ids != idle_ids or len(idle_ids) != args.steps:
            print(f"{streams} streams: the busy loop's ids are not the idle loop's; no times printed", flush=True)
            return 1
        for name, ms in (("idle", idle), ("busy", busy)):
            print(f"{streams:>7} {name:>6} " + " ".join(f"{ms[p]:>13.3f}" for p in PHASES)
                  + f"   {1000 * streams / ms['step']:.1f}", flush=True)
    print("ids: the busy loop's equal the idle loop's at every stream count")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
