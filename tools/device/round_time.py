"""Where a drafted round's time goes on this machine: the parts of a round of the inflated pair, each timed alone.

    python3 tools/device/round_time.py TARGET DRAFTER [--repeats 30] [--streams 8 --depths 0,1,2,4,8]

Prints, per part, the median ms over the repeats (each part evaluated and synced alone): the target's forward of
1 to 8 rows through its served kernels, the drafter's forward of 1 and 5 rows through MLX's ops and through the
target's kernel table, a depth-4 chain as `propose` runs it (Python graph build apart from the eval), and an empty
eval's round trip. Run it under TENSORFOLD_KERNELS=table (run_on_h200.sh exec); it needs the pair inflate builds.
With --streams N it times instead a shared round's verify: N windows of 1 + depth rows, one a stream's cache, per
depth, against a plain round's N one-row windows (any family's pair; the drafter's holds: dspark_holds.py).
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx


def median_ms(run, repeats: int) -> float:
    """Median wall ms of `run()` (which evaluates what it builds) after two warm calls."""
    run(), run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def forward_ms(model, rows: int, repeats: int, context: int = 200, streams: int = 1) -> float:
    """One window of `rows` a stream over caches already holding `context` tokens each, none of the rows kept."""
    caches = []
    for stream in range(streams):
        cache = model.new_cache(context + 64)
        model.forward_ids([cache], (mx.arange(context, dtype=mx.uint32) + stream) % 500, [context], [1], commit=True)
        caches.append(cache)
    mx.eval([[cache.keys, cache.values] for cache in caches])
    ids = mx.arange(rows * streams, dtype=mx.uint32) % 97 + 7

    def run():  # a verify's shape: every row's logits, then none of the rows kept
        mx.eval(model.forward_ids(caches, ids, [rows] * streams, [rows] * streams))
        for cache in caches:
            model.keep(cache, 0)

    return median_ms(run, repeats)


def shared_verify(model, streams: int, depths: list[int], repeats: int) -> None:
    """A shared round's forward at each depth, and its cost in plain rounds of the same streams."""
    plain = forward_ms(model, 1, repeats, streams=streams)
    print(f"{streams} streams x 1 row (a plain round's forward): {plain:.2f} ms", flush=True)
    for depth in depths:
        ms = forward_ms(model, 1 + depth, repeats, streams=streams)
        print(f"{streams} streams x {1 + depth} rows (verify of depth {depth}): {ms:.2f} ms = {ms / plain:.2f} plain",
              flush=True)


def chain_ms(drafter, repeats: int, depth: int = 4) -> tuple[float, float]:
    """A propose of `depth` drafts after 5 new context rows, as a round asks it: (build ms, whole ms)."""
    from tensorfold_core.protocols import DraftAsk

    context = list(range(3, 203))
    build = []
    real_eval = mx.eval

    def timed_eval(*arrays):
        build.append(1000 * (time.perf_counter() - started[0]))
        return real_eval(*arrays)

    started = [0.0]

    def run():
        context.extend(range(10, 15))
        started[0] = time.perf_counter()
        drafter.propose([DraftAsk(1, list(context), depth, limit=len(context) + 400)])

    mx.eval = timed_eval
    try:
        whole = median_ms(run, repeats)
    finally:
        mx.eval = real_eval
    return statistics.median(build), whole


def main() -> int:
    from tensorfold_llama.drafter import LlamaDrafter
    from tensorfold_llama.load import load

    from tensorfold_core.loading import load_target, open_checkpoint, start_drafter
    from tensorfold_core.options import ServeOptions
    from tensorfold_core.specs import DrafterOptions, LoadOptions

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("drafter")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--streams", type=int, default=0, help="time a shared round's verify of this many streams")
    parser.add_argument("--depths", default="0,1,2,3,4,8")
    args = parser.parse_args()

    target = load_target(args.target, ServeOptions(dtype="bfloat16"))
    if args.streams:
        print(f"device {mx.default_device()}; target kernels {target.model.kernels}", flush=True)
        shared_verify(target.model, args.streams, [int(d) for d in args.depths.split(",")], args.repeats)
        return 0
    drafter = start_drafter(args.drafter, target.model, target.tokenizer, DrafterOptions(dtype="bfloat16"))
    print(f"device {mx.default_device()}; target kernels {target.model.kernels}", flush=True)
    tiny = mx.array([1.0])
    print(f"empty eval round trip: {median_ms(lambda: mx.eval(tiny + 1), args.repeats):.3f} ms", flush=True)
    for rows in (1, 2, 4, 5, 8):
        print(f"target forward {rows} rows: {forward_ms(target.model, rows, args.repeats):.2f} ms", flush=True)
    for rows in (1, 5):
        print(f"drafter (MLX ops) forward {rows} rows: {forward_ms(drafter.model, rows, args.repeats):.2f} ms",
              flush=True)
    build, whole = chain_ms(drafter, args.repeats)
    print(f"drafter (MLX ops) propose depth 4: {whole:.2f} ms, of which {build:.2f} ms building the graph",
          flush=True)
    ckpt = open_checkpoint(args.drafter)
    tabled = LlamaDrafter(load(ckpt, LoadOptions(dtype="bfloat16")), vocab_limit=target.model.vocab_size,
                          eos_ids=frozenset(), options=DrafterOptions(dtype="bfloat16"))
    print(f"drafter kernels {tabled.model.kernels}", flush=True)
    for rows in (1, 5):
        print(f"drafter (table) forward {rows} rows: {forward_ms(tabled.model, rows, args.repeats):.2f} ms",
              flush=True)
    build, whole = chain_ms(tabled, args.repeats)
    print(f"drafter (table) propose depth 4: {whole:.2f} ms, of which {build:.2f} ms building the graph", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
