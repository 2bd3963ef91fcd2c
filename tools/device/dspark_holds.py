"""A DSpark drafter's hold passes timed as it times them at start, with its op table and with MLX's ops alone,
interleaved: ms by blocks x depth (best of the rounds), and what served each op. Then one block's holds over a
context that grows a row each hold (as a served stream's does): mean and worst ms, the first one left out."""

# python tools/device/dspark_holds.py [TARGET] [DRAFTER] [--rounds 3] [--dtype bfloat16] [--grow 24]

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("target", nargs="?", default="tiny-lfm2-moe")
    parser.add_argument("drafter", nargs="?", default="tiny-lfm2-moe-dspark")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--grow", type=int, default=24, help="holds over a context one row longer each")
    args = parser.parse_args()

    from tensorfold_core.loading import load_target, start_drafter
    from tensorfold_core.options import ServeOptions
    from tensorfold_core.kernels import DRAFTER_BUILTIN_ENV

    target = load_target(args.target, ServeOptions(dtype=args.dtype))
    drafters = {}
    for label, builtin in (("table", "0"), ("builtin", "1")):
        os.environ[DRAFTER_BUILTIN_ENV] = builtin
        drafters[label] = start_drafter(args.drafter, target.model, target.tokenizer)
        print(f"{label}: {drafters[label].kernels}", flush=True)
    best: dict[str, dict] = {label: {} for label in drafters}
    for _ in range(args.rounds):
        for label, drafter in drafters.items():
            drafter.time_holds()
            for point, ms in drafter.holds.points().items():
                best[label][point] = min(ms, best[label].get(point, ms))
    points = sorted(best["table"])
    print("blocks x depth: " + "  ".join(f"{b}x{d}" for b, d in points))
    for label, times in best.items():
        print(f"{label:8s} ms: " + "  ".join(f"{times[p]:.2f}" for p in points))
    print("table / builtin: " + "  ".join(f"{best['table'][p] / best['builtin'][p]:.2f}" for p in points))
    for label, drafter in drafters.items():
        times = growing(drafter, args.grow)
        print(f"{label:8s} growing context, 1 block x 4: mean {statistics.mean(times):.2f} ms, "
              f"worst {max(times):.2f} ms over {len(times)} holds")
    for drafter in drafters.values():
        drafter.close()
    return 0


def growing(drafter, holds: int) -> list[float]:
    """Wall ms of holds of one 4-draft block whose lane holds one row more each time (its rows' values do not
    matter here, only the shapes each hold meets)."""
    from tensorfold_core.protocols import DraftAsk

    stream = -100
    drafter._propose([DraftAsk(stream, [0, 0], 4, limit=512)], held=False)
    lane, times = drafter.lanes[stream], []
    try:
        for n in range(64, 64 + holds + 1):
            lane.n = n
            start = time.perf_counter()
            drafter._hold([[0] * (n + 1)], [lane], [4])
            times.append((time.perf_counter() - start) * 1000.0)
    finally:
        drafter.release(stream)
    return times[1:]


if __name__ == "__main__":
    sys.exit(main())
