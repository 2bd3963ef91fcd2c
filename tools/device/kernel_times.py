"""Where a decode step's device time goes: each kernel's duration under Nsight Compute, summed by kernel, per step.

    python3 tools/device/kernel_times.py TARGET [--streams 1] [--steps 4] [--top 30] [--json OUT] [--warm]

Runs itself under `ncu --clock-control none` (the clocks left alone, METHOD.md) with profiling off until the timed
steps: a prompt is read and a few steps run first, so MLX has built every kernel, then `--steps` one-token steps
per stream run between cudaProfilerStart and cudaProfilerStop. Each step's wall time is taken in a run of its own
without ncu (attached, even switched off, it slows every launch about tenfold); the report sets the kernels' summed
device time a step beside it, so the rest is the device waiting on the host. ncu serializes kernels, so these are
each kernel's own times, not overlap; and it flushes the caches before each one, so a kernel whose inputs a served
step finds in L2 (a cache's keys, a norm's row) shows its cold time: `--warm` keeps the caches between kernels.
Run it under the kernel table mode to profile (TENSORFOLD_KERNELS, through run_on_h200.sh exec).
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import glob
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

PROMPT = "def quicksort(items):\n    if len(items) <= 1:\n        return items\n"
WARM_STEPS = 3  # steps run before the timed ones: MLX builds each kernel at its first call
INNER = "TF_KERNEL_TIMES_INNER"  # set in the profiled child


def cudart() -> ctypes.CDLL:
    """The CUDA runtime MLX runs on, as mapped in this process, else one found on disk (its profiler switches act
    on the device's primary context, which every runtime in the process shares)."""
    maps = Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else ""
    mapped = sorted({line.split()[-1] for line in maps.splitlines() if "libcudart.so" in line})
    names = mapped + [p for root in sys.path + ["/usr/local/cuda/lib64"] if root and os.path.isdir(root)
             for p in glob.glob(os.path.join(root, "**", "libcudart.so*"), recursive=True)]
    for name in names + ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise SystemExit("kernel_times: no libcudart found to switch the profiler on (looked on sys.path and "
                     "/usr/local/cuda/lib64)")


def ncu_path() -> str:
    found = shutil.which("ncu") or next(iter(sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))), None)
    if found is None:
        raise SystemExit("kernel_times: Nsight Compute's ncu is not on this machine (PATH, /opt/nvidia/nsight-compute)")
    return found


def steps(model, caches, token: int, n: int) -> float:
    """`n` one-token steps of every stream, each evaluated; wall ms a step."""
    import mlx.core as mx

    start = time.perf_counter()
    for _ in range(n):
        mx.eval(model.forward(caches, [[token]] * len(caches), [1] * len(caches)))
        for cache in caches:
            model.keep(cache, 1)
    return (time.perf_counter() - start) * 1000.0 / max(n, 1)


def inner(args) -> None:
    """A child: warm up, then time the steps (the run without ncu) or run them with the profiler on (under ncu)."""
    import mlx.core as mx

    from tensorfold_core.loading import load_target
    from tensorfold_core.options import ServeOptions

    target = load_target(args.target, ServeOptions())
    model = target.model
    ids = target.tokenizer.encode(PROMPT)
    room = len(ids) + WARM_STEPS + 2 * args.steps + 8
    caches = [model.new_cache(room) for _ in range(args.streams)]
    mx.eval(model.forward(caches, [ids] * args.streams, [1] * args.streams))
    for cache in caches:
        model.keep(cache, len(ids))
    steps(model, caches, ids[-1], WARM_STEPS)
    if os.environ[INNER] == "wall":  # the run without ncu: the best of two, as ncu's attach slows every launch
        print(json.dumps({"wall_ms_a_step": min(steps(model, caches, ids[-1], args.steps) for _ in range(2))}))
        return
    runtime = cudart()
    mx.synchronize()
    runtime.cudaProfilerStart()
    steps(model, caches, ids[-1], args.steps)
    mx.synchronize()
    runtime.cudaProfilerStop()


def short(name: str) -> str:
    """A kernel's name without its template arguments and parameter list."""
    name = re.sub(r"\(.*$", "", name)
    return re.sub(r"<.*>", "<...>", name)[:110]


def report(ncu_csv: str, wall: float, steps_run: int, top: int) -> dict:
    by_kernel: dict[str, list[float]] = defaultdict(list)
    rows = [r for r in csv.reader(io.StringIO(ncu_csv)) if len(r) > 5]
    header = rows[0]
    name_at, unit_at, value_at = header.index("Kernel Name"), header.index("Metric Unit"), header.index("Metric Value")
    scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
    for row in rows[1:]:
        by_kernel[short(row[name_at])].append(float(row[value_at].replace(",", "")) * scale[row[unit_at]])
    total = sum(sum(v) for v in by_kernel.values()) / steps_run
    print(f"\nwall {wall * 1000:.1f} us a step (unprofiled, each step evaluated); kernels' device time "
          f"{total:.1f} us a step ({sum(len(v) for v in by_kernel.values()) / steps_run:.0f} launches): the device "
          f"works {100 * total / (wall * 1000):.0f}% of the step")
    print(f"{'us a step':>10} {'launches':>9} {'us each':>8}  kernel")
    ranked = sorted(by_kernel.items(), key=lambda kv: -sum(kv[1]))
    for name, times in ranked[:top]:
        print(f"{sum(times) / steps_run:10.1f} {len(times) / steps_run:9.1f} {sum(times) / len(times):8.2f}  {name}")
    return {"wall_us_a_step": wall * 1000, "device_us_a_step": total,
            "kernels": {name: {"us_a_step": sum(t) / steps_run, "launches_a_step": len(t) / steps_run}
                        for name, t in ranked}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--warm", action="store_true",
                        help="keep the caches between kernels (ncu --cache-control none), as a served step finds them")
    args = parser.parse_args(argv)
    if os.environ.get(INNER):
        inner(args)
        return 0
    child = [sys.executable, __file__, args.target, "--streams", str(args.streams), "--steps", str(args.steps)]
    timed = subprocess.run(child, env={**os.environ, INNER: "wall"}, capture_output=True, text=True)
    if timed.returncode != 0:
        sys.stderr.write(timed.stderr[-3000:])
        raise SystemExit(f"kernel_times: the unprofiled run exited {timed.returncode}")
    meta = json.loads(next(line for line in timed.stdout.splitlines() if line.startswith('{"wall_ms_a_step"')))
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "ncu.csv"  # ncu's results and messages; the child's own output stays on stdout
        warm = ["--cache-control", "none"] if args.warm else []
        command = [ncu_path(), "--clock-control", "none", *warm, "--profile-from-start", "off", "--metrics",
                   "gpu__time_duration.sum", "--csv", "--print-units", "base", "--log-file", str(log),
                   *child]
        done = subprocess.run(command, env={**os.environ, INNER: "1"}, capture_output=True, text=True)
        ncu_text = log.read_text() if log.exists() else ""
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-3000:] + ncu_text[-3000:])
        raise SystemExit(f"kernel_times: ncu exited {done.returncode}")
    table = "\n".join(line for line in ncu_text.splitlines() if line.startswith('"'))
    if not table:
        sys.stderr.write(ncu_text[-3000:])
        raise SystemExit("kernel_times: ncu profiled no kernel between cudaProfilerStart and cudaProfilerStop")
    out = report(table, meta["wall_ms_a_step"], args.steps, args.top)
    if args.json:
        args.json.write_text(json.dumps({"target": args.target, "streams": args.streams, "warm": args.warm, **out},
                                        indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
