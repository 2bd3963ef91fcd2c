"""GB/s of the contract's row-invariant GEMV against MLX's matmul / quantized_matmul, at 1, 4, 8 and 16 rows."""

# python -m tensorfold_llama.kernels.bench [--json OUT] [--reps 5] [--launches 20]
# Each timing evaluates `launches` independent calls at once (one eval's synchronisation spread over them) and keeps
# the median of `reps`; GB/s counts the weight bytes (scales and biases included), as the device notes do.

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import mlx.core as mx

from tensorfold_contract.gates import _build
from tensorfold_contract.record import Case, Shape

from .gemv import source

SIZES = ((8192, 8192, "N=K=8192"), (14336, 4096, "8B gate/up 14336x4096"))
ROWS = (1, 4, 8, 16)


def timed(fn, reps: int, launches: int) -> float:
    """Seconds per call: median over `reps` of one eval of `launches` calls."""
    mx.eval(fn())
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(launches)])
        samples.append((time.perf_counter() - t0) / launches)
    return statistics.median(samples)


def ours(bits: int, n: int, k: int, rows: int, arrays: dict):
    src = source("cuda", bits)
    dims = {"n": n, "k": k} if bits == 16 else {"n": n, "k": k, "group": 64}
    launch = src.launch(Case(Shape("bench", dims, rows), rows, {}, ("x",)))
    kernel = _build("cuda", src, launch.dynamic_shared)
    names = ("x", "w") if bits == 16 else ("x", "wq", "scales", "biases")
    inputs = [arrays[name] if name != "x" else arrays["x"][:rows] for name in names]
    inputs.append(mx.array([rows, n, k], dtype=mx.int32))

    def call():
        return kernel(inputs=inputs, template=list(launch.template), grid=launch.grid, threadgroup=launch.threadgroup,
                      output_shapes=list(launch.output_shapes), output_dtypes=list(launch.output_dtypes))[0]

    return call


def builtin(bits: int, rows: int, arrays: dict):
    x = arrays["x"][:rows]
    if bits == 16:
        return lambda: x @ arrays["w"].T
    return lambda: mx.quantized_matmul(x, arrays["wq"], arrays["scales"], arrays["biases"], transpose=True,
                                       group_size=64, bits=bits)


def measure(reps: int, launches: int) -> list[dict]:
    out = []
    for n, k, label in SIZES:
        w = (mx.random.normal((n, k)) * k ** -0.5).astype(mx.bfloat16)
        x = mx.random.normal((max(ROWS), k)).astype(mx.bfloat16)
        for bits in (16, 4):
            arrays = {"x": x, "w": w}
            if bits != 16:
                wq, scales, biases = mx.quantize(w, group_size=64, bits=bits)
                arrays.update(wq=wq, scales=scales, biases=biases)
            mx.eval(list(arrays.values()))
            weight_bytes = sum(arrays[a].nbytes for a in (("w",) if bits == 16 else ("wq", "scales", "biases")))
            for rows in ROWS:
                t_ours = timed(ours(bits, n, k, rows, arrays), reps, launches)
                t_mlx = timed(builtin(bits, rows, arrays), reps, launches)
                row = {"size": label, "n": n, "k": k, "weights": "bf16" if bits == 16 else "4-bit", "rows": rows,
                       "ours_us": round(t_ours * 1e6, 1), "ours_gbps": round(weight_bytes / t_ours / 1e9, 1),
                       "mlx_us": round(t_mlx * 1e6, 1), "mlx_gbps": round(weight_bytes / t_mlx / 1e9, 1),
                       "ours_vs_mlx": round(t_mlx / t_ours, 2)}
                out.append(row)
                print(f"{label:>22} {row['weights']:>5} rows {rows:>2}: ours {row['ours_us']:>8.1f} us "
                      f"{row['ours_gbps']:>7.1f} GB/s | mlx {row['mlx_us']:>8.1f} us {row['mlx_gbps']:>7.1f} GB/s "
                      f"| x{row['ours_vs_mlx']}", flush=True)
    return out


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
    results = measure(args.reps, args.launches)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": {k: str(v) for k, v in info.items()}, "mlx": mx.__version__, "reps": args.reps,
                       "launches_per_eval": args.launches, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
