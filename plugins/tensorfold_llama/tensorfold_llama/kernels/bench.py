"""GB/s of the contract's row-invariant GEMV against MLX's matmul / quantized_matmul, at 1 to 128 rows."""

# python -m tensorfold_llama.kernels.bench [--json OUT] [--reps 5] [--launches 20]
# Each timing evaluates `launches` independent calls at once (one eval's synchronisation spread over them) and keeps
# the median of `reps`; GB/s counts the weight bytes (scales and biases included), as the device notes do.
# No cell is timed before both outputs match the record's float64 reference on the very inputs timed: a fast wrong
# kernel must not print a speed.

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import mlx.core as mx
import numpy as np

from tensorfold_contract.gates import Inputs, _build, compare, run
from tensorfold_contract.record import Case, KernelRecord, Shape, Tolerance

from .common import BF16_ULP
from .gemv import BF16, OUT, Q4, source

SIZES = ((8192, 8192, "N=K=8192"), (14336, 4096, "8B gate/up 14336x4096"))
ROWS = (1, 4, 8, 16, 64, 128)
RECORDS = {16: BF16, 4: Q4}
GROUP = 64
SEED = 0
# MLX's built-ins compute in bf16 (its CPU 4-bit kernel even accumulates in it), so no fp32 bound holds for them:
# their check proves they compute this product (a wrong layout, group or transpose is off by the output's own size)
BUILTIN_TOLERANCE = Tolerance(rtol=8 * BF16_ULP)


def timed(fn, reps: int, launches: int) -> float:
    """Seconds per call: median over `reps` of one eval of `launches` calls."""
    mx.eval(fn())
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(launches)])
        samples.append((time.perf_counter() - t0) / launches)
    return statistics.median(samples)


def ours(bits: int, case: Case):
    """One launch of the contract's cuda source on the case's device arrays, without the gates' poison fill."""
    src = source("cuda", bits)
    launch = src.launch(case)
    kernel = _build("cuda", src, launch.dynamic_shared)
    inputs = src.inputs(case)

    def call():
        return kernel(inputs=inputs, template=list(launch.template), grid=launch.grid, threadgroup=launch.threadgroup,
                      output_shapes=list(launch.output_shapes), output_dtypes=list(launch.output_dtypes))[0]

    return call


def builtin(bits: int, case: Case):
    """The MLX call our kernel replaces, on bf16 activations as the model gives them (bf16 out, as ours)."""
    x = case.array("x", mx.bfloat16)
    if bits == 16:
        w = case.array("w", mx.bfloat16)
        return lambda: x @ w.T
    wq, scales, biases = case.array("wq"), case.array("scales", mx.bfloat16), case.array("biases", mx.bfloat16)
    return lambda: mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=case.dims["group"], bits=bits)


def off_reference(who: str, record: KernelRecord, case: Case, got, reference: np.ndarray) -> str | None:
    """Why `got` (one call's y) is not the reference's first rows within the record's tolerance; None when it is."""
    ok, why, _ = compare(record, case, {"y": got}, {"y": reference[:case.rows]})
    return None if ok else f"{who}, {case.rows} rows: {why}"


def mismatches(bits: int, case: Case, reference: np.ndarray) -> list[str]:
    """Ours within the record's tolerance (poison-filled, so an unwritten element shows), and MLX's built-in."""
    record = RECORDS[bits]
    found = [off_reference("ours", record, case, run("cuda", source("cuda", bits), case)["y"], reference),
             off_reference("mlx", dataclasses.replace(record, tolerance=BUILTIN_TOLERANCE), case,
                           builtin(bits, case)(), reference)]
    return [why for why in found if why]


def measure(reps: int, launches: int) -> tuple[list[dict], list[str]]:
    """Every cell checked, then timed; (timed rows, failures of cells left untimed)."""
    out, failures = [], []
    for n, k, label in SIZES:
        for bits in (16, 4):
            weights = "bf16" if bits == 16 else "4-bit"
            dims = {"n": n, "k": k, "out": OUT} if bits == 16 else {"n": n, "k": k, "group": GROUP, "out": OUT}
            full = Inputs(RECORDS[bits], SEED).case(Shape(f"{label} {weights}", dims, max(ROWS)), max(ROWS))
            reference = RECORDS[bits].reference(full)["y"]  # rows are independent: the widest serves every call
            names = ("w",) if bits == 16 else ("wq", "scales", "biases")
            weight_bytes = sum(full.array(a, mx.bfloat16 if a != "wq" else None).nbytes for a in names)
            for rows in ROWS:
                case = full.take_rows(0, rows)
                wrong = mismatches(bits, case, reference)
                if wrong:
                    failures += wrong
                    print(f"{label:>22} {weights:>5} rows {rows:>2}: FAIL {'; '.join(wrong)}; not timed", flush=True)
                    continue
                t_ours = timed(ours(bits, case), reps, launches)
                t_mlx = timed(builtin(bits, case), reps, launches)
                row = {"size": label, "n": n, "k": k, "weights": weights, "rows": rows,
                       "ours_us": round(t_ours * 1e6, 1), "ours_gbps": round(weight_bytes / t_ours / 1e9, 1),
                       "mlx_us": round(t_mlx * 1e6, 1), "mlx_gbps": round(weight_bytes / t_mlx / 1e9, 1),
                       "ours_vs_mlx": round(t_mlx / t_ours, 2)}
                out.append(row)
                print(f"{label:>22} {row['weights']:>5} rows {rows:>2}: ours {row['ours_us']:>8.1f} us "
                      f"{row['ours_gbps']:>7.1f} GB/s | mlx {row['mlx_us']:>8.1f} us {row['mlx_gbps']:>7.1f} GB/s "
                      f"| x{row['ours_vs_mlx']}", flush=True)
    return out, failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tensorfold_llama.kernels.bench", description=__doc__)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--launches", type=int, default=20)
    args = parser.parse_args(argv)
    if not (getattr(mx, "cuda", None) and mx.cuda.is_available()):
        print("the GEMV benchmark times the cuda source: no CUDA device here", file=sys.stderr)
        return 2
    info = dict(mx.device_info()) if hasattr(mx, "device_info") else {}
    results, failures = measure(args.reps, args.launches)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": {k: str(v) for k, v in info.items()}, "mlx": mx.__version__, "reps": args.reps,
                       "launches_per_eval": args.launches, "checked": "outputs against the float64 reference first",
                       "results": results, "failures": failures}, f, indent=1)
    if failures:
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        print(f"FAIL {failures[0]}{more}; those cells were not timed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
